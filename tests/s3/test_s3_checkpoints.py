"""Checkpoints in S3 against a real S3-compatible server (moto's server mode, tests/s3/conftest.py): 2 CPU ranks
train, save to the bucket, are killed, and resume from it with the same losses bit for bit; keep-latest-K leaves
exactly K complete steps; a save without ``.metadata`` is never resumed from; 503 SlowDown and connection resets
during saves and loads are retried by the client; a missing bucket is the configuration exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kmockx.harness import free_port  # the tests' one port allocator
from kubetitan_core import contract
from kubetitan_core.contract import ExitCode
from kubetitan_trainer import storage
from support import warm
from support.procs import running
from support.specs import tiny_lpt, write_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(600)]


def _s3(endpoint: str, uri: str) -> dict:
    return {"s3": {"uri": uri, "endpoint": endpoint, "forcePathStyle": True}}


def _config(tmp_path: Path, name: str, endpoint: str, uri: str, steps: int, **checkpoint) -> Path:
    obj = tiny_lpt({"training": {"steps": steps}, "data": {"source": "synthetic"},
               "checkpoint": {"intervalSteps": 2, "asyncMode": "async", "keepLatestK": 0, **checkpoint,
                              "storage": _s3(endpoint, uri)}})
    return write_config(tmp_path / f"{name}.toml", obj, tmp_path / name, {"kubetitan": {"metrics_port": 0}})


def _launch(config: Path, env: dict[str, str]) -> warm.WarmProcess | subprocess.Popen:
    return warm.popen("kubetitan_trainer.launch",
                      [f"--config={config}", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                       f"--master-port={free_port()}", "--rdzv-id=s3", "--max-restarts=0"],
                      {**os.environ, **env, contract.ENV_ATTEMPT: "0", "OMP_NUM_THREADS": "1"},
                      config.with_suffix(".log"), cwd=REPO, new_session=True)


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *_descendants(k)]
    return out


def _kill_tree(proc: warm.WarmProcess | subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker (torch starts the workers in sessions of their own), as a node loss."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    for pid in pids[1:]:
        while running(pid):
            time.sleep(0.05)


def _log(config: Path) -> str:
    return config.with_suffix(".log").read_text(errors="replace")


def _losses(dump: Path) -> dict[int, float]:
    """step -> loss from the step log (one line per step; a replayed step's last line wins)."""
    out = {}
    for line in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _store(endpoint: str, uri: str) -> storage.S3Store:
    return storage.S3Store(storage.S3Settings(uri=uri, endpoint=endpoint, force_path_style=True))


def _complete(store: storage.S3Store) -> list[int]:
    return sorted(int(n.split("-")[1]) for n, done in store.entries() if done)


def test_train_kill_resume_from_s3_is_bit_identical_keeps_k_and_skips_a_cut_off_save(s3_server, fault_proxy, bucket,
                                                                                     s3_env, tmp_path):
    steps, ep = 8, s3_server.endpoint
    # --- A: uninterrupted, keep-latest-2 (async saves every 2 steps, the last one synchronous)
    a_uri = f"s3://{bucket}/a/run"
    a_cfg = _config(tmp_path, "a", ep, a_uri, steps, keepLatestK=2)
    proc = _launch(a_cfg, s3_env)
    assert proc.wait(timeout=400) == 0, _log(a_cfg)[-4000:]
    a = _losses(tmp_path / "a")
    assert sorted(a) == list(range(1, steps + 1))
    a_store = _store(ep, a_uri)
    # exactly K complete steps, the newest, and nothing else under the prefix
    assert a_store.entries() == [("step-6", True), ("step-8", True)], a_store.entries()
    assert "Checkpoints are saved to and loaded from " + a_uri in _log(a_cfg)
    assert not (tmp_path / "a" / contract.CHECKPOINT_SUBDIR).exists(), "nothing written to the local folder"

    # --- B: same run through the fault proxy, whose answer to the step-6 save's .metadata PUT never comes: every
    # shard of step-6 is in the bucket but its .metadata is not (a save cut off mid-way). Then SIGKILL (launcher
    # and workers) and resume from the bucket.
    b_uri = f"s3://{bucket}/b/run"
    b_cfg = _config(tmp_path, "b", fault_proxy.endpoint, b_uri, steps)
    b_store = _store(ep, b_uri)
    hold = fault_proxy.inject("hold", "PUT", 1, path_contains="/step-6/.metadata")
    proc = _launch(b_cfg, s3_env)
    assert hold.held.wait(timeout=400), _log(b_cfg)[-4000:]
    _kill_tree(proc)
    fault_proxy.clear()
    entries = dict(b_store.entries())
    assert entries["step-6"] is False and entries["step-4"] is True, entries
    assert b_store.step_bytes(6) > 0, "the cut-off save's shards are in the bucket"

    proc = _launch(b_cfg, s3_env)
    assert proc.wait(timeout=400) == 0, _log(b_cfg)[-4000:]
    log = _log(b_cfg)
    assert "Skipped checkpoint step-6" in log, log[-3000:]
    assert f"Loading the checkpoint from {b_uri}/step-4." in log, log[-3000:]
    assert "Training starts at step 5" in log, log[-3000:]
    b = _losses(tmp_path / "b")
    assert sorted(b) == list(range(1, steps + 1))
    assert b == a, "losses after the resume from S3 differ from the uninterrupted run (bit for bit)"
    assert _complete(b_store)[-1] == steps


def test_faults_during_save_and_load_are_retried_and_the_run_continues(s3_server, fault_proxy, bucket, s3_env,
                                                                       tmp_path):
    """503 SlowDown and connection resets on the first PUTs of the saves, then on the first GETs of the resume's
    load (and slow answers): the client's retries carry both runs through."""
    uri = f"s3://{bucket}/faults"
    cfg = _config(tmp_path, "f", fault_proxy.endpoint, uri, 4, asyncMode="disabled")
    f503 = fault_proxy.inject("503", "PUT", 4)
    reset = fault_proxy.inject("reset", "PUT", 2)
    proc = _launch(cfg, s3_env)
    assert proc.wait(timeout=400) == 0, _log(cfg)[-4000:]
    assert f503.hits == 4 and reset.hits == 2, fault_proxy.requests[:20]
    store = _store(s3_server.endpoint, uri)
    assert _complete(store) == [2, 4]

    fault_proxy.clear()
    g503 = fault_proxy.inject("503", "GET", 3, path_contains="/step-4/")
    greset = fault_proxy.inject("reset", "GET", 2, path_contains="/step-4/")
    slow = fault_proxy.inject("slow", "GET", 2, path_contains="/step-4/", delay=1.0)
    cfg6 = _config(tmp_path, "f", fault_proxy.endpoint, uri, 6, asyncMode="disabled")
    proc = _launch(cfg6, s3_env)
    assert proc.wait(timeout=400) == 0, _log(cfg6)[-4000:]
    assert (g503.hits, greset.hits, slow.hits) == (3, 2, 2), fault_proxy.requests[-40:]
    log = _log(cfg6)
    assert f"Loading the checkpoint from {uri}/step-4." in log and "Training starts at step 5" in log
    assert _complete(store) == [2, 4, 6]


def test_missing_bucket_is_the_configuration_exit_code_with_the_bucket_and_the_fix(s3_server, s3_env, tmp_path):
    cfg = _config(tmp_path, "m", s3_server.endpoint, "s3://no-such-bucket-kt/run", 2)
    proc = _launch(cfg, s3_env)
    assert proc.wait(timeout=300) == ExitCode.CONFIG_ERROR == 2, _log(cfg)[-3000:]
    log = _log(cfg)
    assert "the bucket 'no-such-bucket-kt' does not exist" in log and "create the bucket 'no-such-bucket-kt'" in log
    assert "Traceback" not in log


def test_keep_latest_k_and_discovery_on_the_server(s3_server, bucket, s3_env):
    """The store's listing and purge on real objects: complete = has .metadata; the K newest complete steps stay,
    older complete and cut-off steps go, a cut-off step newer than them (a save in flight) stays."""
    store = _store(s3_server.endpoint, f"s3://{bucket}/k")
    layout = {2: True, 3: False, 4: True, 6: True, 8: True, 10: False}
    for step, done in layout.items():
        for name in ["__0_0.distcp", "__1_0.distcp"] + ([contract.DCP_METADATA_FILE] if done else []):
            with store._client.put_object(bucket, store._key(f"step-{step}", name)) as w:
                w.write(b"x" * 10)
    assert store.entries() == sorted((f"step-{s}", d) for s, d in layout.items())
    assert store.newest_complete_step() == 8
    assert store.purge(2) == [2, 3, 4]
    assert store.entries() == [("step-10", False), ("step-6", True), ("step-8", True)]
    assert store.step_bytes(6) == 30
    assert store.purge(2) == []


def _wait_for(pred, what: str, proc, cfg: Path, timeout: float = 300, detail=lambda: "") -> None:
    """Wait until ``pred()`` holds (the run's log or step log has said something), failing early if the run ends."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended before {what}: {detail()} {_log(cfg)[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s: {detail()} {_log(cfg)[-4000:]}"
        time.sleep(0.05)


def test_an_s3_server_killed_mid_save_and_restarted_later_leaves_the_run_training_to_success(s3_env, fault_proxy,
                                                                                           tmp_path):
    """The S3 server (a moto of this test's own, behind the fault proxy) is SIGKILLed while the step-4 save's first
    PUT is in flight, and started again only once the run has said that save failed and trained on: every failed
    save is one log line, training goes on, a later save succeeds, and the run ends with exit 0, its last checkpoint
    complete in the bucket and no traceback in its log. (moto keeps objects in memory: the restarted server is empty,
    so the test creates the bucket again, as a server with a disk would still have it.)"""
    from support.s3server import start_server

    port, moto_log = free_port(), tmp_path / "moto.log"
    server_proc, server = start_server(port, moto_log)
    try:
        bucket = server.create_bucket()
        fault_proxy.upstream = server.endpoint
        uri, steps = f"s3://{bucket}/outage", 14
        obj = tiny_lpt({"training": {"steps": steps}, "data": {"source": "synthetic"},
                   "checkpoint": {"intervalSteps": 2, "asyncMode": "async", "keepLatestK": 0,
                                  "storage": _s3(fault_proxy.endpoint, uri)}})
        cfg = write_config(tmp_path / "outage.toml", obj, tmp_path / "outage", {"kubetitan": {"metrics_port": 0}})
        import tomllib

        import tomli_w

        table = tomllib.loads(cfg.read_text())  # each request gives up after 2 tries; 6 failed saves in a row allowed
        table["kubetitan"]["checkpoint_storage"].update(max_attempts=2, max_failed_saves=6)
        cfg.write_text(tomli_w.dumps(table))
        pause = fault_proxy.inject("pause", "PUT", 1, path_contains="/step-4/")
        proc = _launch(cfg, s3_env)
        _wait_for(pause.held.is_set, "a PUT of step 4", proc, cfg, detail=lambda: fault_proxy.requests[-30:])
        server_proc.kill()  # SIGKILL, mid-save: the step-4 PUT is held in the proxy, the others wait behind it
        server_proc.wait(timeout=30)
        pause.release.set()
        failed = f"Checkpoint save of step 4 to {uri} failed"
        _wait_for(lambda: failed in _log(cfg), "step 4's failed save", proc, cfg)
        trained_while_down = max(_losses(tmp_path / "outage"))
        server_proc, server = start_server(port, moto_log)  # the same endpoint, a fresh (empty) server
        server.create_bucket(bucket)
        assert proc.wait(timeout=400) == 0, _log(cfg)[-4000:]
        assert _complete(_store(server.endpoint, uri))[-1] == steps  # the last save is complete in the bucket
    finally:
        server_proc.kill()
        server_proc.wait(timeout=30)
    log = _log(cfg)
    assert trained_while_down > 4, log[-4000:]  # steps after the cut-off save trained while the server was down
    assert "Traceback" not in log, log[-6000:]
    lines = [line for line in log.splitlines() if "Checkpoint save of step" in line and "failed" in line]
    steps_said = [int(line.split("Checkpoint save of step ")[1].split()[0]) for line in lines]
    assert steps_said and steps_said[0] == 4 and len(set(steps_said)) == len(steps_said), lines  # one line a save
    assert all(len(line) < 1000 and f"to {uri} failed" in line for line in lines), lines
    assert "after" in log and "failed save(s)" in log, log[-4000:]  # a later save succeeded, and says so
    assert sorted(_losses(tmp_path / "outage")) == list(range(1, steps + 1))
