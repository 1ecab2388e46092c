"""Table tests of the pure restart decision, the status it leads to, and the conditions helpers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan.api import Condition, LlamaPretrainSpec, LlamaPretrainStatus, RestartRecord
from kubetitan.decide import (
    Action, NodeObs, Observed, PodObs, Progress, backoff_seconds, classify_pod, decide, iso, next_status,
    nodes_to_avoid,
)

NOW = 1_000_000.0


def spec(**run_policy: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "runPolicy": run_policy})


def status(attempt: int | None = 0, restarts: list[RestartRecord] = (), conds: list[Condition] = (),
           **kw: Any) -> LlamaPretrainStatus:
    return LlamaPretrainStatus(attempt=attempt, restarts=list(restarts), restart_count=len(restarts),
                               conditions=list(conds), start_time=iso(NOW - 100), **kw)


def pod(rank: int, attempt: int = 0, phase: str = "Running", **kw: Any) -> PodObs:
    return PodObs(name=f"j-a{attempt}-{rank}", attempt=attempt, rank=rank, phase=phase,
                  node_name=kw.pop("node_name", f"n{rank}"), created=NOW - 50, running_since=NOW - 40, **kw)


def gang(attempt: int = 0, over: dict[int, dict[str, Any]] | None = None) -> tuple[PodObs, ...]:
    return tuple(replace(pod(r, attempt), **(over or {}).get(r, {})) for r in range(2))


def rec(attempt: int, cause: str = "ContainerFailed", ago: float = 5.0, node: str | None = None,
        resumed: int = 0, lost: int | None = None) -> RestartRecord:
    return RestartRecord(attempt=attempt, cause=cause, time=iso(NOW - ago), node_name=node,
                         resumed_from_step=resumed, lost_steps=lost)


TRAINING = Progress(step=20, start_step=0, last_checkpoint_step=10, last_progress_time=NOW - 1, first_step_time=NOW - 30)
ok_nodes = {"n0": NodeObs("n0"), "n1": NodeObs("n1")}

CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, extra checks)
    ("fresh-run-creates", spec(), LlamaPretrainStatus(), Observed(now=NOW), Action.CREATE, C.CREATING, None, {}),
    ("all-running-no-step-yet", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, now=NOW),
     Action.KEEP, C.WAITING_FOR_FIRST_STEP, None, {"ready": False}),
    ("training", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
    ("exit-1-restarts", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, progress=TRAINING, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {"delete": ("j-a0-0", "j-a0-1")}),
    ("oom", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 137, "terminated_reason": "OOMKilled"}}),
              nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "OOMKilled", {}),
    ("evicted", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "reason": "Evicted"}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "Evicted", {}),
    ("preempted-by-scheduler", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 143, "disruption_reason": "PreemptionByScheduler"}}),
              nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "Preempted", {}),
    ("sigterm-checkpointed-75", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 75}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "Preempted", {}),
    ("nan-loss-3", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 3}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "NonFiniteLoss", {}),
    ("config-error-2-fails-fast", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 2, "termination_message": "bad flavour"}}),
              nodes=ok_nodes, now=NOW), Action.FAIL, C.CONFIG_ERROR, None, {"message_has": "bad flavour"}),
    ("image-pull-fails-fast", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "waiting_reason": "ErrImagePull"}}), now=NOW),
     Action.FAIL, C.IMAGE_PULL_FAILED, None, {"message_has": "spec.resources.image"}),
    ("invalid-image-name", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "waiting_reason": "InvalidImageName"}}), now=NOW),
     Action.FAIL, C.IMAGE_PULL_FAILED, None, {}),
    ("max-restarts-exhausted", spec(maxRestarts=2), status(restarts=[rec(0, lost=5), rec(1, lost=5, resumed=5)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.MAX_RESTARTS_EXCEEDED, "ContainerFailed", {"message_has": "maxRestarts=2"}),
    ("no-progress-stops-early", spec(maxRestartsWithoutProgress=2), status(restarts=[rec(0), rec(1)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.NO_PROGRESS, "ContainerFailed", {"message_has": "maxRestartsWithoutProgress"}),
    ("progress-resets-no-progress-count", spec(maxRestartsWithoutProgress=2),
     status(restarts=[rec(0), rec(1, lost=7)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {}),
    ("backoff-waits", spec(backoffSeconds=10), status(restarts=[rec(0, ago=3)], attempt=1), Observed(now=NOW),
     Action.WAIT, C.BACKOFF, None, {"requeue_after": 7.0}),
    ("backoff-elapsed-creates", spec(backoffSeconds=10), status(restarts=[rec(0, ago=11)], attempt=1),
     Observed(now=NOW), Action.CREATE, C.CREATING, None, {}),
    ("node-failed-twice-avoided", spec(), status(restarts=[rec(0, "NodeFailure", ago=99, node="bad"),
                                                           rec(1, "NodeFailure", ago=99, node="bad")],
                                                 attempt=2), Observed(now=NOW),
     Action.CREATE, C.CREATING, None, {"avoid_nodes": ("bad",)}),
    ("containers-crashing-twice-on-a-node-do-not-exclude-it", spec(),
     status(restarts=[rec(0, ago=99, node="n0"), rec(1, "OOMKilled", ago=99, node="n0")], attempt=2),
     Observed(now=NOW), Action.CREATE, C.CREATING, None, {"avoid_nodes": ()}),
    ("unschedulable-within-limit-waits", spec(unschedulableTimeoutSeconds=100), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes"}}), now=NOW),
     Action.WAIT, C.WAITING_FOR_PODS, None, {"unschedulable": False}),
    ("unschedulable-timeout-wait", spec(unschedulableTimeoutSeconds=10), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes"}}), now=NOW),
     Action.WAIT, C.PODS_UNSCHEDULABLE, None, {"unschedulable": True}),
    ("unschedulable-timeout-fail", spec(unschedulableTimeoutSeconds=10, unschedulableAction="Fail"), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes"}}), now=NOW),
     Action.FAIL, C.UNSCHEDULABLE_TIMEOUT, None, {"unschedulable": True}),
    ("hang", spec(hangTimeoutSeconds=60), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 61), now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {}),
    ("startup-timeout", spec(startupTimeoutSeconds=30), status(),
     Observed(pods=gang(), nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "StartupTimeout", {}),
    ("node-not-ready-in-grace-waits", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=None, not_ready_since=NOW - 10)},
              now=NOW), Action.WAIT, C.WAITING_FOR_PODS, None, {"requeue_after": 50.0}),
    ("node-not-ready-past-grace-force-deletes", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=False, not_ready_since=NOW - 61)},
              now=NOW), Action.RESTART, C.RESTARTED, "NodeFailure",
     {"force_delete": ("j-a0-1",), "delete": ("j-a0-0",), "node_name": "n1"}),
    ("node-missing", spec(nodeFailureGraceSeconds=0), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False)}, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"force_delete": ("j-a0-1",)}),
    ("pod-vanished-while-running", spec(), status(), Observed(pods=gang()[:1], nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "Unknown", {}),
    ("pod-missing-while-pending-creates", spec(), status(),
     Observed(pods=(replace(pod(0, phase="Pending"), created=NOW - 1),), now=NOW), Action.CREATE, C.CREATING, None, {}),
    ("rank0-exit-0-succeeds", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, now=NOW),
     Action.SUCCEED, C.COMPLETED, None, {"delete": ("j-a0-1",)}),
    ("worker-exit-0-is-not-failure", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, progress=TRAINING, now=NOW),
     Action.KEEP, C.WAITING_FOR_PODS, None, {}),
    ("suspend-deletes-gracefully", spec(suspend=True), status(), Observed(pods=gang(), nodes=ok_nodes, now=NOW),
     Action.SUSPEND, C.SUSPENDING, None, {"delete": ("j-a0-0", "j-a0-1"), "force_delete": (), "ends_attempt": True}),
    ("previous-attempt-deleted", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=gang(0) + gang(1), nodes=ok_nodes, progress=TRAINING, now=NOW), Action.KEEP, C.TRAINING, None,
     {"delete": ("j-a0-0", "j-a0-1")}),
    ("deadline-exceeded", spec(activeDeadlineSeconds=50), status(), Observed(pods=gang(), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.DEADLINE_EXCEEDED, None, {"delete": ("j-a0-0", "j-a0-1")}),
    ("finished-ttl-deletes-run", spec(ttlSecondsAfterFinished=10),
     status(conds=[Condition(type="Succeeded", status="True", reason="Completed")], completion_time=iso(NOW - 11)),
     Observed(now=NOW), Action.FINISHED, "", None, {"delete_self": True}),
    ("spec-change-blocks-next-attempt", spec(), status(restarts=[rec(0, ago=99)], attempt=1),
     Observed(now=NOW, spec_block="changing model.flavor ..."), Action.WAIT, C.IMMUTABLE_FIELD_CHANGED, None, {}),
]


@pytest.mark.parametrize(("spec_", "status_", "obs", "action", "reason", "cause", "extra"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(spec_, status_, obs, action, reason, cause, extra) -> None:
    d = decide(spec_, status_, obs)
    assert (d.action, d.reason, d.cause) == (action, reason, cause), d.message
    for key, want in extra.items():
        if key == "message_has":
            assert want in d.message
        else:
            assert getattr(d, key) == want, key


@pytest.mark.parametrize(("records", "want"), [
    ([rec(0)], 10.0),
    ([rec(0), rec(1)], 20.0),
    ([rec(0), rec(1), rec(2)], 40.0),
    ([rec(0), rec(1, lost=3), rec(2)], 10.0),
    ([rec(i) for i in range(12)], 600.0),
], ids=["first", "second-no-progress", "third", "progress-resets", "capped"])
def test_backoff_doubles_and_caps(records, want) -> None:
    assert backoff_seconds(spec(backoffSeconds=10, maxBackoffSeconds=600), records) == want


def test_nodes_failed_twice_are_avoided() -> None:
    assert nodes_to_avoid([rec(0, "NodeFailure", node="a"), rec(1, "NodeFailure", node="b"),
                           rec(2, "NodeFailure", node="a"), rec(3, node="b"), rec(4, "Hang", node="b")]) == ("a",)


@pytest.mark.parametrize(("p", "want"), [
    (pod(0, phase="Running"), None),
    (pod(0, phase="Failed", exit_code=137), "ContainerFailed"),
    (pod(0, phase="Failed", exit_code=143, disruption_reason="DeletionByTaintManager"), "NodeFailure"),
    (pod(0, phase="Pending", waiting_reason="CreateContainerConfigError"), "fatal"),
], ids=["running", "sigkill", "taint-manager", "container-config-error"])
def test_classify_pod(p, want) -> None:
    f = classify_pod(p)
    assert (None if f is None else f.cause or "fatal") == want


def test_restart_status_records_history_and_conditions() -> None:
    s = spec()
    st = status()
    obs = Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, progress=TRAINING,
                   now=NOW, generation=3)
    new = next_status(s, st, decide(s, st, obs), obs)
    assert (new.attempt, new.restart_count, new.phase) == (1, 1, "Restarting")
    r = new.restarts[0]
    assert (r.attempt, r.cause, r.resumed_from_step, r.lost_steps) == (0, "ContainerFailed", 10, 10)
    assert C.is_true(new.conditions, C.RESTARTING) and not C.is_true(new.conditions, C.READY)
    assert all(c.observed_generation == 3 for c in new.conditions)
    # next attempt trains: Restarting flips off, downtime is filled from the first step
    obs2 = Observed(pods=gang(1), nodes=ok_nodes, now=NOW + 20, generation=3,
                    progress=Progress(step=11, start_step=10, last_progress_time=NOW + 19, first_step_time=NOW + 15))
    newer = next_status(s, new, decide(s, new, obs2), obs2)
    assert newer.phase == "Running" and not C.is_true(newer.conditions, C.RESTARTING)
    assert newer.restarts[0].downtime_seconds == 15.0
    assert (newer.restarts[0].resumed_from_step, newer.restarts[0].lost_steps) == (10, 10)  # as guessed


def test_restart_record_takes_the_step_the_next_attempt_really_resumed_from() -> None:
    """A save that completed after the operator's last scrape: the next attempt loads it, so fewer steps
    were lost than the record guessed when it was written."""
    s = spec()
    obs = Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 137}}), nodes=ok_nodes, now=NOW,
                   progress=Progress(step=20, last_checkpoint_step=10, last_progress_time=NOW - 1))
    new = next_status(s, status(), decide(s, status(), obs), obs)
    assert (new.restarts[0].resumed_from_step, new.restarts[0].lost_steps) == (10, 10)
    obs2 = Observed(pods=gang(1), nodes=ok_nodes, now=NOW + 20,
                    progress=Progress(step=21, start_step=20, last_progress_time=NOW + 19, first_step_time=NOW + 18))
    newer = next_status(s, new, decide(s, new, obs2), obs2)
    r = newer.restarts[0]
    assert (r.resumed_from_step, r.lost_steps, r.downtime_seconds) == (20, 0, 18.0)
    # written once: a later cycle does not move it again
    obs3 = Observed(pods=gang(1), nodes=ok_nodes, now=NOW + 30,
                    progress=Progress(step=25, start_step=20, last_progress_time=NOW + 29, first_step_time=NOW + 18))
    assert next_status(s, newer, decide(s, newer, obs3), obs3).restarts[0] == r


@pytest.mark.parametrize(("old_status", "new_status", "reason", "changed", "keeps_time"), [
    (None, "True", "A", True, False),
    ("True", "True", "A", False, True),
    ("True", "True", "B", True, True),
    ("True", "False", "A", True, False),
], ids=["new", "same", "reason-only", "flip"])
def test_set_condition_keeps_transition_time_unless_status_flips(old_status, new_status, reason, changed,
                                                                  keeps_time) -> None:
    conds = [] if old_status is None else [Condition(type="Ready", status=old_status, reason="A", message="m",
                                                     last_transition_time="T0", observed_generation=1)]
    assert C.set_condition(conds, "Ready", new_status, reason, "m", "T1", 1) is changed
    assert conds[0].last_transition_time == ("T0" if keeps_time else "T1")


@pytest.mark.parametrize(("true_types", "exists", "phase"), [
    ((), False, "Pending"), ((), True, "Starting"), ((C.READY,), True, "Running"),
    ((C.RESTARTING,), True, "Restarting"), ((C.SUSPENDED, C.RESTARTING), True, "Suspended"),
    ((C.SUCCEEDED, C.READY), True, "Succeeded"), ((C.FAILED,), False, "Failed"),
], ids=["pending", "starting", "running", "restarting", "suspended-wins", "succeeded", "failed"])
def test_derive_phase(true_types, exists, phase) -> None:
    conds = [Condition(type=t, status="True", reason="R") for t in true_types]
    assert C.derive_phase(conds, exists) == phase
