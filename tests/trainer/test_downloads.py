"""Hub downloads (kubetitan_trainer.data.downloads): once per pod, retried when transient, exit 2 only for config errors.

Every test talks HTTP to a stand-in hub on 127.0.0.1 (tests/trainer/fakehub.py) through the real
``huggingface_hub.snapshot_download``; the hub's request log says what was really asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from kubetitan_core.contract import ExitCode
from kubetitan_trainer.data import downloads
from kubetitan_trainer.data.tokenizer import BUILTIN_TOKENIZER
from kubetitan_trainer.errors import ConfigError, TransientError

from .fakehub import FakeHub, tokenizer_files

REPO = "org/tok"
FILES = ["tokenizer.json", "tokenizer_config.json"]
HERE = Path(__file__).resolve().parent
PY = sys.executable


def _fetch(hub: FakeHub, delays: list[float], **kw):
    return downloads.hub_snapshot(REPO, FILES, None, endpoint=hub.endpoint, sleep=delays.append,
                                  rand=lambda: 1.0, log=lambda m: None, **kw)


@pytest.mark.parametrize("failures", [[503], [0], [429, 502, 0]], ids=["503", "connection-reset", "429-502-reset"])
def test_transient_failures_are_retried_with_backoff_then_succeed(tmp_path, failures):
    delays: list[float] = []
    with FakeHub(REPO, tokenizer_files(BUILTIN_TOKENIZER)) as hub:
        hub.fail_next = list(failures)
        dest = downloads.fetch_once(tmp_path / "tok", _fetch(hub, delays), local_rank=0, what="t")
        assert hub.downloads("tokenizer.json") == 1
    assert (dest / "tokenizer.json").read_bytes() == (BUILTIN_TOKENIZER / "tokenizer.json").read_bytes()
    assert (dest / downloads.DONE_MARKER).is_file()
    assert delays == [1.0, 2.0, 4.0][: len(failures)]  # one wait per failure, doubling (jitter pinned at its top)
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # the private download folder is gone


def test_backoff_doubles_is_capped_and_jittered_then_gives_up_with_the_retryable_code():
    def down():
        raise httpx2.ConnectError("connection refused")

    delays: list[float] = []
    with pytest.raises(TransientError) as e:
        downloads.with_retries(down, "fetch", retries=6, base=1.0, cap=5.0, sleep=delays.append, rand=lambda: 1.0,
                               log=lambda m: None)
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert e.value.exit_code == ExitCode.RETRYABLE == 6 and "7 tries" in str(e.value)
    halves: list[float] = []
    with pytest.raises(TransientError):
        downloads.with_retries(down, "fetch", retries=3, base=1.0, cap=5.0, sleep=halves.append, rand=lambda: 0.5,
                               log=lambda m: None)
    assert halves == [0.5, 1.0, 2.0]  # full jitter: uniform in [0, min(cap, base * 2**n)]


@pytest.mark.parametrize("status", [404, 401, 403])
def test_repository_missing_or_refused_is_a_config_error_without_retries(tmp_path, status):
    delays: list[float] = []
    with FakeHub(REPO, {}) as hub:
        hub.status_for_repo = status
        with pytest.raises(ConfigError) as e:
            downloads.fetch_once(tmp_path / "tok", _fetch(hub, delays), local_rank=0, what="t")
        assert len(hub.requests) == 1  # asked once: no retry
    assert delays == [] and e.value.exit_code == ExitCode.CONFIG_ERROR
    assert "spec.tokenizer.repo" in str(e.value) and "tokenSecretRef" in str(e.value)
    assert not (tmp_path / "tok" / downloads.DONE_MARKER).exists()


def test_a_completed_download_is_used_without_asking_the_hub(tmp_path):
    with FakeHub(REPO, tokenizer_files(BUILTIN_TOKENIZER)) as hub:
        downloads.fetch_once(tmp_path / "tok", _fetch(hub, []), local_rank=0, what="t")
        before = len(hub.requests)
        downloads.fetch_once(tmp_path / "tok", _fetch(hub, []), local_rank=0, what="t")  # the next attempt
        assert len(hub.requests) == before


def test_a_waiting_rank_times_out_with_a_clear_error(tmp_path):
    with pytest.raises(TransientError) as e:
        downloads.fetch_once(tmp_path / "tok", lambda d: pytest.fail("only local rank 0 fetches"), local_rank=1,
                             what="Downloading the tokenizer", wait_timeout=0.2, poll=0.05)
    assert "local rank 0" in str(e.value) and downloads.DONE_MARKER in str(e.value)


WORKER = """
import sys, json
from kubetitan_trainer.data import downloads
rank, dest, endpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fetch = downloads.hub_snapshot("org/tok", ["tokenizer.json", "tokenizer_config.json"], None, endpoint=endpoint)
print("ready", flush=True)
d = downloads.fetch_once(dest, fetch, local_rank=rank, what="tok", poll=0.05)
print(json.dumps(sorted(p.name for p in d.iterdir())), flush=True)
"""


def test_one_download_per_pod_the_other_ranks_wait_for_the_marker(tmp_path):
    """Four local ranks of one pod start together; only local rank 0 asks the hub for the files."""
    dest = tmp_path / "tok"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with FakeHub(REPO, tokenizer_files(BUILTIN_TOKENIZER)) as hub:
        procs = [subprocess.Popen([PY, "-c", WORKER, str(r), str(dest), hub.endpoint], stdout=subprocess.PIPE,
                                  text=True, env=env) for r in (3, 2, 1, 0)]
        try:
            outs = [p.communicate(timeout=120)[0].splitlines() for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
        assert hub.downloads("tokenizer.json") == 1 and hub.downloads("tokenizer_config.json") == 1
        assert sum(1 for m, path in hub.requests if "/revision/" in path) == 1  # rank 0 alone asked the hub
    for out in outs:
        assert out[0] == "ready" and set(json.loads(out[-1])) == {*FILES, downloads.DONE_MARKER}


PRELUDE = """
from kubetitan_trainer.data import downloads
downloads.RETRIES, downloads.BACKOFF_BASE_SECONDS = 2, 0.01  # keep the exhausted-retries case short
"""
CASES = {"org/missing": (404, ExitCode.CONFIG_ERROR), "org/down": (503, ExitCode.RETRYABLE)}


def test_the_trainer_exits_2_for_a_missing_repo_and_6_when_the_hub_stays_down(tmp_path):
    """A real worker (torchtitan's Trainer builds the tokenizer) against the stand-in hub: 404 is a config error
    (exit 2, asked once), a hub that keeps answering 503 is exit 6 after its retries (3 tries). Both workers are
    forked from one process that imported torch once (support.trainer.workers_in_one_process), one repository each."""
    from kmockx.harness import free_port

    from support.specs import tiny_lpt, write_config
    from support.trainer import workers_in_one_process

    cases = []
    for repo in CASES:
        obj = tiny_lpt({"tokenizer": {"source": "huggingface", "repo": repo},
                        "parallelism": {"dataParallelShardDegree": 1},
                        "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1}})
        cases.append((write_config(tmp_path / f"{repo.split('/')[1]}.toml", obj, tmp_path / repo), free_port()))
    with FakeHub(REPO, {}) as hub:
        hub.status_by_repo = {repo: status for repo, (status, _) in CASES.items()}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_ENDPOINT": hub.endpoint,
               "HF_HOME": str(tmp_path / "hf"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        results = workers_in_one_process(cases, env, PRELUDE)
        asked = {repo: sum(1 for m, path in hub.requests if "/revision/" in path and f"/{repo}/" in path)
                 for repo in CASES}
    for (repo, (_, code)), (rc, out) in zip(CASES.items(), results):
        assert rc == code, (repo, out[-3000:])
        if code == ExitCode.CONFIG_ERROR:
            assert asked[repo] == 1 and "spec.tokenizer.repo" in out and "Fix:" in out, (asked, out[-3000:])
        else:
            assert asked[repo] == 3 and "still failing after 3 tries" in out and "exit code 6" in out, (asked, out[-3000:])
