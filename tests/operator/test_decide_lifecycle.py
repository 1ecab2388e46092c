"""Table tests of the lifecycle policy (``kubetitan.decide.lifecycle``): a stale status, a finished run, the deadline,
suspension, success and a steps count changed mid-attempt, creating an attempt (backoff, size, missing ranks, refused
children), unschedulable pods, and the PodGroups of ended attempts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan_core.api import Condition, LlamaPretrainStatus, TrainingStatus
from kubetitan.decide import Action, decide
from kubetitan.decide import lifecycle
from kubetitan.observation import ChildError, NodeObs, Observed, PodObs
from kubetitan.observation import tracking as T
from kubetitan.timestamps import iso
from kubetitan import status as S
from support.runs import condition
from support.decide_cases import (NOW, RESTART_ALL, SEEN, TRAINING, gang, ok_nodes, policy_table_tests, rec, spec,
                                  status, steps_spec)


def test_child_refused_sets_children_created_false_without_flapping() -> None:
    s, st = spec(), status()
    err = (ChildError("Pod", "j-a0-1", C.FORBIDDEN, 'pods "j-a0-1" is forbidden: exceeded quota'),)
    o = T.track(None, 0, NOW, pods=gang()[:1])
    obs = T.observed(o, pods=gang()[:1], nodes=ok_nodes, now=NOW, child_errors=err)
    new = S.next_status(s, st, decide(s, st, obs), obs)
    assert condition(new, C.CHILDREN_CREATED) == ("False", C.FORBIDDEN)
    assert "exceeded quota" in C.find(new.conditions, C.CHILDREN_CREATED).message
    again = S.next_status(s, new, decide(s, new, obs), replace(obs, now=NOW + 30))
    assert again.phase == new.phase == "Pending" and again.restart_count == 0  # Starting: every pod exists
    assert C.find(again.conditions, C.CHILDREN_CREATED).last_transition_time == \
        C.find(new.conditions, C.CHILDREN_CREATED).last_transition_time


def _timed_out() -> ChildError:
    """The ChildError a pod create that got no answer leaves (built as ``reconcile.apply`` builds it)."""
    from kubetitan.kube import RequestTimeout, classify, message_of

    e = RequestTimeout("POST", "/api/v1/namespaces/ml/pods", 30.0, attempts=6)
    return ChildError("Pod", "j-a0-1", classify(e), message_of(e))


@pytest.mark.parametrize(("case", "reason", "want", "never"), [
    ("refused", "Forbidden", 'the API refused Pod j-a0-1: pods "j-a0-1" is forbidden: exceeded quota', "timed out"),
    ("timed-out", "APITimeout",
     "the create of Pod j-a0-1 timed out: no answer within 30 s on each of 6 attempts (the API server, or an "
     "admission webhook it calls, is slow or unreachable", "refused"),
], ids=["refused", "timed-out"])
def test_a_create_error_is_told_as_what_it_was_in_the_status_the_decision_and_the_event(
        case: str, reason: str, want: str, never: str) -> None:
    """A refusal is the API's answer; a timeout is no answer, said with its seconds: the ChildrenCreated condition,
    the decision's message and the FailedCreate Event's all tell it the same way."""
    from kubetitan.reconcile.report import refusal_summary

    err = _timed_out() if case == "timed-out" else \
        ChildError("Pod", "j-a0-1", C.FORBIDDEN, 'pods "j-a0-1" is forbidden: exceeded quota')
    s, st = spec(), status()
    o = T.track(None, 0, NOW, pods=gang()[:1])
    obs = T.observed(o, pods=gang()[:1], nodes=ok_nodes, now=NOW, child_errors=(err,))
    d = decide(s, st, obs)
    cond = C.find(S.next_status(s, st, d, obs).conditions, C.CHILDREN_CREATED)
    event = refusal_summary([err], 1, 0, 0)
    assert (cond.status, cond.reason) == ("False", reason)
    for text in (cond.message, d.message):
        assert want in text and never not in text, text
    told, said = want.split(": ", 1)  # the Event puts the reason before the message
    assert event.startswith(f"1 pod(s) of attempt 0 are not created: {told}: {reason}: {said}") and never not in event, \
        event


def test_raised_steps_start_the_next_attempt_without_a_restart() -> None:
    """Rank 0 exited 0 at the attempt's 100 steps, the spec now says 150: the status moves to attempt 1 with no
    restart record (nothing failed), Ready=False/StepsRaised, the run not Succeeded; the next cycle creates attempt
    1 at once (no restart backoff); its own success at 150 then ends the run."""
    s, st = steps_spec(150), status(training=TrainingStatus(step=100))
    done = gang(over={0: {"phase": "Succeeded", "exit_code": 0}, 1: {"phase": "Succeeded", "exit_code": 0}})
    o = T.track(None, 0, NOW, pods=done)
    obs = T.observed(o, pods=done, nodes=ok_nodes, now=NOW, attempt_steps=100)
    d = decide(s, st, obs)
    new = S.next_status(s, st, d, obs)
    assert d.action == Action.CONTINUE and new.attempt == 1 and new.restart_count == 0 and not new.restarts
    assert condition(new, C.READY) == ("False", C.STEPS_RAISED) and condition(new, C.SUCCEEDED) == ("False", C.NOT_FINISHED)
    assert new.phase == "Pending" and new.completion_time is None and new.observation.attempt == 1
    assert new.training.progress == "100/150"
    # the next cycle: attempt 0's pods still go, attempt 1 is created now (no backoff: no restart record)
    obs2 = T.observed(T.track(new.observation, 1, NOW + 1, pods=done), pods=done, nodes=ok_nodes, now=NOW + 1)
    d2 = decide(s, new, obs2)
    assert d2.action == Action.CREATE and d2.delete == ("j-a0-0", "j-a0-1") and d2.rule == "attempt_not_created", d2
    # attempt 1 (created from the raised spec) reaches 150: Succeeded
    fin = gang(1, over={0: {"phase": "Succeeded", "exit_code": 0}})
    obs3 = T.observed(T.track(new.observation, 1, NOW + 60, pods=fin), pods=fin, nodes=ok_nodes, now=NOW + 60,
                      attempt_steps=150)
    d3 = decide(s, new, obs3)
    assert d3.action == Action.SUCCEED and "reached step 150" in d3.message
    assert S.next_status(s, new, d3, obs3).phase == "Succeeded"


# ---- the PodGroups of ended attempts (plan.uses_pod_group): deleted with their pods, never a live attempt's
def grouped(attempt: int = 0, over: dict[int, dict[str, Any]] | None = None) -> tuple[PodObs, ...]:
    """``gang`` whose pods name their attempt's PodGroup ``j-a<attempt>``."""
    return tuple(replace(p, pod_group=f"j-a{attempt}") for p in gang(attempt, over))


POD_GROUP_CASES = [
    ("training", spec(), status(), Observed(pods=grouped(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN,
                                             now=NOW), ()),
    ("restart", spec(), status(), Observed(pods=grouped(over={1: {"phase": "Failed", "exit_code": 1}}),
                                           nodes=ok_nodes, progress=TRAINING, now=NOW), ("j-a0",)),
    ("earlier-attempt", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=grouped(0) + grouped(1), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW), ("j-a0",)),
    ("earlier-attempt-terminating", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=tuple(replace(p, deleting=True) for p in grouped(0)) + grouped(1), nodes=ok_nodes,
              progress=TRAINING, ranks_seen=SEEN, now=NOW), ("j-a0",)),
    ("suspend", spec(suspend=True), status(), Observed(pods=grouped(), nodes=ok_nodes, now=NOW), ("j-a0",)),
    ("failed-run", spec(activeDeadlineSeconds=50), status(), Observed(pods=grouped(), nodes=ok_nodes, now=NOW),
     ("j-a0",)),
    ("one-rank-lost-the-gang-waits", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=grouped(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=None, not_ready_since=NOW - 10)},
              progress=TRAINING, ranks_seen=SEEN, now=NOW), ()),
    ("no-pod-group", spec(), status(), Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}),
                                                nodes=ok_nodes, progress=TRAINING, now=NOW), ()),
]


@pytest.mark.parametrize(("spec_", "status_", "obs", "want"), [c[1:] for c in POD_GROUP_CASES],
                         ids=[c[0] for c in POD_GROUP_CASES])
def test_the_pod_groups_of_ended_attempts_are_deleted(spec_, status_, obs, want) -> None:
    """A PodGroup goes when its attempt ends (restart, suspension, the run's end) or is an earlier attempt's, and
    never while its attempt goes on: a rank created again would name a PodGroup that is gone and never be
    scheduled."""
    assert decide(spec_, status_, obs).delete_pod_groups == want


CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
    ("fresh-run-creates", spec(), LlamaPretrainStatus(), Observed(now=NOW), Action.CREATE, C.CREATING, None,
     {"rule": "attempt_not_created"}),
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
    ("gpu-fault-once-avoids-the-node", spec(), status(restarts=[rec(0, "GPUXidError", ago=99, node="gpu-bad")],
                                                      attempt=1), Observed(now=NOW),
     Action.CREATE, C.CREATING, None, {"avoid_nodes": ("gpu-bad",)}),
    ("preflight-failure-once-avoids-the-node", spec(),
     status(restarts=[rec(0, "PreflightFailed", ago=99, node="gpu-bad")], attempt=1), Observed(now=NOW),
     Action.CREATE, C.CREATING, None, {"avoid_nodes": ("gpu-bad",)}),
    ("create-refused-reports-and-retries-no-restart", spec(), status(),
     Observed(pods=gang()[:1], nodes=ok_nodes, ranks_seen=frozenset({0}), now=NOW,
              child_errors=(ChildError("Pod", "j-a0-1", C.FORBIDDEN, "exceeded quota: gpu"),)),
     Action.CREATE, C.CREATING, None, {"message_has": "exceeded quota: gpu", "rule": "ranks_missing"}),
    ("unschedulable-within-limit-waits", spec(unschedulableTimeoutSeconds=100), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes", "node_name": None}}),
              now=NOW), Action.WAIT, C.WAITING_FOR_NODES, None, {"requeue_after": 50.0, "rule": "unschedulable"}),
    ("unschedulable-timeout-wait", spec(unschedulableTimeoutSeconds=10), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes"}}), now=NOW),
     Action.WAIT, C.PODS_UNSCHEDULABLE, None, {"unschedulable": True}),
    ("unschedulable-timeout-fail", spec(unschedulableTimeoutSeconds=10, unschedulableAction="Fail"), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "unschedulable_message": "0/4 nodes"}}), now=NOW),
     Action.FAIL, C.UNSCHEDULABLE_TIMEOUT, None, {"unschedulable": True, **RESTART_ALL}),
    ("missing-service-while-waiting-for-pods-is-recreated", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Pending", "node_name": None,
                                  "unschedulable_message": "0/3 nodes are available"}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW, missing_children=("j",)),
     Action.WAIT, C.WAITING_FOR_NODES, None, {"recreate": ("j",), "requeue_after": 850.0, "rule": "unschedulable"}),
    ("pod-never-seen-is-created-not-restarted", spec(), status(),
     Observed(pods=gang()[:1], nodes=ok_nodes, ranks_seen=frozenset({0}), now=NOW), Action.CREATE, C.CREATING, None,
     {"rule": "ranks_missing"}),
    ("rank0-exit-0-succeeds", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, now=NOW),
     Action.SUCCEED, C.COMPLETED, None, {"delete": ("j-a0-1",), "rule": "rank0_succeeded"}),
    # ---- spec.training.steps changed while the attempt ran (its trainer has the count it was created with)
    ("steps-raised-while-running-continues-in-a-new-attempt", steps_spec(150), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, progress=TRAINING,
              ranks_seen=SEEN, now=NOW, attempt_steps=100), Action.CONTINUE, C.STEPS_RAISED, None,
     {**RESTART_ALL, "ends_attempt": True, "rule": "steps_raised", "message_has": "raised to 150"}),
    ("steps-raised-after-the-attempt-finished-on-rank-1-too", steps_spec(150), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}, 1: {"phase": "Succeeded", "exit_code": 0,
                                                                          "deleting": True}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW, attempt_steps=100), Action.CONTINUE, C.STEPS_RAISED, None,
     {"delete": ("j-a0-0",), "ends_attempt": True}),
    ("steps-unchanged-succeeds", steps_spec(100), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW,
              attempt_steps=100), Action.SUCCEED, C.COMPLETED, None,
     {"delete": ("j-a0-1",), "rule": "rank0_succeeded", "message_has": "reached step 100"}),
    ("steps-lowered-while-running-succeeds-at-the-attempts-count", steps_spec(50), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW,
              attempt_steps=100), Action.SUCCEED, C.COMPLETED, None,
     {"delete": ("j-a0-1",), "rule": "rank0_succeeded", "message_has": "lowered to 50 while the attempt ran with 100"}),
    ("steps-lowered-below-a-saved-checkpoint-succeeds-and-stops-the-pods", steps_spec(10), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW, attempt_steps=100),
     Action.SUCCEED, C.COMPLETED, None,
     {**RESTART_ALL, "rule": "lowered_steps_reached", "message_has": "step 10 (checkpoint saved)"}),
    ("suspend-deletes-gracefully", spec(suspend=True), status(), Observed(pods=gang(), nodes=ok_nodes, now=NOW),
     Action.SUSPEND, C.SUSPENDING, None, {**RESTART_ALL, "force_delete": (), "ends_attempt": True,
                                          "rule": "suspended"}),
    # the run trained its last step before the suspension reached it (hog loop s13): done, not suspended
    ("suspend-after-rank0-finished-succeeds", spec(suspend=True), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, now=NOW),
     Action.SUCCEED, C.COMPLETED, None, {"delete": ("j-a0-1",), "rule": "rank0_succeeded"}),
    # ... but with spec.training.steps raised since, the run is not done: the suspension stands
    ("suspend-after-rank0-finished-fewer-steps-suspends", steps_spec(150, suspend=True), status(),
     Observed(pods=gang(over={0: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, now=NOW,
              attempt_steps=100),
     Action.SUSPEND, C.SUSPENDING, None, {**RESTART_ALL, "force_delete": (), "ends_attempt": True,
                                          "rule": "suspended"}),
    ("newer-attempt-pods-are-never-deleted", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=gang(1) + gang(2), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.WAIT, C.STALE_STATUS, None, {"stale_status": True, "requeue_after": 0.0, "rule": "status_behind_cluster"}),
    ("deadline-exceeded", spec(activeDeadlineSeconds=50), status(), Observed(pods=gang(), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.DEADLINE_EXCEEDED, None, {**RESTART_ALL, "rule": "deadline_exceeded"}),
    ("finished-ttl-deletes-run", spec(ttlSecondsAfterFinished=10),
     status(conds=[Condition(type="Succeeded", status="True", reason="Completed")], completion_time=iso(NOW - 11)),
     Observed(now=NOW), Action.FINISHED, "", None, {"delete_self": True, "rule": "finished"}),
    ("finished-cleanup-none-keeps-pods", spec(cleanupPolicy="None"),
     status(conds=[Condition(type="Failed", status="True", reason="MaxRestartsExceeded")], completion_time=iso(NOW)),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), now=NOW), Action.FINISHED, "", None, {}),
    ("spec-change-blocks-next-attempt", spec(), status(restarts=[rec(0, ago=99)], attempt=1),
     Observed(now=NOW, spec_block="changing model.flavor ..."), Action.WAIT, C.RESTART_BLOCKED, None,
     {"message_has": "attempt 1 cannot start: changing model.flavor"}),
]


(test_decide, test_every_decision_leads_to_a_status_that_tells_one_story,
 test_every_lifecycle_rule_has_a_case) = policy_table_tests(lifecycle, CASES)
