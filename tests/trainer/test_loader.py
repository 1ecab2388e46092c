"""The data loader over the global stream: the global position each rank reads (a table over world size, local
batch and gradient accumulation, with resumes at another world size), the mixture's weights across resumes, the
held-out loader and the eval metrics. No torch distributed, no training: the ledger test (test_ledger.py) runs the
trainer; the stream's torch-free parts (permutation, mixture schedule, held-out windows) are in test_stream.py."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kubetitan_trainer.data import loaders as data
from kubetitan_trainer.data.loaders import EvalLoader, GlobalDataLoader
from kubetitan_trainer.data.stream import GlobalStream, ScheduledMix, _Order, rank_slice
from kubetitan_trainer.errors import ConfigError
from kubetitan_core.weights import WeightSchedule
from support.streams import SEQ, source


# ------------------------------------------------------------------ global position
def run_steps(stream_factory, state, W, b, A, steps):
    """Train ``steps`` steps at world size W, local batch b, accumulation A from ``state``: the global positions each
    step trained (rank by rank) and the loaders' states afterwards (one per rank)."""
    loaders = []
    for r in range(W):
        ld = GlobalDataLoader(stream_factory(), dp_rank=r, dp_world_size=W, local_batch=b)
        if state is not None:
            ld.load_state_dict(state)
        loaders.append(ld)
    seen = []
    for r, ld in enumerate(loaders):
        it = iter(ld)
        for s in range(steps):
            for m in range(A):
                inputs, labels = next(it)
                assert inputs["input"].shape == (b, SEQ) and labels.shape == (b, SEQ)
                seen.append((s, r, m, inputs["input"][:, 0].tolist()))
    states = [ld.state_dict() for ld in loaders]
    return seen, states


CASES = [  # (W, b, A): global batch B = W*b*A
    (1, 1, 1), (2, 1, 1), (3, 1, 1), (1, 4, 1), (2, 2, 1), (4, 1, 3), (3, 2, 2), (2, 3, 1), (6, 1, 1), (1, 1, 6),
    (2, 1, 3), (3, 1, 2), (5, 2, 1), (1, 2, 5), (8, 1, 2), (2, 4, 2),
]


@pytest.mark.parametrize("W,b,A", CASES, ids=[f"W{w}-b{b}-A{a}" for w, b, a in CASES])
def test_rank_slice_tiles_each_step_with_the_global_batch(W, b, A):
    B = W * b * A
    for s in range(3):
        got = sorted(p for m in range(A) for r in range(W) for p in rank_slice(s * B, m, r, W, b))
        assert got == list(range(s * B, (s + 1) * B))


def _factory(shuffled=True):
    return lambda: GlobalStream([source("a", 37), source("b", 23)], [2.0, 1.0], seed=11, shuffled=shuffled)


def _global_sequence(seen, W, b, A):
    """The global stream positions trained, in stream order: micro-batch m of step s holds W*b samples, rank r the
    r-th b of them."""
    slots = {}
    for s, r, m, firsts in seen:
        for i, t in enumerate(firsts):
            slots[(s, m, r, i)] = t
    return [slots[k] for k in sorted(slots)]


@pytest.mark.parametrize("W,b,A", CASES, ids=[f"W{w}-b{b}-A{a}" for w, b, a in CASES])
def test_every_world_size_trains_the_same_global_stream(W, b, A):
    """Rank r's micro-batch m of step s holds global samples [s*B + m*W*b + r*b, +b): the stream in order."""
    B = W * b * A
    f = _factory()
    want = [f().tokens(x)[0] for x in f().take(4 * B)]
    seen, states = run_steps(f, None, W, b, A, 4)
    assert _global_sequence(seen, W, b, A) == want
    assert all(st == states[0] for st in states)  # the state is global: the same on every rank
    assert data.json.loads(states[0][data._STATE_KEY])["consumed_samples"] == 4 * B


RESUMES = [  # a chain of (W, b, A) legs with the same global batch B = 12, each leg 3 steps, resumed from the last
    [(2, 1, 6), (1, 1, 12), (3, 1, 4)],
    [(2, 2, 3), (4, 3, 1), (6, 1, 2), (1, 12, 1)],
    [(3, 4, 1), (2, 3, 2), (12, 1, 1)],
]


def _scheduled_factory(shuffled=True):
    """a: 2 until step 2, then linearly down to 0.5 at step 6; b: 1, then 3 from step 5 (global batch 12)."""
    schedules = [WeightSchedule(2.0, "linear", ((2, 2.0), (6, 0.5))), WeightSchedule(1.0, "step", ((5, 3.0),))]
    return lambda: GlobalStream([source("a", 37), source("b", 23)], [2.0, 1.0], seed=11, shuffled=shuffled,
                                mix=ScheduledMix(schedules, 12))


@pytest.mark.parametrize("legs", RESUMES, ids=["->".join(f"W{w}b{b}A{a}" for w, b, a in legs) for legs in RESUMES])
@pytest.mark.parametrize("mix", ["constant", "scheduled"])
def test_a_resume_at_another_world_size_continues_the_same_stream(legs, mix):
    """DP 2 -> 1 -> 3 (and other chains) with the same global batch continue one global stream, with constant
    weights and with a weight schedule (whose shares change at steps 3-6 and 5, inside the legs)."""
    f = _factory() if mix == "constant" else _scheduled_factory()
    B = 12
    total = 3 * len(legs)
    want = [f().tokens(x)[0] for x in f().take(total * B)]
    got, state = [], None
    for W, b, A in legs:
        assert W * b * A == B
        seen, states = run_steps(f, state, W, b, A, 3)
        got += _global_sequence(seen, W, b, A)
        state = states[0]
    assert got == want  # no sample skipped, none repeated, same order


def test_a_resume_with_changed_sources_replays_the_new_mixture_to_the_saved_position():
    f = _factory()
    ld = GlobalDataLoader(f(), dp_rank=0, dp_world_size=1, local_batch=5)
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    other = GlobalStream([source("a", 37), source("c", 23)], [1.0, 1.0], seed=11, shuffled=True)
    GlobalDataLoader(other, dp_rank=0, dp_world_size=1, local_batch=5).load_state_dict(state)
    assert other.position == 10 and other.schedule.counts == [5, 5]


@pytest.mark.parametrize("old, new", [([7.0, 3.0], [1.0, 1.0]), ([7.0, 3.0], [1.0, 4.0]), ([1.0, 1.0, 1.0], [5.0, 3.0, 2.0])],
                         ids=["70/30->50/50", "70/30->20/80", "thirds->50/30/20"])
def test_new_mixture_weights_hold_from_the_resume_on_within_half_a_sample(old, new, caplog):
    """Weights changed at a resume apply from the resume's position on: over every prefix after it each source has
    its new share within half a sample (a fresh schedule's guarantee), with no burst of the source the old weights
    starved (the schedule used to catch up on the cumulative shares: 70/30 -> 50/50 after 400 samples gave the
    30% source the next 160 samples in a row). Each source's draws continue where they were."""
    names = [chr(ord("a") + i) for i in range(len(old))]
    before = GlobalStream([source(n, 50) for n in names], old, seed=3, shuffled=True)
    ld = GlobalDataLoader(before, dp_rank=0, dp_world_size=1, local_batch=8)
    it = iter(ld)
    for _ in range(50):  # 400 samples at the old weights
        next(it)
    state = ld.state_dict()
    saved = data.json.loads(state[data._STATE_KEY])
    after = GlobalStream([source(n, 50) for n in names], new, seed=3, shuffled=True)
    with caplog.at_level("WARNING"):
        GlobalDataLoader(after, dp_rank=0, dp_world_size=1, local_batch=8).load_state_dict(state)
    assert "The mixture's weights changed at global sample 400" in caplog.text, caplog.text
    got = after.take(600)
    assert [x.position for x in got] == list(range(400, 1000))
    shares = [w / sum(new) for w in new]
    counts = [0] * len(new)
    bound = 0.5 if len(new) == 2 else 1.0  # two sources: within half a sample; more: the schedule's one sample
    for n, x in enumerate(got, 1):
        counts[x.source] += 1
        assert all(abs(c - n * w) <= bound + 1e-9 for c, w in zip(counts, shares)), (n, counts)
    longest = max(len(list(run)) for _, run in itertools.groupby(x.source for x in got))
    assert longest <= max(new) / min(new) + 1, longest  # no burst: runs as long as the new weights make them
    # each source's draws continue: its next window is its (draws + 1)-th
    for i in range(len(new)):
        first = next(x for x in got if x.source == i)
        order = _Order(50, 3, i, True)
        assert (first.window, first.epoch) == order(saved["source_draws"][i])
    # and the new weights' base travels in the next checkpoint: a resume with them unchanged does not re-base
    again = GlobalStream([source(n, 50) for n in names], new, seed=3, shuffled=True)
    again.restore(after.state())
    assert again.schedule.base_g == 400 and again.take(50) == after.take(50)


SCHEDULES = {  # name -> (schedules, samples per step, steps)
    "anneal-in-last-25pct": ([WeightSchedule(1.0), WeightSchedule(0.0, "linear", ((30, 0.0), (40, 1.0)))], 8, 40),
    "step-70/30-to-50/50": ([WeightSchedule(7.0, "step", ((10, 5.0),)), WeightSchedule(3.0, "step", ((10, 5.0),))], 6, 20),
    "three-linear": ([WeightSchedule(5.0, "linear", ((20, 1.0),)), WeightSchedule(3.0), WeightSchedule(0.5, "linear",
                                                                                                   ((10, 4.0),))], 7, 25),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_weight_schedule_gives_each_step_its_weights_with_no_catching_up(name):
    """Every prefix of the stream holds each source's cumulative scheduled share within half a sample (two sources)
    or one (three); each step's samples follow that step's weights (a source at weight 0 gets none); a change of
    weights is not followed by a burst of the source the old weights starved."""
    schedules, B, steps = SCHEDULES[name]
    mix = ScheduledMix(schedules, B)
    picks = [mix.next() for _ in range(B * steps)]
    bound = 0.5 if len(schedules) == 2 else 1.0
    expected = [0.0] * len(schedules)
    counts = [0] * len(schedules)
    for g, i in enumerate(picks):
        ws = [float(sch.at(g // B + 1)) for sch in schedules]
        expected = [e + w / sum(ws) for e, w in zip(expected, ws)]
        counts[i] += 1
        assert all(abs(c - e) <= bound + 1e-9 for c, e in zip(counts, expected)), (g, counts, expected)
    for step in range(1, steps + 1):
        got = [picks[(step - 1) * B:step * B].count(i) for i in range(len(schedules))]
        ws = [float(sch.at(step)) for sch in schedules]
        assert all(abs(c - B * w / sum(ws)) < 2 for c, w in zip(got, ws)), (step, got, ws)
        assert all(c == 0 for c, w in zip(got, ws) if w == 0)
    if name == "step-70/30-to-50/50":  # from step 10 on: 3 and 3 every step, no catching up on the old 70/30
        assert all(picks[(s - 1) * B:s * B].count(1) == 3 for s in range(10, steps + 1))


def test_a_changed_schedule_at_a_resume_applies_from_there_and_is_logged(caplog):
    """The checkpoint keeps the schedule; a resume with another one (or from constant weights to a schedule) re-bases
    there, says so, and the new schedule's shares hold from the resume on."""
    f = _factory()
    ld = GlobalDataLoader(f(), dp_rank=0, dp_world_size=1, local_batch=12)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = ld.state_dict()
    after = _scheduled_factory()()
    with caplog.at_level("WARNING"):
        GlobalDataLoader(after, dp_rank=0, dp_world_size=1, local_batch=12).load_state_dict(state)
    assert "The mixture's weights changed at global sample 36: a 66.7%, b 33.3% before, scheduled (a linear: 2 at " \
           "step 0, 2 at step 2, 0.5 at step 6; b step: 1 at step 0, 3 at step 5) from here on" in caplog.text
    assert after.schedule.base_g == 36
    again = _scheduled_factory()()
    again.restore(after.state())  # the same schedule: no re-base, the same continuation
    assert again.schedule.base_g == 36 and again.take(40) == after.take(40)


def test_the_weights_are_logged_where_the_schedule_changes_them(caplog):
    ld = GlobalDataLoader(_scheduled_factory()(), dp_rank=0, dp_world_size=2, local_batch=3)
    it = iter(ld)
    with caplog.at_level("INFO"):
        for _ in range(2 * 7):  # 7 steps of 2 micro-batches
            next(it)
    lines = [r.getMessage() for r in caplog.records if "The mixture's weights at step" in r.getMessage()]
    assert lines == [
        "The mixture's weights at step 1: a 66.7%, b 33.3%; the next schedule point is at step 2",
        "The mixture's weights at step 2: a 66.7%, b 33.3%; the next schedule point is at step 5",
        "The mixture's weights at step 5: a 22.6%, b 77.4%; the next schedule point is at step 6",
        "The mixture's weights at step 6: a 14.3%, b 85.7%; no schedule point after it"], lines


def test_a_checkpoint_from_before_the_weights_were_saved_resumes_as_before():
    """A state without ``weights`` (older checkpoints): the same weights are assumed, the schedule goes on from 0."""
    f = _factory()
    s = f()
    s.take(30)
    state = {k: v for k, v in s.state().items() if k in ("consumed_samples", "source_draws", "sources")}
    t = f()
    assert t.restore(state) is None and t.schedule.base_g == 0
    assert t.take(20) == s.take(20)


def test_a_per_rank_checkpoint_state_is_a_config_error():
    ld = GlobalDataLoader(_factory()(), dp_rank=0, dp_world_size=2, local_batch=1)
    with pytest.raises(ConfigError, match="not a global one"):
        ld.load_state_dict({"dp_rank_0": b"x", "world_size": 2})


@pytest.mark.parametrize("W,b", [(1, 1), (2, 1), (3, 2), (4, 4)])
def test_eval_loader_gives_every_rank_the_same_number_of_batches_and_covers_the_set(W, b):
    samples = 30
    read = lambda p: np.full(SEQ + 1, p, dtype=np.int64)  # noqa: E731
    loaders = [EvalLoader(read, samples, dp_rank=r, dp_world_size=W, local_batch=b) for r in range(W)]
    batches = [list(ld) for ld in loaders]
    n = samples // (W * b)
    assert all(len(bs) == n for bs in batches)
    got = sorted(int(x) for bs in batches for inp, _ in bs for x in inp["input"][:, 0])
    assert got == list(range(n * W * b))
    assert [int(x) for inp, _ in list(loaders[0]) for x in inp["input"][:, 0]] == \
        [int(x) for inp, _ in batches[0] for x in inp["input"][:, 0]]  # the same samples at every evaluation


def test_eval_metrics_appear_with_the_first_evaluation():
    from prometheus_client import generate_latest

    from kubetitan_core import contract
    from kubetitan_trainer.metrics import Exporter, eval_perplexity

    ex = Exporter(peak_flops=None, total_steps=10, attempt=0, job_start=0.0)
    assert contract.M_EVAL_LOSS.encode() not in generate_latest(ex.registry)
    ex.eval_done(5, 2.0)
    text = generate_latest(ex.registry).decode()
    assert f"{contract.M_EVAL_LOSS} 2.0" in text and f"{contract.M_EVAL_STEP} 5.0" in text
    assert f"{contract.M_EVAL_PERPLEXITY} {math.exp(2.0)}" in text
    assert eval_perplexity(1000.0) == math.inf
    ex.data_tokens({"a": 80, "b": 16})
    ex.data_tokens({"a": 160, "b": 16})
    text = generate_latest(ex.registry).decode()
    assert f'{contract.M_DATA_TOKENS}{{source="a"}} 160.0' in text and f'{contract.M_DATA_TOKENS}{{source="b"}} 16.0' in text


def test_init_validator_sets_what_the_base_init_sets():
    from kubetitan_trainer import compat

    class Bare:
        """An object the base class's __init__ never ran on."""

    v = Bare()
    compat.init_validator(v, **{name: name for name in compat.VALIDATOR_ATTRIBUTES})
    assert vars(v) == {name: name for name in compat.VALIDATOR_ATTRIBUTES}


def test_a_streamed_dataset_resumed_at_another_dp_degree_is_a_config_error_not_an_assertion():
    import pickle

    from torch.utils.data import IterableDataset

    from kubetitan_trainer.data.loaders import LocalDataLoader

    class Empty(IterableDataset):
        def __iter__(self):
            return iter(())

    saved = LocalDataLoader(Empty(), dp_rank=0, dp_world_size=2, batch_size=1).state_dict()
    assert saved["world_size"] == 2 and pickle.loads(saved["dp_rank_0"])
    with pytest.raises(ConfigError, match="saved at data-parallel degree 2, this run has 1.*data.source shards"):
        LocalDataLoader(Empty(), dp_rank=0, dp_world_size=1, batch_size=1).load_state_dict(saved)
    LocalDataLoader(Empty(), dp_rank=0, dp_world_size=2, batch_size=1).load_state_dict(saved)  # same degree: fine


# ------------------------------------------------------------------ a streamed (hub) source inside a mixture
def _hub_source(tmp_path, name="stream"):
    """A :class:`data.HubSource` over a local JSONL file (the ``datasets`` path a hub dataset takes), seq_len SEQ."""
    import json

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from kubetitan_trainer.data.tokenizer import BUILTIN_TOKENIZER

    corpus = tmp_path / f"{name}.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": f"doc {i} " + "abc " * (i % 5 + 1)}) + "\n" for i in range(300)))
    return data.HubSource(name, data.HubSpec(str(corpus)), SEQ), HuggingFaceTokenizer(str(BUILTIN_TOKENIZER))


def _hub_loader(tmp_path, W, r, b=2):
    hub, tok = _hub_source(tmp_path)
    hub.open(tok, r, W)
    stream = GlobalStream([source("a", 40), hub], [3.0, 1.0], seed=5, shuffled=True)
    counted: list[dict] = []
    counters = data._Counters(stream)
    counters.exporter = SimpleNamespace(data_tokens=counted.append, data_weights=lambda shares: None,
                                         data_epochs=lambda epochs: None)
    return GlobalDataLoader(stream, dp_rank=r, dp_world_size=W, local_batch=b, on_batch=counters), counted


def test_a_streamed_source_is_mixed_by_the_schedule_and_read_per_rank_in_order(tmp_path):
    ld, counted = _hub_loader(tmp_path, W=1, r=0)
    it = iter(ld)
    batches = [next(it) for _ in range(6)]  # 12 samples: 9 from the shards, 3 from the stream
    assert counted[-1] == {"a": 9 * (SEQ + 1), "stream": 3 * (SEQ + 1)}  # exported per source, exact
    hub_rows = [row for inp, lab in batches for row in torch.cat([inp["input"], lab[:, -1:]], 1)
                if not _is_arange(row)]  # a shards window here is a run of consecutive ids (ArangeShards)
    assert len(hub_rows) == 3
    # the stream's consecutive windows, in its order
    again, tok = _hub_source(tmp_path)
    again.open(tok, 0, 1)
    assert [r.tolist() for r in hub_rows] == [again.next_window().tolist() for _ in range(3)]


def _is_arange(row) -> bool:
    return all(int(row[i + 1]) - int(row[i]) == 1 for i in range(len(row) - 1))


def test_a_streamed_source_resumes_at_the_same_degree_and_refuses_another(tmp_path):
    first, _ = _hub_loader(tmp_path, W=2, r=1)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state[data._RANK_DEGREE_KEY] == 2 and data._RANK_STATE_KEY.format(1) in state
    want = [next(it) for _ in range(3)]
    again, _ = _hub_loader(tmp_path, W=2, r=1)
    again.load_state_dict(state)
    got = [b for b, _ in zip(iter(again), range(3))]
    assert all(torch.equal(g[0]["input"], w[0]["input"]) for g, w in zip(got, want))  # continues where it stopped
    shrunk, _ = _hub_loader(tmp_path, W=1, r=0)
    with pytest.raises(ConfigError, match="saved at data-parallel degree 2, this run has 1.*prepare-data"):
        shrunk.load_state_dict(state)
    # a larger degree: rank 2's key is not in the checkpoint; caught before DCP would stop on the missing key
    grown, _ = _hub_loader(tmp_path, W=3, r=2)
    keys = {f"dataloader.{k}" for k in state}
    assert str(data.resume_problem(keys, grown)).startswith("data.source huggingface")
    assert data.resume_problem(keys, _hub_loader(tmp_path, W=2, r=1)[0]) is None


def test_a_per_rank_checkpoint_is_caught_before_it_is_loaded():
    ld = GlobalDataLoader(_factory()(), dp_rank=0, dp_world_size=1, local_batch=1)
    old = {"dataloader.dp_rank_0", "dataloader.world_size", "model.tok_embeddings.weight"}
    assert "older kubetitan" in str(data.resume_problem(old, ld))
    assert data.resume_problem({"dataloader." + data._STATE_KEY, "model.x"}, ld) is None
