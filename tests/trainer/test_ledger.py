"""The ledger test: the real trainer on CPU (gloo, the debug model) over a real text corpus (Python sources of this
interpreter's standard library, tokenized by ``kubetitan prepare-data``) is stopped and resumed at data-parallel degree
2 -> 1 -> 3 with the same global batch (gradient accumulation 3, 6, 2), and the global samples it trained, read from
the ranks' ledgers (``[kubetitan.data] ledger = true``), are exactly those of one uninterrupted run: the same samples
(none skipped, none repeated) in the same order, each trained at the step its global position says. With a 3:1
mixture of two sources the realised token shares match the weights within 1%.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from kubetitan_core import render
from kmockx.harness import free_port  # the tests' one port allocator
from tests.trainer.helpers import lpt

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(1200)]

GLOBAL_BATCH = 6
LEGS = [(2, 3), (1, 5), (3, 8)]  # (data-parallel degree, train until this step): stop, resume at another degree
STEPS = LEGS[-1][1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Two shards directories from the standard library's modules (alternate files, sorted by name: deterministic)."""
    from kubetitan_trainer.prepare import main

    out = tmp_path_factory.mktemp("corpus")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:24]
    dirs = {}
    for name, part in (("code-a", files[0::2]), ("code-b", files[1::2])):
        src = out / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": p.read_text(errors="replace")}) + "\n" for p in part))
        assert main([str(src), "-o", str(out / name)]) == 0
        dirs[name] = out / name
    return dirs


def run(tmp: Path, dump: Path, dp: int, steps: int, data: dict[str, Any]) -> None:
    obj = lpt({"training": {"steps": steps, "seqLen": 64, "localBatchSize": 1, "globalBatchSize": GLOBAL_BATCH,
                            "warmupSteps": 1},
               "parallelism": {"dataParallelShardDegree": dp},
               "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": dp},
               "data": data, "checkpoint": {"intervalSteps": 1000}})
    cfg = render.trainer_config(obj, dump_folder=str(dump))
    cfg["kubetitan"]["data"]["ledger"] = True
    cfg["kubetitan"]["metrics_port"] = 0
    config = tmp / f"{dump.name}-dp{dp}-to-{steps}.toml"
    config.write_text(tomli_w.dumps(cfg))
    with open(config.with_suffix(".log"), "wb") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "kubetitan_trainer.launch", f"--config={config}", "--nnodes=1",
             f"--nproc-per-node={dp}", "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--rdzv-id=ledger"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=600,
        ).returncode
    assert rc == 0, config.with_suffix(".log").read_text(errors="replace")[-4000:]


def ledger(dump: Path) -> list[tuple[int, int, int, int, int]]:
    """Every (step, global position, source, window, epoch) any rank of any leg trained, in global stream order."""
    rows = []
    for f in sorted((dump / "kubetitan" / "ledger").glob("rank-*.txt")):
        rows += [tuple(int(v) for v in line.split()) for line in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: r[1])


def stream_oracle(job_data: dict[str, Any], n: int) -> list[tuple[int, int, int, int, int]]:
    """The first ``n`` samples of the configured global stream, computed in-process by the loader's own schedule."""
    from torchtitan.config import ConfigManager

    from kubetitan_trainer import data

    obj = lpt({"training": {"seqLen": 64, "localBatchSize": 1, "globalBatchSize": GLOBAL_BATCH}, "data": job_data,
               "parallelism": {"dataParallelShardDegree": 1}, "resources": {"nodes": 1, "gpusPerNode": 0,
                                                                             "processesPerNode": 1}})
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"oracle-{os.getpid()}.toml"
    path.write_text(tomli_w.dumps(render.trainer_config(obj, dump_folder="/nonexistent")))
    jc = ConfigManager().parse_args([f"--job.config_file={path}"])
    sources, weights = data.build_sources(jc)
    stream = data.GlobalStream(sources, weights, data.data_seed(jc), shuffled=jc.kubetitan.data.order == "shuffled")
    return [(s.position // GLOBAL_BATCH + 1, s.position, s.source, s.window, s.epoch) for s in stream.take(n)]


CASES = {
    "one-source": lambda c: {"source": "shards", "shards": {"path": str(c["code-a"])}},
    "mixture-3-to-1": lambda c: {"source": "mixture", "mixture": [
        {"shards": {"path": str(c["code-a"])}, "weight": 3}, {"shards": {"path": str(c["code-b"])}, "weight": 1}],
        "eval": {"intervalSteps": 4, "samples": 6, "heldOutPercent": 2}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_dp_2_1_3_trains_the_uninterrupted_global_stream(case, corpus, tmp_path):
    spec_data = CASES[case](corpus)
    chain = tmp_path / "chain"
    for dp, until in LEGS:
        run(tmp_path, chain, dp, until, spec_data)
    got = ledger(chain)
    files = sorted(p.name for p in (chain / "kubetitan" / "ledger").iterdir())
    assert files == ["rank-0-of-1.txt", "rank-0-of-2.txt", "rank-0-of-3.txt", "rank-1-of-2.txt", "rank-1-of-3.txt",
                     "rank-2-of-3.txt"]
    n = STEPS * GLOBAL_BATCH
    assert [r[1] for r in got] == list(range(n)), "a global position was skipped or trained twice"
    assert all(step == pos // GLOBAL_BATCH + 1 for step, pos, *_ in got), "a sample was trained at another step"
    # each leg trained exactly its steps, at its degree
    for (dp, until), start in zip(LEGS, [0] + [u for _, u in LEGS[:-1]]):
        rows = [line for r in range(dp) for line in
                (chain / "kubetitan" / "ledger" / f"rank-{r}-of-{dp}.txt").read_text().splitlines()]
        assert sorted({int(line.split()[0]) for line in rows}) == list(range(start + 1, until + 1))
        assert len(rows) == (until - start) * GLOBAL_BATCH

    # the same samples in the same order as the loader's own stream ...
    assert got == stream_oracle(spec_data, n)
    if case == "mixture-3-to-1":
        # ... and as one uninterrupted run at DP 2
        straight = tmp_path / "straight"
        run(tmp_path, straight, 2, STEPS, spec_data)
        want = ledger(straight)
        assert got == want
        assert collections.Counter(r[2:] for r in got) == collections.Counter(r[2:] for r in want)
        # realised token shares (every sample is seqLen + 1 tokens) against the weights 3:1
        shares = collections.Counter(r[2] for r in got)
        assert abs(shares[0] / n - 0.75) <= 0.01 and abs(shares[1] / n - 0.25) <= 0.01, shares
        # the held-out set was evaluated at step 1 and every 4 steps, in each leg that reached such a step
        evals = [json.loads(line) for line in (chain / "kubetitan" / "evals.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [1, 4, 8] and all(0 < e["eval_loss"] < 20 for e in evals)
    else:
        assert len({(r[3], r[4]) for r in got}) == n  # one source: n distinct windows
        assert [r[3] for r in got] != sorted(r[3] for r in got)  # shuffled, not corpus order
