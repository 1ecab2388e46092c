"""In-process restart (kubetitan_trainer.recovery.inprocess): the pure rules, then a real 2-rank gloo gang (support.gang) with
an injected exception, an injected hang and a fault the causes table does not restart in place."""

from __future__ import annotations

import math
import time

import pytest

from kubetitan_core.contract import ExitCode
from kubetitan_trainer import errors
from kubetitan_trainer.recovery import inprocess
from kubetitan_trainer.recovery.inprocess import Fault, classify, decide


def fault(rank=1, cause="ContainerFailed", step=5, in_place=True, code=1) -> Fault:
    return Fault(rank=rank, generation=0, step=step, cause=cause, seen="x", in_place=in_place, exit_code=code)


@pytest.mark.parametrize("exc, cause, in_place, code", [
    (RuntimeError("boom"), "ContainerFailed", True, 1),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"), "Hang",
     True, 7),
    (errors.NonFiniteLossError(5), "NonFiniteLoss", True, 3),
    (errors.ConfigError("a.b", "bad", "fix it"), "ConfigError", False, 2),
    (RuntimeError("CUDA error: unspecified launch failure; NVRM: Xid (PCI:0000:c6:00): 79, GPU has fallen off the bus"),
     "GPUXidError", False, 1),
])
def test_classify_goes_through_the_causes_table(exc, cause, in_place, code):
    f = classify(exc, rank=1, generation=0, step=5)
    assert (f.cause, f.in_place, f.exit_code) == (cause, in_place, code)
    assert Fault.loads(f.dumps()) == f


@pytest.mark.parametrize("name, primary, faults, previous, restarts, want_retry, want_code", [
    ("first retryable fault", fault(), [fault()], None, 0, True, 0),
    ("collateral error of a peer is retryable too", fault(), [fault(), fault(rank=0)], None, 0, True, 0),
    ("not in place (primary)", fault(cause="GPUXidError", in_place=False), [], None, 0, False, 1),
    ("not in place (another rank's record)", fault(), [fault(), fault(rank=0, cause="ConfigError", in_place=False,
                                                                     code=2)], None, 0, False, 2),
    ("budget used up", fault(), [fault()], None, 3, False, 1),
    ("same fault at the same step again", fault(), [fault()], fault(), 1, False, 1),
    ("same rank and cause at a later step", fault(step=9), [fault(step=9)], fault(), 1, True, 0),
])
def test_decide(name, primary, faults, previous, restarts, want_retry, want_code):
    d = decide(primary, faults, previous, restarts, max_restarts=3)
    assert (d.retry, d.exit_code) == (want_retry, want_code), (name, d.reason)


@pytest.mark.parametrize("name, tokens, world, want", [
    ("every rank holds the same whole step", ["step 3", "step 3"], 2, "step 3"),
    ("one rank's optimizer step had begun", ["step 3", ""], 2, None),
    ("no rank holds a whole step", ["", ""], 2, None),
    ("the ranks hold different steps", ["step 3", "step 4"], 2, None),
    ("a rank's word is missing", ["step 3"], 2, None),
    ("one rank", ["step 0"], 1, "step 0"),
])
def test_kept_state(name, tokens, world, want):
    assert inprocess.kept_state(tokens, world) == want, name


def test_step_state_is_whole_from_a_steps_start_until_its_optimizer_step_begins():
    s = inprocess.StepState()
    assert s.token() == ""  # nothing known before the first step
    s.begin(4)
    s.batches.append("mb")
    assert (s.token(), s.batches) == ("step 4", ["mb"])
    s.spoil("optimizer", (), {})  # a step pre-hook's arguments
    assert s.token() == ""
    s.begin(5)
    assert (s.token(), s.batches) == ("step 5", [])


def test_inject_fires_once_and_only_where_asked(monkeypatch):
    monkeypatch.setenv(inprocess.ENV_TEST_FAULT, "1:4:raise,0:6:nan")
    monkeypatch.setattr(inprocess, "_fired", set())
    assert inprocess.inject(0, 4, "loss") == "loss" and inprocess.inject(1, 3, "loss") == "loss"
    with pytest.raises(RuntimeError, match="injected fault at rank 1 step 4"):
        inprocess.inject(1, 4)
    assert inprocess.inject(1, 4, "loss") == "loss"  # once per process: the restarted step trains
    first = inprocess.inject(0, 6, 2.0)
    assert math.isnan(first) and inprocess.inject(0, 6, 2.0) == 2.0  # the second fault of the list, also once


@pytest.mark.xdist_group("trainer-torch")
def test_progress_timeout_interrupts_a_stalled_step_and_restarts_but_never_times_the_first_step():
    """The monitor's own hang detector (what NCCL needs): a step that stands still is reported as a Hang, the main
    thread (asleep in the step) is interrupted, and the body runs again on a new process group. The first step of
    each iteration (torch.compile, NCCL set-up: minutes on a cold cache, seen on an H100) is not timed: here it
    takes three progress timeouts and is not reported, in the first iteration and after the restart."""
    import torch.distributed as dist

    store = dist.HashStore()
    ip = inprocess.InProcessRestart(lambda: store, 0, 1, progress_timeout=0.3, poll_seconds=0.01)
    calls = []

    def body(iteration: int) -> str:
        calls.append(iteration)
        ip.step = 1
        time.sleep(0.9)  # the first step: compiling
        ip.step = 2
        if iteration == 0:
            time.sleep(60)  # a stalled step
        return "trained"

    try:
        assert ip.run(body) == "trained"
    finally:
        dist.destroy_process_group()
    assert calls == [0, 1] and ip.restarts == 1
    assert (ip.recoveries[0]["cause"], ip.recoveries[0]["fault_step"]) == ("Hang", 2)


def test_an_untimed_phase_of_a_step_is_not_a_hang():
    """A checkpoint save, or the wait for its staging (over 10 s for a 3B model's first pinned save on an H100),
    runs inside ``untimed()``: three progress timeouts there are not reported, and the step's clock starts again
    after it."""
    import torch.distributed as dist

    store = dist.HashStore()
    ip = inprocess.InProcessRestart(lambda: store, 0, 1, progress_timeout=0.3, poll_seconds=0.01)

    def body(iteration: int) -> str:
        ip.step = 1
        ip.step = 2  # the first step has ended: the timeout is armed
        with ip.untimed():
            time.sleep(0.9)  # the save
        ip.step = 3
        return "trained"

    try:
        assert ip.run(body) == "trained"
    finally:
        dist.destroy_process_group()
    assert ip.restarts == 0 and ip.recoveries == []


def test_an_evaluation_runs_untimed(monkeypatch):
    """The trainer hands its restarter's ``untimed`` to the validator (``KubetitanTrainer.train``): a held-out
    evaluation makes no step progress and may outlast the progress timeout."""
    from types import SimpleNamespace

    from torchtitan.components.validate import Validator

    from kubetitan_trainer.evaluation import KubetitanValidator

    ip = inprocess.InProcessRestart(lambda: None, 0, 1, progress_timeout=0.3)
    seen = []
    monkeypatch.setattr(Validator, "validate", lambda self, model_parts, step: seen.append(ip._untimed))
    v = object.__new__(KubetitanValidator)  # the phase only: no loader, model or loss needed
    v.metrics_processor, v.source_stats = SimpleNamespace(ntokens_since_last_log=0, time_last_log=0.0), None
    v.untimed = ip.untimed
    v.validate([], 10)
    assert seen == [1] and ip._untimed == 0


def test_a_process_group_that_cannot_be_made_again_ends_the_restart_cleanly(monkeypatch):
    """gloo's connectFullMesh can fail while a peer's old connections close (seen under make test): the restart ends
    with GangGaveUp (exit for the launcher's restart, one line), not a traceback that kills the rank hosting the
    store and, with it, its peers' restart."""
    import torch.distributed as dist

    store = dist.HashStore()
    ip = inprocess.InProcessRestart(lambda: store, 0, 1, poll_seconds=0.01)
    make = ip.init_process_group

    def flaky() -> None:
        if ip.generation > 0:
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:547] Connection closed by peer\nmore")
        make()

    monkeypatch.setattr(ip, "init_process_group", flaky)

    def body(iteration: int) -> None:
        ip.step = 5
        raise RuntimeError("a fault")

    with pytest.raises(inprocess.GangGaveUp) as e:
        ip.run(body)
    assert e.value.exit_code == 1 and ip.restarts == 1
    assert "making iteration 1's process group failed (RuntimeError: Gloo connectFullMesh failed with [pair.cc:547] " \
           "Connection closed by peer)" in str(e.value)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------- a real gloo gang
STEPS = dict(steps=8, save_every=2, timeout=2.0)
NO_HANG = dict(STEPS, timeout=20.0)
"""For the tests whose faults are exceptions: a rank slowed by a loaded machine past the 2 s collective time-out would
add a Hang of its own to the records (once, under make test's load, the same fault then no longer repeated and the
fallback test saw 3 restarts instead of 1). Only the hang test needs the short time-out."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from support import gang

    results = gang.launch(tmp_path_factory.mktemp("base"), **STEPS)
    assert [code for _, code, _ in results] == [0, 0]
    return [report for _, _, report in results]


def assert_restarted_in_process(results, baseline, cause: str) -> None:
    for (pid, code, report), base in zip(results, baseline):
        assert code == 0, report.get("gave_up")
        assert [it["pid"] for it in report["iterations"]] == [pid, pid], "the same process trained on"
        assert report["restarts"] == 1 and report["recoveries"][0]["cause"] == cause
        assert report["final_step"] == STEPS["steps"]
        # state from the tier, then the same steps on the same data: what an uninterrupted run has, exactly
        assert report["params"] == base["params"]
        assert report["losses"] == {k: v for k, v in base["losses"].items() if k in report["losses"]}
        assert {"state_loaded", "first_step"} <= set(report["recoveries"][0])


@pytest.mark.xdist_group("trainer-torch")
def test_exception_restarts_the_loop_in_the_same_processes(tmp_path, uninterrupted):
    from support import gang

    results = gang.launch(tmp_path, env={inprocess.ENV_TEST_FAULT: "1:5:raise"}, **NO_HANG)
    assert_restarted_in_process(results, uninterrupted, "ContainerFailed")
    assert results[0][2]["recoveries"][0]["fault_rank"] == 1


@pytest.mark.xdist_group("trainer-torch")
def test_hang_is_detected_by_the_collective_timeout_and_restarted(tmp_path, uninterrupted):
    from support import gang

    results = gang.launch(tmp_path, env={inprocess.ENV_TEST_FAULT: "1:5:hang"}, **STEPS)
    # rank 0 waited in the all-reduce for the process group's timeout and reported a Hang; rank 1, asleep in its
    # step, was interrupted by its monitor (signal) and joined the restart
    assert_restarted_in_process(results, uninterrupted, "Hang")
    assert results[1][2]["recoveries"][0]["fault_rank"] == 0


@pytest.mark.xdist_group("trainer-torch")
@pytest.mark.parametrize("kind, code, restarts", [("config", ExitCode.CONFIG_ERROR, 0), ("raise-always", 1, 1)])
def test_fallback_exits_with_the_code_for_the_launcher(tmp_path, kind, code, restarts):
    """A cause the table does not restart in place (ConfigError), or the same fault at the same step again: every
    rank exits with the fault's code, and the launcher's path (restart in place / re-create / fail) follows."""
    from support import gang

    results = gang.launch(tmp_path, env={inprocess.ENV_TEST_FAULT: f"1:5:{kind}"}, **NO_HANG)
    for _, got, report in results:
        assert got == code, report
        assert report.get("restarts") == restarts and report["final_step"] < STEPS["steps"], report
