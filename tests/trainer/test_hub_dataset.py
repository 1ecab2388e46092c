"""A hub dataset that cannot be reached: bounded retries, then exit 6 with the way to train without the hub; a dataset
the hub does not have: exit 2 with the fix; a stream that breaks mid-way: exit 6, never a traceback.

The worker tests run the real trainer worker (``kubetitan_trainer.main``) against the stand-in hub on 127.0.0.1
(tests/trainer/fakehub.py) through the real ``datasets.load_dataset``; the hub's request log counts the tries.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kubetitan_core.contract import ExitCode
from kubetitan_trainer.data import downloads
from kubetitan_trainer.errors import ConfigError, TransientError

from .fakehub import FakeHub

DATASET = "org/ds"
PY = sys.executable

PRELUDE = """
import time, types
from kubetitan_trainer.data import downloads
downloads.RETRIES, downloads.BACKOFF_BASE_SECONDS = 2, 0.01  # kubetitan's policy: 3 tries, short waits
# huggingface_hub retries one metadata request 5 times itself (waits 1, 2, 4, 8, 8 s) inside each of kubetitan's
# tries; its waits are cut to 0 here so that the test takes seconds (the number of requests is unchanged)
import huggingface_hub.utils._http as hub_http
hub_http.time = types.SimpleNamespace(**{**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")},
                                       "sleep": lambda s: None})
"""
HUB_TRIES_PER_TRY = 7
"""Requests of the dataset card per kubetitan try (huggingface_hub 2.4: one without retries, then one with 5 retries)."""


def _worker_env(endpoint: str, hf_home: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env.pop("HF_HUB_OFFLINE", None)
    return env


def _config(tmp_path: Path, dataset: str) -> Path:
    from support.specs import tiny_lpt, write_config

    obj = tiny_lpt({"data": {"source": "huggingface", "huggingface": {"dataset": dataset}},
                    "parallelism": {"dataParallelShardDegree": 1},
                    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1}})
    name = dataset.split("/")[1]
    return write_config(tmp_path / f"{name}.toml", obj, tmp_path / f"dump-{name}")


def run_workers(tmp_path: Path, endpoint: str, datasets: list[str]) -> list[tuple[int, str]]:
    """A real worker per dataset, each forked from one process that imported torch once: (exit code, output)."""
    from kmockx.harness import free_port

    from support.trainer import workers_in_one_process

    return workers_in_one_process([(_config(tmp_path, d), free_port()) for d in datasets],
                                  _worker_env(endpoint, tmp_path / "hf"), PRELUDE)


CASES = {"org/ds-down": (503, ExitCode.RETRYABLE), "org/ds-missing": (404, ExitCode.CONFIG_ERROR)}


def test_the_worker_exits_6_when_the_hub_stays_down_and_2_when_the_dataset_is_missing(tmp_path):
    """503 on every request of one dataset: kubetitan's 3 tries (each with huggingface_hub's own retries), then exit
    6 with the ways to train without the hub; 404 for another: exit 2 with the fix, asked once."""
    with FakeHub(DATASET, {}) as hub:
        hub.status_by_repo = {ds: status for ds, (status, _) in CASES.items()}
        results = run_workers(tmp_path, hub.endpoint, list(CASES))
        cards = {ds: sum(1 for m, path in hub.requests if path.startswith(f"/datasets/{ds}/")) for ds in CASES}
    for (ds, (_, code)), (rc, out) in zip(CASES.items(), results):
        assert rc == code, (ds, out[-3000:])
        assert "Traceback" not in out, out[-3000:]
        if code == ExitCode.RETRYABLE:
            assert cards[ds] == 3 * HUB_TRIES_PER_TRY, hub.requests  # bounded: kubetitan's 3 tries, nothing after
            assert f"Opening the dataset {ds} on the hub: still failing after 3 tries" in out
            assert "exit code 6" in out and "kubetitan prepare-data" in out and "HF_HUB_OFFLINE" in out
        else:
            assert cards[ds] == 1  # asked once: no retry
            assert "spec.data.huggingface.dataset" in out and f"the hub cannot give {ds}" in out and "Fix:" in out


def test_a_refused_connection_is_transient_and_the_retries_are_bounded(tmp_path):
    """Nothing listens on the endpoint's port: kubetitan's tries (each with huggingface_hub's own retries) run out
    and the worker exits 6 with the hint, never a traceback."""
    from kmockx.harness import free_port

    [(rc, out)] = run_workers(tmp_path, f"http://127.0.0.1:{free_port()}", [DATASET])  # one worker: as cold
    assert rc == ExitCode.RETRYABLE, out[-3000:]
    assert "Traceback" not in out and "still failing after 3 tries (ConnectionError" in out
    assert out.count("retry 1/2") == 1 and out.count("retry 2/2") == 1 and "retry 3/" not in out


def _missing():
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError

    return [DatasetNotFoundError("Dataset 'org/ds' doesn't exist on the Hub"), DataFilesNotFoundError("no files")]


def _offline_entry() -> BaseException:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic has been "
                                   "disabled (HF_HUB_OFFLINE=1)")


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(("make", "offline", "want"), [
    (lambda: _missing()[0], False, downloads.CONFIG),
    (lambda: _missing()[1], False, downloads.CONFIG),
    (lambda: ConnectionError("Couldn't reach 'org/ds' on the Hub (LocalEntryNotFoundError)"), False, downloads.TRANSIENT),
    (lambda: ConnectionError("Couldn't reach 'org/ds' on the Hub (OfflineModeIsEnabled)"), True, downloads.CONFIG),
    (lambda: ConnectionError("Server Disconnected"), False, downloads.TRANSIENT),
    (lambda: ValueError("a bug"), False, None),
    (lambda: _offline_entry(), True, downloads.CONFIG),
    (lambda: FileNotFoundError("no cached file for org/ds"), True, downloads.CONFIG),
    (lambda: ValueError("a bug"), True, None),
    (lambda: _chained(RuntimeError("tokenizer failed mid-stream"), KeyError("text")), True, None),
    (lambda: ConnectionError("Server Disconnected"), True, downloads.CONFIG),
], ids=["no-such-dataset", "no-data-files", "unreachable", "offline-mode", "stream-gave-up", "other",
        "offline-not-cached", "offline-missing-file", "offline-bug", "offline-tokenizer-error", "offline-connection"])
def test_classify_dataset(monkeypatch, make, offline, want):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    assert downloads.classify_dataset(make()) == want


def _dataset(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from kubetitan_trainer.data.loaders import HubSpec, KubetitanHFTextDataset
    from kubetitan_trainer.data.tokenizer import BUILTIN_TOKENIZER

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 4}) + "\n" for i in range(50)))
    tok = HuggingFaceTokenizer(str(BUILTIN_TOKENIZER))
    return KubetitanHFTextDataset(None, tok, 16, 0, 1, hub=HubSpec(str(corpus), streaming=True))


def test_a_stream_that_breaks_mid_way_is_exit_6_with_the_dataset_named(tmp_path):
    """The library's own read retries gave up (``datasets`` raises ``ConnectionError("Server Disconnected")``)."""
    ds = _dataset(tmp_path)
    rows = iter(ds._data)

    def breaking():
        for i, row in enumerate(rows):
            if i == 5:
                raise ConnectionError("Server Disconnected")
            yield row

    ds._data = breaking()
    with pytest.raises(TransientError) as e:
        list(ds)
    msg = str(e.value)
    assert e.value.exit_code == ExitCode.RETRYABLE
    assert "after 5 documents on this rank" in msg and "mid-stream" in msg and "kubetitan prepare-data" in msg


def test_a_missing_text_column_is_a_config_error(tmp_path):
    ds = _dataset(tmp_path)
    ds._data = iter([{"content": "x"}])
    with pytest.raises(ConfigError, match="no column 'text'.*content.*textField"):
        next(iter(ds))
