"""A streamed (Hugging Face) dataset inside a mixture, and resumes the data position cannot make.

The real trainer on CPU (gloo, the test model, ``kubetitan_trainer.launch``): a 3:1 mixture of shards (written by
``kubetitan prepare-data``) and a dataset read through the ``datasets`` library (a local JSONL file: the same
``HuggingFaceTextDataset`` path a hub dataset takes, without the network) trains at DP 2; its ledger shows the
shares the mixture schedule guarantees and each rank reading its own part of the stream. A resume at DP 1 is exit 2
with the reason, and a checkpoint whose data position is torchtitan's per-rank one (what kubetitan wrote before the
global stream) resumed by a shards run is exit 2 with the migration fix, not DCP's ``Missing key`` traceback.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from kubetitan_core.contract import ExitCode
from support.specs import tiny_lpt
from support.trainer import launch, ledger_config

pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(600)]
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    from kubetitan_trainer.data.loaders import BUILTIN_CORPUS
    from kubetitan_trainer.data.prepare import main

    out = tmp_path_factory.mktemp("corpus")
    assert main([str(BUILTIN_CORPUS), "-o", str(out / "shards")]) == 0
    stream = out / "stream.jsonl"
    stream.write_text("".join(json.dumps({"text": f"streamed document {i}: " + "lorem ipsum " * (i % 7 + 3)}) + "\n"
                              for i in range(400)))
    return {"shards": out / "shards", "stream": stream}


def run(tmp: Path, dump: Path, dp: int, steps: int, data: dict[str, Any]) -> tuple[int, str]:
    obj = tiny_lpt({"training": {"steps": steps, "seqLen": 32, "localBatchSize": GLOBAL_BATCH // 2,
                                 "globalBatchSize": GLOBAL_BATCH, "warmupSteps": 1},
                    "parallelism": {"dataParallelShardDegree": dp},
                    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": dp},
                    "data": data, "checkpoint": {"intervalSteps": 1000}})
    return launch(ledger_config(obj, dump, tmp / f"{dump.name}-dp{dp}-to-{steps}.toml"), dp, "hubmix",
                  {"HF_HUB_OFFLINE": "1"}, timeout=300)


def test_a_streamed_source_mixes_by_weight_and_refuses_a_resume_at_another_degree(corpus, tmp_path):
    data = {"source": "mixture", "mixture": [
        {"shards": {"path": str(corpus["shards"])}, "weight": 3, "name": "shards"},
        {"huggingface": {"dataset": str(corpus["stream"]), "streaming": True}, "weight": 1, "name": "stream"}]}
    dump = tmp_path / "run"
    rc, out = run(tmp_path, dump, 2, 3, data)
    assert rc == 0, out[-4000:]
    rows = [tuple(int(v) for v in line.split()) for f in sorted((dump / "kubetitan" / "ledger").glob("rank-*"))
            for line in f.read_text().splitlines()]
    n = 3 * GLOBAL_BATCH
    assert sorted(r[1] for r in rows) == list(range(n))  # every global position trained once
    counts = collections.Counter(r[2] for r in rows)
    for i, w in enumerate((0.75, 0.25)):  # the schedule's guarantee: within one sample of the weight, at any n
        assert abs(counts[i] - w * n) < 1, counts
    by_rank = collections.Counter((f.name, int(line.split()[2])) for f in (dump / "kubetitan" / "ledger").iterdir()
                                  for line in f.read_text().splitlines())
    assert by_rank[("rank-0-of-2.txt", 1)] + by_rank[("rank-1-of-2.txt", 1)] == counts[1]

    rc, out = run(tmp_path, dump, 1, 5, data)  # resume at DP 1: a stream keeps one position per rank
    assert rc == ExitCode.CONFIG_ERROR, out[-4000:]
    assert "cannot be re-split" in out and "saved at data-parallel degree 2, this run has 1" in out
    assert "kubetitan prepare-data" in out and "Traceback" not in out


def test_an_older_per_rank_checkpoint_resumed_by_a_shards_run_is_a_config_error(corpus, tmp_path):
    """A run that kept torchtitan's per-rank data position (the ``huggingface`` source still does; kubetitan's
    shards runs did before the global stream) leaves a checkpoint whose dataloader keys are ``dp_rank_<r>``."""
    dump = tmp_path / "old"
    rc, out = run(tmp_path, dump, 1, 2, {"source": "huggingface",
                                         "huggingface": {"dataset": str(corpus["stream"]), "streaming": False}})
    assert rc == 0, out[-4000:]
    rc, out = run(tmp_path, dump, 1, 3, {"source": "shards", "shards": {"path": str(corpus["shards"])}})
    assert rc == ExitCode.CONFIG_ERROR, out[-4000:]
    assert "saved by an older kubetitan" in out and "start the run afresh" in out and "Migrating" in out
    assert "Traceback" not in out and "Missing key" not in out
