"""The global sample stream, torch-free (``kubetitan_trainer.data.stream``): the seeded permutation, the mixture
schedule, held-out windows; and that the module imports no torch (tests/support/codemap.py's layer table says so for
its imports, this checks what a fresh interpreter loads). The dataloader built on it is tested in test_loader.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kubetitan_trainer.data.stream import GlobalStream, MixSchedule, epoch_permutation, integer_weights
from kubetitan_trainer.errors import ConfigError
from support.streams import SEQ, source


def test_the_stream_imports_no_torch():
    """A fresh interpreter that imports the stream has loaded neither torch, torchtitan nor torchao (the trainer's
    torch-free parts, such as prepare-data, and these tests read the stream without paying for torch)."""
    code = ("import sys, kubetitan_trainer.data.stream\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchtitan', 'torchao')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------------ permutation
def test_epoch_permutation_is_seeded_deterministic_and_a_permutation():
    a = epoch_permutation(1000, seed=7, source=0, epoch=0)
    assert a.dtype == np.int32 and sorted(a.tolist()) == list(range(1000))
    assert np.array_equal(a, epoch_permutation(1000, seed=7, source=0, epoch=0))
    others = [epoch_permutation(1000, 8, 0, 0), epoch_permutation(1000, 7, 1, 0), epoch_permutation(1000, 7, 0, 1)]
    assert all(not np.array_equal(a, o) for o in others)  # seed, source and epoch each change the order
    # pinned: numpy's PCG64 stream for this seed (a numpy that changed it would reorder every resumed run)
    assert a[:6].tolist() == [816, 923, 151, 900, 213, 100]  # numpy 2.4.6


def test_a_shuffled_source_visits_every_window_once_per_epoch_and_reshuffles():
    s = GlobalStream([source("a", 50)], [1.0], seed=3, shuffled=True)
    first, second = s.take(50), s.take(50)
    assert sorted(x.window for x in first) == list(range(50)) == sorted(x.window for x in second)
    assert [x.window for x in first] != [x.window for x in second] != list(range(50))
    assert {x.epoch for x in first} == {0} and {x.epoch for x in second} == {1}
    seq = GlobalStream([source("a", 50)], [1.0], seed=3, shuffled=False).take(60)
    assert [x.window for x in seq] == list(range(50)) + list(range(10))  # sequential: corpus order, then loops


def test_the_synthetic_source_is_never_permuted():
    from kubetitan_trainer.data.stream import SyntheticSource

    syn = SyntheticSource(2048, SEQ, seed=3)
    got = GlobalStream([syn], [1.0], seed=3, shuffled=True).take(5)  # a permutation of 2**40 windows would not fit
    assert [x.window for x in got] == [0, 1, 2, 3, 4]
    mixed = GlobalStream([syn, source("a", 10)], [1.0, 1.0], seed=3, shuffled=True).take(40)
    assert sorted(x.window for x in mixed if x.source == 1) == sorted(list(range(10)) * 2)


# ------------------------------------------------------------------ mixture
@pytest.mark.parametrize("weights", [[1.0, 1.0], [3.0, 1.0], [0.7, 0.2, 0.1], [1 / 3, 2 / 3], [5.0], [0.01, 0.99],
                                     [2.5, 2.5, 5.0, 0.001]])
def test_mixture_schedule_holds_the_weights_within_one_sample_at_every_prefix(weights):
    sched = MixSchedule(weights)
    shares = [w / sum(weights) for w in weights]
    picks = [sched.next() for _ in range(20_000)]
    counts = [0] * len(weights)
    for n, i in enumerate(picks, 1):
        counts[i] += 1
        assert all(abs(c - n * w) < 1 + 1e-9 for c, w in zip(counts, shares)), (n, counts)


def test_integer_weights_keep_the_ratios_and_refuse_non_positive_ones():
    assert integer_weights([3.0, 1.0]) == [3, 1]
    assert integer_weights([0.75, 0.25]) == [3, 1]
    assert integer_weights([0.5, 0.5, 1]) == [1, 1, 2]
    with pytest.raises(ConfigError, match="positive weight"):
        integer_weights([1.0, 0.0])


def test_each_mixture_source_has_its_own_shuffled_epochs():
    s = GlobalStream([source("a", 30), source("b", 11)], [1.0, 3.0], seed=1, shuffled=True)
    got = s.take(400)
    for i, n in ((0, 30), (1, 11)):
        mine = [x for x in got if x.source == i]
        for e in range(len(mine) // n):
            assert sorted(x.window for x in mine[e * n:(e + 1) * n]) == list(range(n))
    assert s.state()["source_draws"] == [100, 300] and s.state()["consumed_samples"] == 400


# ------------------------------------------------------------------ held out
def test_held_out_windows_are_the_tail_and_never_trained():
    s = source("a", 200, held_out_percent=5)
    assert (s.windows, s.held_out_windows) == (190, 10)
    trained = {x.window for x in GlobalStream([s], [1.0], seed=0, shuffled=True).take(190 * 3)}
    assert trained == set(range(190))
    assert s.held_out(0)[0] == 190 * (SEQ + 1)
    with pytest.raises(ConfigError, match="none left to train on"):
        source("tiny", 1, held_out_percent=50)
