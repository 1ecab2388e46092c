"""The optimizer's part of a restore-tier load, deferred to a background thread (``defer_optimizer_load``, issue 29
item 2): the load returns before the optimizer's moments are copied, the optimizer's next step waits for them, the
result is the state a load at once gives, and an optimizer that does not keep the tensors it was given, or a copy
that fails, is handled as a load at once / a failed load."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import runtime
from kubetitan_trainer.recovery import restore_tier
from kubetitan_trainer.trainer import KubetitanTrainer as Trainer

from .test_anatomy_restore import _flat, _same, _trained


def _tier(tmp_path):
    src = _trained(seed=1)
    restore_tier.save(src[2], tmp_path, step=8, rank=0, world_size=1, checkpoint_folder=str(tmp_path / "ckpt"))
    return src


def _moments(opt) -> list[torch.Tensor]:
    return [s["exp_avg"] for o in opt for s in o.state.values()]


@pytest.fixture
def small_tensors_defer(monkeypatch):
    monkeypatch.setattr(restore_tier, "DEFER_MIN_BYTES", 64)  # the test model's moments are 64-256 bytes


def _gate(monkeypatch) -> threading.Event:
    """Hold the deferred copy (the second ``_copy`` of a load) until the returned event is set."""
    gate, real = threading.Event(), restore_tier.Prepared._copy
    calls = []

    def held(self, entries, **kw):
        calls.append(len(entries))
        if len(calls) > 1:
            assert gate.wait(30)
        real(self, entries, **kw)

    monkeypatch.setattr(restore_tier.Prepared, "_copy", held)
    return gate


def test_the_load_returns_before_the_moments_and_the_result_is_a_load_at_once(tmp_path, monkeypatch,
                                                                             small_tensors_defer):
    src = _tier(tmp_path)
    want = _trained(seed=3)
    restore_tier.load(want[2], tmp_path, rank=0)  # at once
    got = _trained(seed=3)
    gate = _gate(monkeypatch)
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.apply(defer=("optimizer",))
    assert prepared.pending is not None and not prepared.pending.done
    # the model, the train state and the small moments are in; the others are not yet (still seed 3's values)
    assert torch.equal(got[0][0].weight, src[0][0].weight) and got[2]["train_state"].state_dict()["step"] == 8
    pairs = list(zip(_moments(got[1]), _moments(src[1])))
    big = [a.nbytes >= restore_tier.DEFER_MIN_BYTES for a, _b in pairs]
    assert any(big) and not all(big)
    assert [torch.equal(a, b) for a, b in pairs] == [not x for x in big]
    gate.set()
    prepared.pending.wait()
    assert prepared.pending.done and prepared.pending.nbytes > 0
    assert _same(_flat(*got), _flat(*want)) and _same(_flat(*got), _flat(*src))


def test_the_optimizer_step_waits_for_the_moments(tmp_path, monkeypatch, small_tensors_defer):
    """Through the trainer's hook: a step taken while the copy is held still steps from the loaded moments."""
    _tier(tmp_path)
    ref = _trained(seed=3)
    restore_tier.load(ref[2], tmp_path, rank=0)
    got = _trained(seed=3)
    gate = _gate(monkeypatch)
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.apply(defer=("optimizer",))
    Trainer._wait_before_optimizer_step(SimpleNamespace(optimizers=got[1]), prepared.pending, str(tmp_path), 0)
    x = torch.randn(3, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    for model, opt in ((ref[0], ref[1]), (got[0], got[1])):
        model(x).float().square().mean().backward()
    stepped = threading.Thread(target=got[1].step)
    stepped.start()
    stepped.join(0.5)
    assert stepped.is_alive()  # held by the hook until the moments are in
    gate.set()
    stepped.join(30)
    ref[1].step()
    assert _same(_flat(*got), _flat(*ref))
    got[1].zero_grad()
    got[1].step()  # the hook ran once and is gone


def test_an_optimizer_that_copies_what_it_is_given_is_loaded_at_once(tmp_path, monkeypatch, small_tensors_defer):
    src = _tier(tmp_path)
    got = _trained(seed=3)
    real = type(got[1]).load_state_dict
    monkeypatch.setattr(type(got[1]), "load_state_dict", lambda self, sd: real(self, copy.deepcopy(sd)))
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.apply(defer=("optimizer",))
    assert prepared.pending is None
    assert _same(_flat(*got), _flat(*src))


def _load_whose_deferred_copy_fails(tmp_path, monkeypatch):
    """A model/optimizer loaded from a tier with the optimizer deferred, whose deferred copy raises OSError."""
    _tier(tmp_path)
    got = _trained(seed=3)
    real, calls = restore_tier.Prepared._copy, []

    def broken(self, entries, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("the tier's file went away")
        real(self, entries, **kw)

    monkeypatch.setattr(restore_tier.Prepared, "_copy", broken)
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.apply(defer=("optimizer",))
    return got, prepared


def test_a_failed_deferred_copy_fails_the_step_and_deletes_the_tier(tmp_path, monkeypatch, small_tensors_defer):
    got, prepared = _load_whose_deferred_copy_fails(tmp_path, monkeypatch)
    Trainer._wait_before_optimizer_step(SimpleNamespace(optimizers=got[1]), prepared.pending, str(tmp_path), 0)
    got[0](torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    with pytest.raises(OSError, match="went away"):
        got[1].step()
    assert not (tmp_path / "rank-0.json").exists()


def test_the_deferral_settings_come_from_the_runtime_table(monkeypatch) -> None:
    assert restore_tier.defer_keys() == ("optimizer",) and restore_tier.defer_threads() == 4  # the defaults
    assert restore_tier.defer_switch_interval() is None
    s = KubetitanRuntime(defer_optimizer_load=False, defer_threads=2, defer_switch_interval_ms=1)
    assert (restore_tier.defer_keys(s), restore_tier.defer_threads(s), restore_tier.defer_switch_interval(s)) == \
        ((), 2, 0.001)
    monkeypatch.setattr(runtime, "CURRENT", s)  # this process's settings (runtime.load at the worker's start)
    assert (restore_tier.defer_keys(), restore_tier.defer_threads()) == ((), 2)


def test_the_deferred_part_runs_on_its_own_threads_and_larger_chunks(tmp_path, monkeypatch, small_tensors_defer):
    _tier(tmp_path)
    seen, chunks, real = [], [], restore_tier._ParallelLoad.__init__

    def init(self, threads, *a, **kw):
        seen.append(threads)
        real(self, threads, *a, **kw)
        chunks.append(self.chunk)

    monkeypatch.setattr(restore_tier._ParallelLoad, "__init__", init)
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(defer_threads=3))
    got = _trained(seed=3)
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.threads = 7
    prepared.apply(defer=("optimizer",))
    prepared.pending.wait()
    assert seen == [7, 3]  # the load at once on the load's threads, the deferred part on its own
    # the deferred part's threads share DEFER_BOUNCE_BUDGET: fewer, larger chunks (GIL switches) than the load at once
    load = restore_tier._ParallelLoad
    assert chunks == [restore_tier.chunk_for(7, load.CHUNK, load.BOUNCE_BUDGET),
                      restore_tier.chunk_for(3, load.CHUNK, restore_tier.DEFER_BOUNCE_BUDGET)]
    assert chunks[1] == load.CHUNK > restore_tier.chunk_for(3, load.CHUNK, load.BOUNCE_BUDGET)


class _Host(SimpleNamespace):
    """What the trainer's deferred-load methods read of ``self``."""

    def _rank_world(self):
        return 0, 1


def test_a_load_before_the_last_loads_step_waits_for_its_copy_and_drops_its_hooks(tmp_path, monkeypatch,
                                                                                   small_tensors_defer):
    """An in-process restart loads again before the first optimizer step: the earlier background copy ends first
    (nothing else may write the moments meanwhile), and its step pre-hooks are gone."""
    _tier(tmp_path)
    got = _trained(seed=3)
    gate = _gate(monkeypatch)
    prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
    prepared.apply(defer=("optimizer",))
    host = _Host(optimizers=got[1], _tier_pending=prepared.pending, _tier=str(tmp_path))
    Trainer._wait_before_optimizer_step(host, prepared.pending, str(tmp_path), 0)
    assert host._tier_hooks and all(o._optimizer_step_pre_hooks for o in got[1])
    settled = threading.Thread(target=Trainer._settle_tier_pending, args=(host,))
    settled.start()
    settled.join(0.5)
    assert settled.is_alive()  # held until the copy ends
    gate.set()
    settled.join(30)
    assert prepared.pending.done and host._tier_pending is None and host._tier_hooks == []
    assert not any(o._optimizer_step_pre_hooks for o in got[1])
    assert (tmp_path / "rank-0.json").exists()


def test_a_failed_copy_settled_by_the_next_load_deletes_the_tier_but_fails_no_step(tmp_path, monkeypatch,
                                                                                   small_tensors_defer, caplog):
    got, prepared = _load_whose_deferred_copy_fails(tmp_path, monkeypatch)
    host = _Host(optimizers=got[1], _tier_pending=prepared.pending, _tier=str(tmp_path))
    Trainer._wait_before_optimizer_step(host, prepared.pending, str(tmp_path), 0)
    with caplog.at_level("WARNING"):
        Trainer._settle_tier_pending(host)
    assert "background copy failed (the tier's file went away); deleting this rank's tier" in caplog.text
    assert not (tmp_path / "rank-0.json").exists()
    got[0](torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    got[1].step()  # the failed copy's hook is gone with it
    Trainer._settle_tier_pending(host)  # nothing pending: a no-op


def test_the_switch_interval_is_short_while_the_deferred_copy_runs_and_put_back_after(tmp_path, monkeypatch,
                                                                                      small_tensors_defer):
    import sys

    _tier(tmp_path)
    got = _trained(seed=3)
    gate = _gate(monkeypatch)
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(defer_switch_interval_ms=1))
    before = sys.getswitchinterval()
    try:
        prepared = restore_tier.prepare(got[2], tmp_path, rank=0)
        prepared.apply(defer=("optimizer",))
        assert sys.getswitchinterval() == pytest.approx(0.001)  # while the copy is held
        gate.set()
        prepared.pending.wait()
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
