"""Where checkpoints live: a local (or PVC-mounted) folder, or an S3 prefix. The one storage layer of the trainer.

Every module that needs the checkpoint store goes through a :class:`CheckpointStore`:

- **DCP writer/reader** (:meth:`CheckpointStore.writer`, :meth:`CheckpointStore.reader`): None for a local folder
  (DCP picks its ``FileSystemWriter``/``Reader`` from the path, exactly as before); for S3, s3torchconnector's
  ``S3StorageWriter``/``S3StorageReader`` on a client this module configures (endpoint, path-style addressing,
  retries: :func:`kubetitan_trainer.compat.s3_storage_writer`).
- **Newest-complete discovery** (:meth:`CheckpointStore.entries`): ``(step-N, has .metadata)`` pairs for the one
  resume rule (``kubetitan_core.contract.newest_complete_step``). DCP writes ``.metadata`` last (on S3: a copy of
  ``.metadata.tmp`` once every rank's files are written), so a save cut off mid-way is never resumed from.
- **What a checkpoint holds** (:meth:`CheckpointStore.saved_keys`): the flattened state-dict keys of its DCP
  metadata, so a load can leave out what an older trainer did not save.
- **Keep-latest-K** (:meth:`CheckpointStore.purge`): the K newest complete steps stay, everything older goes.
- **Pre-flight** (:func:`preflight`): a bucket that does not exist or denies access is a configuration error (exit
  code 2) that names the bucket and the fix, found before the model is built. An endpoint that does not answer is
  one too on the run's first start (a wrong endpoint), but not once the run has reached the store before (a marker
  in ``job.dump_folder``, or an attempt after the first): then it is an outage, retried
  (:data:`PREFLIGHT_ATTEMPTS`) and then exit code 6 (retryable), never 2.
- **Failed saves** (:class:`SaveBudget`): a save that fails with a storage error is logged in one line and training
  goes on; the next interval saves again; ``max_failed_saves`` (``spec.checkpoint.maxFailedSaves``) failures in a row
  end the run with exit code 6.
  Both retry through ``kubetitan_trainer.retry`` (tenacity), the trainer's one retry loop.

With checkpoints in S3, everything else the trainer writes stays in ``job.dump_folder`` on the pod's local
filesystem (the pod's scratch ``emptyDir``, or the checkpoint PVC when one is mounted too): the torch.compile
cache, the step log (``kubetitan/steps.jsonl``), the downloaded tokenizer, TensorBoard events and the restore tier.
None of them must outlive the pod for a resume: the checkpoint alone carries the training state.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetitan_core import contract
from kubetitan_core.contract import is_s3_uri, split_s3_uri
from kubetitan_trainer.retry import retry

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")


def folder_key(path: str) -> str:
    """A stable identity of a checkpoint location (an absolute path, or the URI itself)."""
    return str(path).rstrip("/") if is_s3_uri(path) else os.path.abspath(path)


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """How to reach the bucket (``[kubetitan.checkpoint_storage]``)."""

    uri: str
    region: str = "us-east-1"
    endpoint: str = ""
    """Empty: AWS's regional endpoint. Otherwise an S3-compatible server's URL (``https://...``)."""
    force_path_style: bool = False
    max_attempts: int = 10
    """Attempts per request by the client's own retry strategy (exponential backoff with jitter): 503 SlowDown,
    500s, throttling, connection resets and timeouts are retried there before a save or load sees an error."""
    part_size_bytes: int = 16 * 2**20
    """Multipart upload/ranged download part size (at least 5 MiB)."""
    throughput_target_gbps: float = 10.0
    """The CRT client's throughput target; it sizes its connection pool from it."""
    thread_count: int = 4
    """DCP writer threads per rank (each writes its own ``.distcp`` file: files per save = ranks x this)."""


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a checkpoint step's folder); files that vanish meanwhile count 0."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file that vanished meanwhile counts 0
                total += os.path.getsize(os.path.join(root, f))
    return total


class CheckpointStore:
    """A place for step-N checkpoints: ``root`` is the folder or the URI that ``step-N`` names go under."""

    root: str
    remote: bool = False

    def step_id(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step}" if self.remote else os.path.join(self.root, f"step-{step}")

    def entries(self) -> list[tuple[str, bool]]:
        raise NotImplementedError

    def newest_complete_step(self) -> int | None:
        return contract.newest_complete_step(self.entries())

    def writer(self, checkpoint_id: str) -> Any:
        return None

    def reader(self, checkpoint_id: str) -> Any:
        return None

    def saved_keys(self, checkpoint_id: str) -> set[str]:
        """The flattened state-dict keys (``train_state.step``, ...) the checkpoint ``checkpoint_id`` holds, read
        from its DCP metadata with the store's reader (DCP's filesystem reader for a local folder)."""
        from torch.distributed.checkpoint import FileSystemReader

        reader = self.reader(checkpoint_id) or FileSystemReader(checkpoint_id)
        return set(reader.read_metadata().state_dict_metadata)

    def delete_step(self, step: int) -> None:
        raise NotImplementedError

    def step_bytes(self, step: int) -> int:
        raise NotImplementedError

    def preflight(self) -> None:
        """Raise :class:`~kubetitan_trainer.errors.ConfigError` when the store cannot be used at all."""

    def to_purge(self, keep_latest_k: int) -> list[int]:
        """Steps keep-latest-K removes: all older than the K-th newest complete step (complete or cut off). A step
        newer than the newest complete one may be a save still in flight and is never removed."""
        if keep_latest_k <= 0:
            return []
        complete = sorted(int(m.group(1)) for n, done in self.entries() if done and (m := _STEP.match(n)))
        if len(complete) <= keep_latest_k:
            return []
        oldest_kept = complete[-keep_latest_k]
        every = sorted(int(m.group(1)) for n, _ in self.entries() if (m := _STEP.match(n)))
        return [s for s in every if s < oldest_kept]

    def purge(self, keep_latest_k: int) -> list[int]:
        gone = self.to_purge(keep_latest_k)
        for step in gone:
            self.delete_step(step)
        return gone


class LocalStore(CheckpointStore):
    """A folder on a local disk or a mounted volume (PVC, hostPath): DCP's own filesystem writer and reader."""

    def __init__(self, folder: str) -> None:
        self.root = folder

    def entries(self) -> list[tuple[str, bool]]:
        if not os.path.isdir(self.root):
            return []
        return [(n, os.path.isfile(os.path.join(self.root, n, contract.DCP_METADATA_FILE))) for n in os.listdir(self.root)]

    def delete_step(self, step: int) -> None:
        path = self.step_id(step)
        meta = os.path.join(path, contract.DCP_METADATA_FILE)
        if os.path.exists(meta):
            os.unlink(meta)  # first: a half-deleted step never looks complete
        shutil.rmtree(path, ignore_errors=True)

    def step_bytes(self, step: int) -> int:
        return dir_bytes(self.step_id(step))


class S3Store(CheckpointStore):
    """An S3 prefix (AWS or an S3-compatible server) through s3torchconnector: ``<uri>/step-N/...`` objects."""

    remote = True

    def __init__(self, settings: S3Settings) -> None:
        from kubetitan_trainer import compat

        self.settings = settings
        # s3torchconnector logs every failed object write at INFO ("Exception occurred before closing stream"); a
        # failed save is said once, by SaveBudget
        logging.getLogger("s3torchconnector.s3writer").setLevel(logging.WARNING)
        self.root = settings.uri.rstrip("/")
        self.bucket, self.prefix = split_s3_uri(self.root)
        self._config = compat.s3_client_config(settings)
        self._client = compat.s3_client(settings, self._config)

    # ---- objects
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def list_keys(self, under: str = "") -> list[tuple[str, int]]:
        """(key relative to the prefix, size) of every object under ``<prefix>/<under>``."""
        base = self._key(under)
        start = f"{base}/" if base else ""
        out: list[tuple[str, int]] = []
        for page in self._client.list_objects(self.bucket, start):
            for info in page.object_info:
                out.append((info.key[len(self._key()) + 1 if self.prefix else 0:], info.size))
        return out

    def entries(self) -> list[tuple[str, bool]]:
        seen: dict[str, bool] = {}
        for key, _size in self.list_keys():
            step, _, rest = key.partition("/")
            if _STEP.match(step):
                seen[step] = seen.get(step, False) or rest == contract.DCP_METADATA_FILE
        return sorted(seen.items())

    def step_bytes(self, step: int) -> int:
        return sum(size for _k, size in self.list_keys(f"step-{step}"))

    def delete_step(self, step: int) -> None:
        keys = [k for k, _ in self.list_keys(f"step-{step}")]
        # .metadata first: a step whose deletion is cut off is incomplete, never resumed from
        keys.sort(key=lambda k: not k.endswith("/" + contract.DCP_METADATA_FILE))
        for k in keys:
            self._client.delete_object(self.bucket, self._key(k))

    def preflight(self, reached_before: bool = False, sleep: Callable[[float], None] = time.sleep) -> None:
        """One LIST of the prefix. A bucket that does not exist or denies access is a ConfigError (exit 2); so is an
        endpoint that does not answer, unless the run has ``reached_before`` this store: then the LIST is tried
        :data:`PREFLIGHT_ATTEMPTS` times and a store still unreachable is a TransientError (exit 6: an outage)."""
        from kubetitan_trainer.errors import ConfigError, TransientError

        def list_one() -> None:
            for _page in self._client.list_objects(self.bucket, self._key() + "/" if self.prefix else "", max_keys=1):
                break

        def outage(e: BaseException) -> bool:
            return reached_before and isinstance(e, Exception) and access_error_kind(e) is None

        try:
            retry(list_one, what=f"Listing the checkpoint store {self.root}", transient=outage,
                  attempts=PREFLIGHT_ATTEMPTS if reached_before else 1, first_wait=2.0, sleep=sleep, say=log.warning,
                  describe=_failure_line)
        except Exception as e:  # S3Exception: the message is all the client gives
            if outage(e):
                where = f" at {self.settings.endpoint}" if self.settings.endpoint else ""
                raise TransientError(f"The checkpoint store {self.root}{where} did not answer {PREFLIGHT_ATTEMPTS} "
                                     f"LISTs over about two minutes ({' '.join(str(e).split())[:300]}); this run "
                                     "reached it before, so it is taken for an outage: the run is restarted (exit code "
                                     "6). If it lasts, check that the endpoint is up and reachable from the pods "
                                     "(spec.checkpoint.storage.s3)") from None
            raise ConfigError(*describe_access_error(self.settings, self.bucket, e)) from e

    # ---- DCP
    def writer(self, checkpoint_id: str) -> Any:
        from kubetitan_trainer import compat

        return compat.s3_storage_writer(checkpoint_id, self.settings, self._config)

    def reader(self, checkpoint_id: str) -> Any:
        from kubetitan_trainer import compat

        return compat.s3_storage_reader(checkpoint_id, self.settings, self._config)


_NO_BUCKET = re.compile(r"bucket does not exist|\bnosuchbucket\b", re.I)
_DENIED = re.compile(r"\baccess ?denied\b|\bforbidden\b|\b(?:status|http|code|response)\D{0,16}\b403\b", re.I)
"""Access denied: the error code or reason, or 403 as a whole number after "status"/"HTTP"/"code" (a bare ``403``
can be part of a request id or a byte range)."""
_CREDENTIALS = re.compile(r"credentials", re.I)
_PROVIDER_TRANSIENT = re.compile(r"tim(?:ed|e) ?out|timeout|connection (?:refused|reset|closed)|connect(?:ion)? "
                                 r"failed|socket|temporar|unavailable|throttl|\b5\d\d\b", re.I)
"""A credentials error that says the provider could not be reached (the EKS Pod Identity agent or the instance
metadata service not answering yet at node start): transient, not a configuration error."""


def access_error_kind(e: BaseException) -> str | None:
    """``no-bucket``, ``denied`` or ``credentials`` when an S3 error says the configuration is wrong (retrying cannot
    help), None for anything else (network, server, a credentials provider not reachable yet).
    s3torchconnector's S3Exception carries only a message; tests/s3/test_storage_units.py has the table."""
    text = str(e)
    if _NO_BUCKET.search(text):
        return "no-bucket"
    if _DENIED.search(text):
        return "denied"
    if _CREDENTIALS.search(text) and not _PROVIDER_TRANSIENT.search(text):
        return "credentials"
    return None


def describe_access_error(s: S3Settings, bucket: str, e: BaseException, *,
                          field: str = "spec.checkpoint.storage.s3.uri", settings_field: str = "spec.checkpoint.storage.s3",
                          actions: str = "s3:GetObject/PutObject/DeleteObject") -> tuple[str, str, str]:
    """(field, problem, fix) for a bucket the trainer cannot reach: ``field`` is the location's field,
    ``settings_field`` the block with its region, endpoint and credentials (checkpoints' or the data's), ``actions``
    the object permissions the pod's identity needs there (:func:`access_error_kind` classifies the error)."""
    text = str(e)
    kind = access_error_kind(e)
    where = f" at {s.endpoint}" if s.endpoint else f" in region {s.region}"
    if kind == "no-bucket":
        return (field, f"the bucket {bucket!r} does not exist{where} ({text})",
                f"create the bucket {bucket!r} (or correct the URI {s.uri!r}), then re-create the run")
    if kind == "denied":
        return (field, f"access to s3://{bucket} was denied{where} ({text})",
                "give the pod's identity (its service account's EKS Pod Identity association or IRSA role, or the "
                f"credentials Secret) s3:ListBucket on arn:aws:s3:::{bucket} and {actions} "
                f"on arn:aws:s3:::{bucket}/*, then re-create the run")
    if kind == "credentials":
        return (field, f"no AWS credentials to reach s3://{bucket} ({text})",
                "associate the run's service account with an IAM role (EKS Pod Identity or IRSA) or set "
                f"{settings_field}.credentialsSecretRef, then re-create the run")
    return (field, f"cannot list s3://{bucket}{where} ({text})",
            f"check {settings_field} (uri, region, endpoint) and that the endpoint is reachable from the pod")


def from_config(job_config: Any) -> CheckpointStore:
    """The store of a trainer config: S3 when ``[kubetitan.checkpoint_storage] s3_uri`` is set, else the local
    folder torchtitan uses (``job.dump_folder``/``checkpoint.folder``)."""
    cs = job_config.kubetitan.checkpoint_storage
    if cs.s3_uri:
        return S3Store(S3Settings(uri=cs.s3_uri, region=cs.region or "us-east-1", endpoint=cs.endpoint,
                                  force_path_style=cs.force_path_style, max_attempts=cs.max_attempts,
                                  thread_count=cs.thread_count))
    return LocalStore(os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder))


def open_store(location: str | CheckpointStore) -> CheckpointStore:
    """A store from a folder path (a :class:`CheckpointStore` passes through)."""
    return location if isinstance(location, CheckpointStore) else LocalStore(location)


# ------------------------------------------------------------------------------------------ outages and retries
PREFLIGHT_ATTEMPTS = 8
"""Tries of the pre-flight LIST of a store the run has reached before, before exit code 6: waits of 2, 4, 8, 16, 30,
30 and 30 s between them, about two minutes (kubetitan_trainer.retry), on top of the client's own retries of each
LIST."""
REACHED_MARKER = "checkpoint-store.json"
"""Under ``<dump_folder>/kubetitan/``: the store (root and endpoint) this pod's run listed successfully."""


def _inner_errors(e: BaseException):
    """``e``, its causes and contexts, and every rank's exception inside DCP's ``CheckpointException``."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]


def _failure_line(e: BaseException) -> str:
    return storage_failure(e) or type(e).__name__


def storage_error_class(e: BaseException) -> str:
    """A bounded name for the storage failure in ``e`` (:func:`storage_failure`): the errno's name of an ``OSError``
    (``ENOSPC``, ``EIO``, ``ESTALE``), else the exception's type name (``S3Exception``, ``OSError``); the ``error``
    label of ``contract.M_CHECKPOINT_SAVE_FAILURE``."""
    import errno as errno_names

    for x in _inner_errors(e):
        if type(x).__name__ == "S3Exception" or isinstance(x, OSError):
            code = getattr(x, "errno", None)
            return errno_names.errorcode.get(code, type(x).__name__) if isinstance(code, int) else type(x).__name__
    return type(e).__name__


def storage_failure(e: BaseException) -> str | None:
    """One line saying what failed, when ``e`` (from a checkpoint save) is a storage failure: an S3 error
    (s3torchconnector's ``S3Exception``: connection refused or reset, timeouts, 5xx after the client's own retries,
    access refused), an ``OSError`` (a volume's EIO, a stale NFS handle), alone or inside DCP's
    ``CheckpointException`` on any rank; None for anything else (a bug: the caller re-raises it)."""
    for x in _inner_errors(e):
        if type(x).__name__ == "S3Exception" or isinstance(x, OSError):
            text = " ".join(str(x).split())
            return f"{type(x).__name__}: {text[:300]}"
    return None


def _marker(dump_folder: str) -> str:
    return os.path.join(dump_folder, "kubetitan", REACHED_MARKER)


def _identity(store: "S3Store") -> dict[str, str]:
    return {"root": store.root, "endpoint": store.settings.endpoint}


def reached_before(store: CheckpointStore, dump_folder: str, env: dict[str, str] | None = None) -> bool:
    """Whether this run has used ``store`` before: this pod listed it (the marker under ``dump_folder``: an in-place
    restart), or an earlier attempt of the run started (``KUBETITAN_ATTEMPT`` above 0: it ran this pre-flight first,
    and a store it could not reach would have ended the run with exit code 2, so it reached it)."""
    env = os.environ if env is None else env
    if int(env.get(contract.ENV_ATTEMPT, "0") or 0) > 0:
        return True
    try:
        with open(_marker(dump_folder)) as f:
            return json.load(f) == _identity(store)  # type: ignore[arg-type]
    except (OSError, ValueError):
        return False


def preflight(store: CheckpointStore, dump_folder: str, sleep: Callable[[float], None] = time.sleep) -> None:
    """The store's pre-flight (:meth:`CheckpointStore.preflight`), retried as an outage when the run has reached it
    before (:func:`reached_before`); on success the marker says so for the next start in this pod."""
    if not store.remote:
        return
    assert isinstance(store, S3Store)
    store.preflight(reached_before=reached_before(store, dump_folder), sleep=sleep)
    from kubetitan_trainer import atomic

    marker = Path(_marker(dump_folder))
    with contextlib.suppress(OSError):  # the marker is a hint: a read-only dump folder only loses it
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(marker, _identity(store))


class SaveBudget:
    """Checkpoint saves that fail with a storage error (:func:`storage_failure`), against
    ``[kubetitan.checkpoint_storage] max_failed_saves`` (``spec.checkpoint.maxFailedSaves``): a failed save is one line in the log and training goes on
    (the next interval saves again); the failure that makes ``budget`` in a row raises
    :class:`~kubetitan_trainer.errors.TransientError` (exit code 6). The last step's save is tried ``budget`` times
    (kubetitan_trainer.retry) before the same error. An async save's write fails or succeeds in the background: it
    counts when the next save waits for it (:meth:`settle`). Every rank counts the same failures (DCP ends a save
    alike on every rank); :meth:`check` agrees on the count anyway (``agree``: a MAX over the ranks)."""

    def __init__(self, budget: int, where: str, interval: int, agree: Callable[[float], float] | None = None,
                 sleep: Callable[[float], None] = time.sleep, rank: int = 0) -> None:
        self.budget, self.where, self.interval = max(1, int(budget)), where, max(1, int(interval))
        self.agree, self.sleep = agree, sleep
        self.say = rank == 0
        """Rank 0 logs (every rank fails the same saves: one line per failed save, not one per rank)."""
        self.in_a_row = 0
        self.failed_steps: list[int] = []
        self.last_error = ""
        self.last_error_class = ""
        """:func:`storage_error_class` of the newest failure."""
        self.total_failed = 0
        """Failed saves of this process, in a row or not."""
        self.report: Callable[[SaveBudget], None] = lambda budget: None
        """Called after every counted save, failed or complete (the trainer's metrics:
        ``metrics.Exporter.checkpoint_saves``)."""
        self.pending_step: int | None = None
        """The step whose async write is in flight (counted when it ends)."""

    def failed(self, step: int, what: str, error_class: str = "") -> None:
        self.in_a_row += 1
        self.total_failed += 1
        self.failed_steps.append(step)
        self.last_error, self.last_error_class = what, error_class
        self.report(self)
        if self.say:
            log.warning(f"Checkpoint save of step {step} to {self.where} failed ({what}); training goes on and saves "
                        f"again at step {step + self.interval} ({self.in_a_row} failed in a row; {self.budget} end "
                        "the run: spec.checkpoint.maxFailedSaves)")

    def succeeded(self, step: int) -> None:
        if self.in_a_row and self.say:
            log.info(f"Checkpoint saved to {self.where} at step {step} after {self.in_a_row} failed save(s) "
                     f"(steps {', '.join(map(str, self.failed_steps))})")
        self.in_a_row, self.failed_steps = 0, []
        self.report(self)

    def settle(self, write: Any) -> bool:
        """Wait for the in-flight async write ``write`` (a Future, or None) and count its outcome; True when there
        was one and it failed (the caller forgets it: ``compat.clear_pending_write``)."""
        step, self.pending_step = self.pending_step, None
        if write is None or step is None:
            return False
        try:
            write.result()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            what = storage_failure(e)
            if what is None:
                raise
            self.failed(step, what, storage_error_class(e))
            return True
        self.succeeded(step)
        return False

    def abandon(self, write: Any, timeout: float = 0.0) -> str | None:
        """An in-process restart: the async write ``write`` of the last save before the fault (a Future, or None),
        waited for up to ``timeout`` seconds and then forgotten, not counted: the fault cut it off, not the storage
        (the load that follows finds its step complete or not). None when it ended well (or there was none), else
        what became of it."""
        self.pending_step = None
        if write is None:
            return None
        try:
            write.result(timeout=timeout)
        except (KeyboardInterrupt, SystemExit):
            raise
        except concurrent.futures.TimeoutError:
            return f"still running after {timeout:.0f} s"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            return f"failed: {type(e).__name__}: {e}"
        return None

    def attempt(self, fn: Callable[[], Any], step: int, *, last: bool = False) -> bool:
        """Run the save ``fn``: True when it returned (then :meth:`written`), False when it failed with a storage
        error (counted and logged). ``last``: the run's last save, tried ``budget`` times (kubetitan_trainer.retry); its
        failure fills the budget (nothing is left to train: :meth:`check` raises)."""
        what = f"The last checkpoint save (step {step}) to {self.where}"
        try:
            if last:
                retry(fn, what=what, transient=lambda e: storage_failure(e) is not None, attempts=self.budget,
                      first_wait=5.0, max_wait=60.0, sleep=self.sleep, say=log.warning if self.say else None,
                      describe=_failure_line)
            else:
                fn()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            failure = storage_failure(e)
            if failure is None:
                raise
            if last:
                if self.say:
                    log.warning(f"{what} failed {self.budget} times ({failure})")
                self.in_a_row, self.last_error = max(self.in_a_row + 1, self.budget), failure
                self.last_error_class = storage_error_class(e)
                self.total_failed += 1
                self.failed_steps.append(step)
                self.report(self)
            else:
                self.failed(step, failure, storage_error_class(e))
            return False
        return True

    def written(self, step: int, background: bool) -> None:
        """The save of ``step`` returned: complete, or (``background``) its write goes on (:meth:`settle`)."""
        if background:
            self.pending_step = step
        else:
            self.succeeded(step)

    def check(self) -> None:
        """Raise TransientError (exit 6) once ``budget`` saves in a row failed on any rank (collective when
        ``agree`` is set: every rank calls it after every save)."""
        n = int(self.agree(float(self.in_a_row))) if self.agree is not None else self.in_a_row
        if n < self.budget:
            return
        from kubetitan_trainer.errors import TransientError

        steps = ", ".join(map(str, self.failed_steps)) or "on another rank"
        raise TransientError(f"{n} checkpoint saves in a row to {self.where} failed (steps {steps}; the last: "
                             f"{self.last_error or 'see another rank'}), the budget of spec.checkpoint.maxFailedSaves. "
                             "The run is restarted (exit code 6) and resumes from the newest complete "
                             "checkpoint; if this repeats, check that the store is reachable from the pods and accepts "
                             "writes (spec.checkpoint.storage)")


class Purger:
    """Keep-latest-K on a background thread of rank 0 (deleting thousands of objects must not stall training);
    :meth:`close` waits for the queued purges."""

    def __init__(self, store: CheckpointStore, keep_latest_k: int) -> None:
        self.store, self.k = store, keep_latest_k
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._run, name="kubetitan-purge", daemon=True)
        self._t.start()

    def request(self) -> None:
        self._q.put(True)

    def _run(self) -> None:
        while self._q.get():
            try:
                gone = self.store.purge(self.k)
                if gone:
                    log.info("keep-latest-%d: deleted %s from %s", self.k, ", ".join(f"step-{s}" for s in gone),
                             self.store.root)
            except Exception as e:  # never fatal: the next purge tries again
                log.warning("keep-latest-%d: could not delete old checkpoints from %s: %s", self.k, self.store.root, e)

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(False)
            self._t.join()
