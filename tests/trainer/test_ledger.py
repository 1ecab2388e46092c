"""The ledger test: the real trainer on CPU (gloo, the test model) over a real text corpus (Python sources of this
interpreter's standard library, tokenized by ``kubetitan prepare-data``) is stopped and resumed at data-parallel degree
2 -> 1 -> 3 with the same global batch (gradient accumulation 3, 6, 2), and the global samples it trained, read from
the ranks' ledgers (``[kubetitan.data] ledger = true``), are exactly those of one uninterrupted run: the same samples
(none skipped, none repeated) in the same order, each trained at the step its global position says; and the job's
cumulative token count (the step log's ``tokens``, what ``kubetitan_trainer_tokens_total`` exports) continues across
each resize exactly: step ``s`` has trained ``s * GLOBAL_BATCH * SEQ_LEN`` tokens. With a 3:1 mixture of two sources
the realised token shares match the weights within 1%.
"""

from __future__ import annotations

import collections
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from kubetitan_core import render
from support.trainer import launch, ledger_config
from support.specs import tiny_lpt

pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(1200)]

GLOBAL_BATCH = 6
SEQ_LEN = 64
LEGS = [(2, 2), (1, 4), (3, 6)]  # (data-parallel degree, train until this step): stop, resume at another degree
# (two steps a leg: each resumed leg trains past its first step; 8 steps until session 15, the same assertions)
STEPS = LEGS[-1][1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Two shards directories from the standard library's modules (alternate files, sorted by name: deterministic)."""
    from kubetitan_trainer.data.prepare import main

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
    obj = tiny_lpt({"training": {"steps": steps, "seqLen": SEQ_LEN, "localBatchSize": 1, "globalBatchSize": GLOBAL_BATCH,
                            "warmupSteps": 1},
               "parallelism": {"dataParallelShardDegree": dp},
               "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": dp},
               "data": data, "checkpoint": {"intervalSteps": 1000}})
    rc, out = launch(ledger_config(obj, dump, tmp / f"{dump.name}-dp{dp}-to-{steps}.toml"), dp, "ledger")
    assert rc == 0, out[-4000:]


def ledger(dump: Path) -> list[tuple[int, int, int, int, int]]:
    """Every (step, global position, source, window, epoch) any rank of any leg trained, in global stream order."""
    rows = []
    for f in sorted((dump / "kubetitan" / "ledger").glob("rank-*.txt")):
        rows += [tuple(int(v) for v in line.split()) for line in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: r[1])


def tokens_logged(dump: Path) -> list[tuple[int, int]]:
    """(step, the job's tokens trained by then) of every step rank 0 logged (every step: logFrequencySteps 1)."""
    recs = [json.loads(line) for line in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines()]
    return [(r["step"], r["tokens"]) for r in recs]


def stream_oracle(job_data: dict[str, Any], n: int) -> list[tuple[int, int, int, int, int]]:
    """The first ``n`` samples of the configured global stream, computed in-process by the loader's own schedule."""
    from torchtitan.config import ConfigManager

    from kubetitan_trainer.data import loaders as data
    from kubetitan_trainer.data.stream import GlobalStream

    obj = tiny_lpt({"training": {"seqLen": SEQ_LEN, "localBatchSize": 1, "globalBatchSize": GLOBAL_BATCH}, "data": job_data,
               "parallelism": {"dataParallelShardDegree": 1}, "resources": {"nodes": 1, "gpusPerNode": 0,
                                                                             "processesPerNode": 1}})
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"oracle-{os.getpid()}.toml"
    path.write_text(tomli_w.dumps(render.trainer_config(obj, dump_folder="/nonexistent")))
    jc = ConfigManager().parse_args([f"--job.config_file={path}"])
    sources, weights = data.build_sources(jc)
    stream = GlobalStream(sources, weights, data.data_seed(jc), shuffled=jc.kubetitan.data.order == "shuffled")
    return [(s.position // GLOBAL_BATCH + 1, s.position, s.source, s.window, s.epoch) for s in stream.take(n)]


CASES = {
    "one-source": lambda c: {"source": "shards", "shards": {"path": str(c["code-a"])}},
    "mixture-3-to-1": lambda c: {"source": "mixture", "mixture": [
        {"shards": {"path": str(c["code-a"])}, "weight": 3}, {"shards": {"path": str(c["code-b"])}, "weight": 1}],
        "eval": {"intervalSteps": 3, "samples": 6, "heldOutPercent": 2}},
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
    # the job's tokens continue across DP 2 -> 1 -> 3 (each rank's count used to be restored and summed anew)
    assert tokens_logged(chain) == [(s, s * GLOBAL_BATCH * SEQ_LEN) for s in range(1, STEPS + 1)]

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
        # the held-out set was evaluated at step 1 and every 3 steps, in each leg that reached such a step (all three)
        evals = [json.loads(line) for line in (chain / "kubetitan" / "evals.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [1, 3, 6] and all(0 < e["eval_loss"] < 20 for e in evals)
        # per-source losses (summed over the ranks of each leg), tokens and epochs, and per-source eval losses
        steps = [json.loads(line) for line in (chain / "kubetitan" / "steps.jsonl").read_text().splitlines()]
        for rec in steps:
            src = rec["sources"]
            trained = collections.Counter(r[2] for r in got if r[0] <= rec["step"])
            this_step = collections.Counter(r[2] for r in got if r[0] == rec["step"])
            for i, name in enumerate(("code-a", "code-b")):
                assert src[name]["tokens"] == trained[i] * (SEQ_LEN + 1), (rec["step"], src)
                assert src[name]["loss_tokens"] == this_step[i] * SEQ_LEN and 0 < src[name]["loss"] < 20, src
                assert 0 < src[name]["epochs"] < 1
            # the step's loss is the token-weighted mean of the sources' losses
            mean = sum(v["loss"] * v["loss_tokens"] for v in src.values()) / (GLOBAL_BATCH * SEQ_LEN)
            assert abs(mean - rec["loss"]) < 1e-4 * rec["loss"], (mean, rec["loss"])
        assert all(set(e["sources"]) == {"code-a", "code-b"} and all(0 < v["eval_loss"] < 20 for v in
                                                                     e["sources"].values()) for e in evals)
    else:
        assert len({(r[3], r[4]) for r in got}) == n  # one source: n distinct windows
        assert [r[3] for r in got] != sorted(r[3] for r in got)  # shuffled, not corpus order


class _LossMesh:
    """The ranks whose token counts add up to the job's (torchtitan's "loss" mesh): rank ``rank`` of ``ranks``."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ranks


def _train_state(folder: Path, rank: int = 0, ranks: int = 1):
    from types import SimpleNamespace

    from kubetitan_trainer import storage
    from kubetitan_trainer.trainer import KubetitanTrainer

    t = KubetitanTrainer.__new__(KubetitanTrainer)  # only what the train state's save and load read
    t.step, t.ntokens_seen, t.productive_seconds = 0, 0, 0.0
    t._global_tokens, t._loading_legacy_train_state = 0, False
    t._store = storage.LocalStore(str(folder))
    t.parallel_dims = SimpleNamespace(dp_cp_enabled=ranks > 1, get_optional_mesh=lambda name: _LossMesh(rank, ranks))
    return t


def test_the_jobs_tokens_are_split_over_the_resuming_ranks_and_an_older_checkpoint_still_loads(tmp_path, caplog):
    """In-process DCP (no process group): a checkpoint carrying the job's tokens gives each of 3 resuming ranks its
    share (summing to it exactly); one saved before that key existed loads too, each rank keeping the count saved
    (the old behaviour), with one warning."""
    import torch.distributed.checkpoint as dcp

    from kubetitan_trainer.trainer import GLOBAL_TOKENS_KEY, token_share

    def load(sd, checkpoint_id, from_hf, from_quantized):  # torchtitan's dcp_load, non-HF branch, no model
        dcp.load(sd, checkpoint_id=checkpoint_id)

    saver = _train_state(tmp_path)
    saver.step, saver.ntokens_seen = 5, 1921
    saver._sum_tokens_seen()  # what every save does first
    dcp.save({"train_state": saver}, checkpoint_id=str(tmp_path / "step-5"))
    shares = []
    for rank in range(3):
        t = _train_state(tmp_path, rank, 3)
        t._dcp_load(load, {"train_state": t}, str(tmp_path / "step-5"), False, False)
        shares.append((t.step, t.ntokens_seen))
    assert shares == [(5, 641), (5, 640), (5, 640)]
    assert [token_share(6, r, 4) for r in range(4)] == [2, 2, 1, 1] and token_share(7, 0, 1) == 7

    # rank 0's own count of a DP 2 run, as an older kubetitan saved it: no job total
    old = {"step": 3, "ntokens_seen": 576, "productive_step_seconds": 1.5}
    dcp.save({"train_state": old}, checkpoint_id=str(tmp_path / "step-3"))
    t = _train_state(tmp_path, 0, 3)
    with caplog.at_level("WARNING"):
        t._dcp_load(load, {"train_state": t}, str(tmp_path / "step-3"), False, False)
    assert (t.step, t.ntokens_seen, t.productive_seconds) == (3, 576, 1.5)
    assert caplog.text.count(f"has no train_state.{GLOBAL_TOKENS_KEY}") == 1
    assert GLOBAL_TOKENS_KEY in t.state_dict()  # its next save carries the job's count


def test_new_mixture_weights_at_a_resume_hold_from_the_next_step_within_half_a_sample(corpus, tmp_path):
    """70/30 for 4 steps, then the same run resumed with 50/50: from the resume's first sample on, every prefix of
    the stream holds 50/50 within half a sample (every step 3 and 3); before, the schedule caught up on the
    cumulative shares and gave the 30% source the next samples in a row. The trainer's log says the weights
    changed."""
    def mixture(a: int, b: int) -> dict[str, Any]:
        return {"source": "mixture", "mixture": [{"shards": {"path": str(corpus["code-a"])}, "weight": a},
                                                 {"shards": {"path": str(corpus["code-b"])}, "weight": b}]}

    dump = tmp_path / "reweighted"
    run(tmp_path, dump, 2, 4, mixture(7, 3))
    obj = tiny_lpt({"training": {"steps": 8, "seqLen": SEQ_LEN, "localBatchSize": 1, "globalBatchSize": GLOBAL_BATCH,
                            "warmupSteps": 1},
               "parallelism": {"dataParallelShardDegree": 2},
               "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
               "data": mixture(1, 1), "checkpoint": {"intervalSteps": 1000}})
    rc, out = launch(ledger_config(obj, dump, tmp_path / "reweighted-50-50.toml"), 2, "ledger")
    assert rc == 0, out[-4000:]
    assert "The mixture's weights changed at global sample 24: code-a 70.0%, code-b 30.0% before, code-a 50.0%, " \
           "code-b 50.0% from here on" in out, out[-4000:]
    rows = ledger(dump)
    assert [r[1] for r in rows] == list(range(8 * GLOBAL_BATCH))
    before = [r for r in rows if r[0] <= 4]
    assert collections.Counter(r[2] for r in before) == {0: 17, 1: 7}  # 70/30 of 24, within one sample
    after = [r for r in rows if r[0] > 4]
    ones = 0
    for n, r in enumerate(after, 1):
        ones += r[2]
        assert abs(ones - n / 2) <= 0.5, [r[2] for r in after]
    for step in range(5, 9):
        assert collections.Counter(r[2] for r in after if r[0] == step) == {0: 3, 1: 3}
