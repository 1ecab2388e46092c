"""kubetitan_trainer.storage without a server: the keep-latest-K rule as a table, the local store's discovery and
deletion on a real folder, URI parsing, and the message a bucket the trainer cannot list gets."""

from __future__ import annotations

import pytest

from kubetitan_core import contract
from kubetitan_trainer import storage
from kubetitan_trainer.errors import ConfigError


class Listed(storage.CheckpointStore):
    def __init__(self, entries: dict[int, bool]) -> None:
        self.root, self._entries = "mem", entries

    def entries(self) -> list[tuple[str, bool]]:
        return [(f"step-{s}", done) for s, done in self._entries.items()] + [("tb", False), ("step-x", True)]


# (id, step -> complete, K, steps keep-latest-K deletes)
PURGE = [
    ("keep-all", {2: True, 4: True, 6: True}, 0, []),
    ("fewer-than-k", {2: True, 4: True}, 3, []),
    ("oldest-complete-go", {2: True, 4: True, 6: True, 8: True}, 2, [2, 4]),
    ("cut-off-between-goes", {2: True, 3: False, 4: True, 6: True}, 2, [2, 3]),
    ("newer-cut-off-is-in-flight", {2: True, 4: True, 6: True, 8: False}, 2, [2]),
    ("cut-off-do-not-count-toward-k", {2: True, 4: False, 6: False, 8: True}, 2, []),
    ("only-cut-off", {2: False, 4: False}, 2, []),
]


@pytest.mark.parametrize("entries, k, gone", [c[1:] for c in PURGE], ids=[c[0] for c in PURGE])
def test_keep_latest_k_table(entries, k, gone):
    assert Listed(entries).to_purge(k) == gone


def test_local_store_discovery_and_delete(tmp_path):
    st = storage.LocalStore(str(tmp_path))
    for step, done in ((2, True), (4, True), (6, False)):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x" * 7)
        if done:
            (d / contract.DCP_METADATA_FILE).write_bytes(b"m")
    assert sorted(st.entries()) == [("step-2", True), ("step-4", True), ("step-6", False)]
    assert st.newest_complete_step() == 4 and st.step_bytes(2) == 8
    assert st.purge(1) == [2] and not (tmp_path / "step-2").exists()
    assert storage.LocalStore(str(tmp_path / "none")).entries() == []


@pytest.mark.parametrize("uri", ["s3://bucket/a/b/", "s3://bucket", "s3://b/x"])
def test_an_s3_folder_key_is_the_uri_without_its_trailing_slash(uri):
    assert storage.folder_key(uri + "/") == uri.rstrip("/")


S = storage.S3Settings(uri="s3://ck/run", region="us-west-2")
ERRORS = [
    ("missing", "Service error: The bucket does not exist", "does not exist in region us-west-2", "create the bucket 'ck'"),
    ("denied", "Client error: Forbidden: Access Denied", "access to s3://ck was denied", "s3:ListBucket on arn:aws:s3:::ck"),
    ("no-credentials", "Client error: No signing credentials found", "no AWS credentials", "Pod Identity or IRSA"),
    ("other", "Client error: dns lookup failed", "cannot list s3://ck", "endpoint is reachable"),
]


KINDS = [
    # (id, the error's message as s3torchconnector/the CRT client gives it, its kind: None = transient)
    ("no-bucket", "Service error: The bucket does not exist", "no-bucket"),
    ("no-such-bucket", "Client error: NoSuchBucket: The specified bucket does not exist", "no-bucket"),
    ("forbidden", "Client error: Forbidden: Access Denied", "denied"),
    ("access-denied-code", "Service error: AccessDenied (request id: 5XJ4K)", "denied"),
    ("http-403", "Client error: Unknown response error: HTTP status 403", "denied"),
    ("status-code-403", "Client error: Unknown response error: status_code=403", "denied"),
    ("403-in-request-id", "Service error: InternalError (request id: 8A403B2C403F)", None),
    ("403-in-range", "Client error: Response body truncated for range bytes=4030000-4039999", None),
    ("503-slow-down", "Service error: SlowDown: Please reduce your request rate. (HTTP status 503)", None),
    ("no-credentials", "Client error: No signing credentials found", "credentials"),
    ("invalid-key", "Service error: InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our "
                    "records. (check the credentials)", "credentials"),
    ("pod-identity-timeout", "Client error: Failed to load credentials: AWS_AUTH_CREDENTIALS_PROVIDER_ECS_SOURCE_"
                             "FAILURE: AWS_IO_SOCKET_TIMEOUT: socket operation timed out", None),
    ("pod-identity-refused", "Client error: No signing credentials found (credentials provider: connection refused "
                             "at 169.254.170.23)", None),
    ("imds-unavailable", "Client error: credentials provider failed: IMDS temporarily unavailable", None),
    ("dns", "Client error: dns lookup failed", None),
]


@pytest.mark.parametrize("text, kind", [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_access_error_kind_reads_whole_codes_and_leaves_unreachable_credential_providers_transient(text, kind):
    assert storage.access_error_kind(RuntimeError(text)) == kind


@pytest.mark.parametrize("text, problem, fix", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_access_errors_name_the_bucket_and_the_fix(text, problem, fix):
    field, got_problem, got_fix = storage.describe_access_error(S, "ck", RuntimeError(text))
    assert field == "spec.checkpoint.storage.s3.uri" and problem in got_problem and fix in got_fix
    assert "Fix:" in str(ConfigError(field, got_problem, got_fix))


# ---------------------------------------------------------------------------------------------- outages
class S3Exception(Exception):
    """Stands for s3torchconnectorclient's S3Exception (storage.storage_failure knows it by its name)."""


REFUSED = "Client error: Failed to construct request: Connection refused (os error 111)"


class FlakyList:
    """A client whose LIST fails ``fails`` times (``error``), then answers."""

    def __init__(self, fails: int, error: str = REFUSED) -> None:
        self.fails, self.error, self.calls = fails, error, 0

    def list_objects(self, bucket, prefix, max_keys=1000):
        self.calls += 1
        if self.calls <= self.fails:
            raise S3Exception(self.error)
        return iter([object()])


def _store(monkeypatch, client) -> storage.S3Store:
    from kubetitan_trainer import compat

    monkeypatch.setattr(compat, "s3_client", lambda settings, config: client)
    return storage.S3Store(storage.S3Settings(uri="s3://b/run", endpoint="http://127.0.0.1:9"))


def test_an_unreachable_store_on_the_first_start_is_a_config_error(monkeypatch, tmp_path):
    """Never reached by this run: a wrong endpoint, exit code 2 at once (one LIST, no retry)."""
    client = FlakyList(fails=99)
    with pytest.raises(ConfigError, match="cannot list s3://b at http://127.0.0.1:9") as e:
        storage.preflight(_store(monkeypatch, client), str(tmp_path), sleep=lambda s: None)
    assert e.value.exit_code == 2 and client.calls == 1


def test_a_store_reached_before_is_retried_through_an_outage_and_marks_itself(monkeypatch, tmp_path, caplog):
    """An in-place restart (the marker the first start wrote) whose LIST is refused twice: retried, then fine."""
    store = _store(monkeypatch, FlakyList(fails=0))
    storage.preflight(store, str(tmp_path))  # the first start: reached, the marker written
    assert storage.reached_before(store, str(tmp_path), env={})
    client = FlakyList(fails=2)
    waits: list[float] = []
    storage.preflight(_store(monkeypatch, client), str(tmp_path), sleep=waits.append)
    assert client.calls == 3 and waits == [2.0, 4.0]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Listing the checkpoint store s3://b/run: ")]
    assert len(said) == 2 and "Connection refused" in said[0], said


def test_a_store_reached_before_that_stays_down_is_retryable_not_a_config_error(monkeypatch, tmp_path):
    from kubetitan_trainer.errors import TransientError

    client = FlakyList(fails=99)
    store = _store(monkeypatch, client)
    assert storage.reached_before(store, str(tmp_path), env={contract.ENV_ATTEMPT: "1"})  # a later attempt
    waits: list[float] = []
    with pytest.raises(TransientError) as e:
        store.preflight(reached_before=True, sleep=waits.append)
    assert e.value.exit_code == 6 and client.calls == storage.PREFLIGHT_ATTEMPTS
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    msg = str(e.value)
    assert "did not answer 8 LISTs" in msg and "Connection refused" in msg and "exit code 6" in msg, msg
    assert "\n" not in msg and "Traceback" not in msg
    # a denied LIST is still a configuration error, reached before or not
    with pytest.raises(ConfigError, match="access to s3://b was denied"):
        _store(monkeypatch, FlakyList(fails=9, error="Client error: AccessDenied")).preflight(reached_before=True)


def test_the_marker_of_another_store_does_not_count(monkeypatch, tmp_path):
    storage.preflight(_store(monkeypatch, FlakyList(fails=0)), str(tmp_path))
    other = storage.S3Store(storage.S3Settings(uri="s3://b/other", endpoint="http://127.0.0.1:9"))
    assert not storage.reached_before(other, str(tmp_path), env={})


def _checkpoint_exception(inner: BaseException) -> BaseException:
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write", {1: (inner, traceback.StackSummary())})


@pytest.mark.parametrize("make, want", [
    (lambda: S3Exception(REFUSED + "\n  more"), "S3Exception: " + REFUSED + " more"),
    (lambda: ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: [Errno 111] Connection refused"),
    (lambda: _checkpoint_exception(S3Exception(REFUSED)), "S3Exception: " + REFUSED),
    (lambda: ValueError("a bug"), None),
    (lambda: _checkpoint_exception(KeyError("model.w")), None),
], ids=["s3", "oserror", "inside-dcp", "bug", "bug-inside-dcp"])
def test_storage_failure_is_one_line_or_none(make, want):
    assert storage.storage_failure(make()) == want


def test_failed_saves_are_counted_in_a_row_and_the_budget_ends_the_run(caplog):
    from kubetitan_trainer.errors import TransientError

    budget = storage.SaveBudget(3, "s3://b/run", interval=2)

    def fail():
        raise _checkpoint_exception(S3Exception(REFUSED))

    assert not budget.attempt(fail, 4)
    budget.check()  # 1 of 3: training goes on
    assert budget.attempt(lambda: None, 6)
    budget.written(6, background=False)
    assert budget.in_a_row == 0  # a save that worked: the count starts again
    for step in (8, 10):
        assert not budget.attempt(fail, step)
        budget.check()
    said = [r.getMessage() for r in caplog.records if "Checkpoint save of step 8" in r.getMessage()]
    assert said == ["Checkpoint save of step 8 to s3://b/run failed (S3Exception: " + REFUSED + "); training goes on "
                    "and saves again at step 10 (1 failed in a row; 3 end the run: spec.checkpoint.maxFailedSaves)"]
    assert not budget.attempt(fail, 12)
    with pytest.raises(TransientError) as e:
        budget.check()
    assert e.value.exit_code == 6 and "3 checkpoint saves in a row to s3://b/run failed (steps 8, 10, 12" in str(e.value)
    with pytest.raises(ValueError, match="a bug"):  # not a storage failure: not counted, raised
        budget.attempt(lambda: (_ for _ in ()).throw(ValueError("a bug")), 14)


def test_a_background_write_counts_when_the_next_save_waits_for_it():
    from concurrent.futures import Future

    budget = storage.SaveBudget(2, "s3://b/run", interval=2)
    write: Future = Future()
    budget.written(4, background=True)
    write.set_exception(_checkpoint_exception(S3Exception(REFUSED)))
    assert budget.settle(write) is True and budget.in_a_row == 1 and budget.failed_steps == [4]
    ok: Future = Future()
    budget.written(6, background=True)
    ok.set_result(None)
    assert budget.settle(ok) is False and budget.in_a_row == 0


def test_a_write_cut_off_by_an_in_process_restart_is_said_and_never_counted():
    """``abandon``: the restart forgets the last save's write whatever became of it; a storage error there is the
    fault's doing, not a failed save against the budget, and a write still running is not waited for past the bound."""
    from concurrent.futures import Future

    budget = storage.SaveBudget(2, "s3://b/run", interval=2)
    running: Future = Future()
    budget.written(4, background=True)
    assert budget.abandon(running, timeout=0.01) == "still running after 0 s"
    failed: Future = Future()
    failed.set_exception(_checkpoint_exception(S3Exception(REFUSED)))
    budget.written(6, background=True)
    assert budget.abandon(failed).startswith("failed: ")
    ok: Future = Future()
    ok.set_result(None)
    assert budget.abandon(ok) is None and budget.abandon(None) is None
    assert budget.in_a_row == 0 and budget.failed_steps == [] and budget.pending_step is None
    assert budget.settle(failed) is False  # forgotten: the next save does not count it either


def test_the_last_save_is_tried_budget_times_then_ends_the_run():
    from kubetitan_trainer.errors import TransientError

    tries: list[int] = []
    waits: list[float] = []
    budget = storage.SaveBudget(3, "s3://b/run", interval=2, sleep=waits.append)

    def fail():
        tries.append(1)
        raise S3Exception(REFUSED)

    assert not budget.attempt(fail, 20, last=True)
    assert len(tries) == 3 and waits == [5.0, 10.0]
    with pytest.raises(TransientError):
        budget.check()
    flaky = iter([S3Exception(REFUSED), None])

    def once_then_ok():
        e = next(flaky)
        if e is not None:
            raise e

    again = storage.SaveBudget(3, "s3://b/run", interval=2, sleep=lambda s: None)
    assert again.attempt(once_then_ok, 20, last=True)


@pytest.mark.parametrize("where", ["open", "close"])
def test_a_write_error_on_any_writer_thread_fails_the_save_without_a_thread_traceback(tmp_path, capfd, where):
    """compat._raise_stream_errors on a DCP writer with 3 threads: the data objects fail to open (or to close: the
    upload's last part), on every thread; the save fails with that error (DCP's CheckpointException, which
    SaveBudget counts) and nothing is printed. Without it an error on an extra thread printed a thread
    traceback, and DCP went on without that file's results."""
    import contextlib

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from kubetitan_trainer import compat

    writer = dcp.FileSystemWriter(str(tmp_path / "ck"), thread_count=3)
    real = writer.fs.create_stream

    @contextlib.contextmanager
    def flaky(path, mode):
        bad = mode == "wb" and str(path).endswith(".distcp")  # every data file: each writer thread meets one
        if bad and where == "open":
            raise S3Exception(REFUSED)
        with real(path, mode) as stream:
            yield stream
            if bad:
                raise S3Exception("Client error: AWS_IO_SOCKET_CLOSED, socket is closed.")

    writer.fs.create_stream = flaky
    compat._raise_stream_errors(writer)
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(9)}
    with pytest.raises(CheckpointException) as e:
        dcp.save(state, storage_writer=writer, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert storage.storage_failure(e.value).startswith("S3Exception: "), e.value
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_failed_saves_are_exported_as_the_operator_reads_them():
    """SaveBudget -> metrics.Exporter -> exposition text -> the operator's parse and observation: the failed saves in a
    row, their total, the budget, the last failed step and its error class (an errno name), and all clear but the
    total once a save completes."""
    import errno

    from prometheus_client import generate_latest

    from kubetitan import scraped
    from kubetitan.observation import scrape, tracking
    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=None, total_steps=100, attempt=0, job_start=0.0)
    budget = storage.SaveBudget(4, "/ck", interval=2)
    budget.report = ex.checkpoint_saves
    budget.report(budget)

    def seen():
        kept, refused = scraped.check(scrape.parse_metrics(generate_latest(ex.registry).decode()), attempt=0,
                                      prev=None, now=1e9)
        assert refused == []
        return tracking.track(None, 0, 1e9, metrics=kept)

    o = seen()
    assert (o.saves_failed_in_a_row, o.saves_failed, o.max_failed_saves, o.last_failed_save_step) == (0, 0, 4, None)
    no_space = OSError(errno.ENOSPC, "No space left on device")
    assert not budget.attempt(lambda: (_ for _ in ()).throw(_checkpoint_exception(no_space)), 6)
    assert not budget.attempt(lambda: (_ for _ in ()).throw(S3Exception(REFUSED)), 8)
    o = seen()
    assert (o.saves_failed_in_a_row, o.saves_failed, o.last_failed_save_step, o.last_save_error) == \
        (2, 2, 8, "S3Exception")
    assert budget.attempt(lambda: None, 10)
    budget.written(10, background=False)
    o = seen()
    assert (o.saves_failed_in_a_row, o.saves_failed, o.last_save_error) == (0, 2, None)
    assert storage.storage_error_class(_checkpoint_exception(no_space)) == "ENOSPC"
