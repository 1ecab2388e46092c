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
from tests.trainer.helpers import lpt, write_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(600)]


def _s3(endpoint: str, uri: str) -> dict:
    return {"s3": {"uri": uri, "endpoint": endpoint, "forcePathStyle": True}}


def _config(tmp_path: Path, name: str, endpoint: str, uri: str, steps: int, **checkpoint) -> Path:
    obj = lpt({"training": {"steps": steps}, "data": {"source": "synthetic"},
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
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
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
