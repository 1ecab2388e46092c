"""Table tests of the elastic policy (``kubetitan.decide.elastic``): a 3-node run that may shrink to 2 and grow back.
Every case here is an elastic run's, whichever rule decides it (a replacement that comes restarts at the same size)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kubetitan import conditions as C
from kubetitan_core.api import AttemptObservation, LlamaPretrainSpec
from kubetitan.decide import Action
from kubetitan.decide import elastic
from kubetitan.observation import Capacity, NodeObs, Observed, PodObs
from support.decide_cases import NOW, TRAINING, gang, ok_nodes, pod, policy_table_tests, rec, status


# ---- elastic (runPolicy.elastic): a 3-node run that may shrink to 2
def elastic_spec(**elastic: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({
        "resources": {"nodes": 3}, "checkpoint": {"intervalSteps": 10},
        "runPolicy": {"elastic": {"minNodes": 2, "shrinkAfterSeconds": 60, "growCheckSeconds": 120, **elastic}}})


def gang3(attempt: int = 0, over: dict[int, dict[str, Any]] | None = None) -> tuple[PodObs, ...]:
    return tuple(replace(pod(r, attempt), **(over or {}).get(r, {})) for r in range(3))


def lost_n2(ago: float) -> dict[str, NodeObs]:
    """n0, n1 Ready; n2 (rank 2's) NotReady for ``ago`` seconds."""
    return {**ok_nodes, "n2": NodeObs("n2", ready=None, not_ready_since=NOW - ago)}


CAP2, CAP3 = Capacity(schedulable=2, stable=2), Capacity(schedulable=3, stable=3)
ALL3 = ("j-a0-0", "j-a0-1", "j-a0-2")
SHRUNK = {"nodes": 2, "restarts": [rec(0, "Shrink", ago=3600)], "attempt": 1}
"""The status of a run that shrank to 2 nodes an hour ago (attempt 1 trains on 2)."""
T21 = replace(TRAINING, step=21)
"""Training past the checkpoint of step 10 at step 21 (not a checkpoint step: no save in progress)."""
PLANNED = AttemptObservation(attempt=1, grow_to=3, grow_after_step=10)
"""Attempt 1 planned to grow to 3 after a checkpoint newer than step 10."""


CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
    ("shrink-waits-for-a-replacement", elastic_spec(), status(),
     Observed(pods=gang3(), nodes=lost_n2(10), capacity=CAP2, progress=T21, now=NOW),
     Action.WAIT, C.WAITING_FOR_REPLACEMENT, None, {"requeue_after": 50.0, "rule": "shrink",
                                                    "message_has": "shrinking to 2"}),
    ("shrink-after-grace-without-replacement", elastic_spec(), status(),
     Observed(pods=gang3(), nodes=lost_n2(61), capacity=CAP2, progress=T21, now=NOW),
     Action.RESTART, C.RESIZING, "Shrink", {"nodes": 2, "delete": ALL3[:2], "force_delete": ALL3[2:],
                                           "rule": "shrink", "message_has": "from 3 to 2 nodes"}),
    ("replacement-schedulable-restarts-at-the-same-size", elastic_spec(), status(),
     Observed(pods=gang3(), nodes=lost_n2(61), capacity=CAP3, progress=T21, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"delete": ALL3[:2], "force_delete": ALL3[2:], "node_name": "n2",
                                                 "rule": "pod_failed"}),
    ("no-shrink-below-min-nodes", elastic_spec(minNodes=3), status(),
     Observed(pods=gang3(), nodes=lost_n2(61), capacity=CAP2, progress=T21, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"delete": ALL3[:2], "force_delete": ALL3[2:], "node_name": "n2",
                                                 "rule": "pod_failed"}),
    ("no-shrink-when-max-resizes-are-used-up", elastic_spec(maxResizes=1), status(resize_count=1),
     Observed(pods=gang3(), nodes=lost_n2(61), capacity=CAP2, progress=T21, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"delete": ALL3[:2], "force_delete": ALL3[2:], "node_name": "n2",
                                                 "rule": "pod_failed"}),
    ("no-shrink-sooner-than-the-admin-interval", elastic_spec(), status(restarts=[rec(0, "Grow", ago=100)],
                                                                        attempt=1, nodes=3),
     Observed(pods=gang3(1), nodes=lost_n2(61), capacity=CAP2, progress=T21, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"delete": ("j-a1-0", "j-a1-1"), "force_delete": ("j-a1-2",),
                                                 "node_name": "n2", "rule": "pod_failed"}),
    ("unplaced-pod-shrinks-after-grace", elastic_spec(), status(),
     Observed(pods=gang3(over={2: {"node_name": None, "phase": "Pending", "created": NOW - 61}}), nodes=ok_nodes,
              capacity=CAP2, now=NOW),
     Action.RESTART, C.RESIZING, "Shrink", {"nodes": 2, "delete": ALL3, "rule": "shrink",
                                           "message_has": "cannot be placed"}),
    ("no-shrink-mid-save", elastic_spec(), status(),
     Observed(pods=gang3(over={2: {"node_name": None, "phase": "Pending", "created": NOW - 61}}), nodes=ok_nodes,
              capacity=CAP2, progress=replace(TRAINING, step=20, last_checkpoint_step=10), now=NOW),
     Action.WAIT, C.WAITING_FOR_REPLACEMENT, None, {"rule": "shrink", "requeue_after": 299.0,
                                                    "message_has": "being saved"}),
    # a lost node at a checkpoint step whose save is not complete yet: neither a shrink nor (grace 0) a NodeFailure
    ("no-shrink-or-node-failure-mid-save", elastic_spec(), status(),
     Observed(pods=gang3(), nodes=lost_n2(61), capacity=CAP2, progress=replace(TRAINING, step=20), now=NOW),
     Action.WAIT, C.WAITING_FOR_REPLACEMENT, None, {"rule": "shrink", "requeue_after": 299.0,
                                                    "message_has": "being saved"}),
    ("grow-planned-once-capacity-is-stable", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=CAP3, progress=T21, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "grow_plan": (3, 10), "rule": "grow",
                                     "message_has": "right after its next complete checkpoint"}),
    ("no-grow-while-capacity-is-not-stable", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=Capacity(schedulable=3, stable=2), progress=T21, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("planned-grow-waits-for-a-newer-checkpoint", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=CAP3, progress=T21, observation=PLANNED, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "grow", "message_has": "newer than step 10"}),
    ("planned-grow-after-the-next-checkpoint", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=CAP3, progress=replace(TRAINING, step=21, last_checkpoint_step=20),
              observation=PLANNED, now=NOW),
     Action.RESTART, C.RESIZING, "Grow", {"nodes": 3, "delete": ("j-a1-0", "j-a1-1"), "rule": "grow",
                                         "message_has": "from 2 to 3 nodes"}),
    ("no-grow-mid-save", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=CAP3, progress=replace(TRAINING, step=30, last_checkpoint_step=20),
              observation=PLANNED, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "grow"}),
    ("planned-grow-called-off-when-capacity-goes", elastic_spec(), status(**SHRUNK),
     Observed(pods=gang(1), nodes=ok_nodes, capacity=CAP2, progress=T21, observation=PLANNED, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "cancel_grow": True, "rule": "grow"}),
    ("grow-waits-for-the-old-gang-to-save", elastic_spec(),
     status(nodes=3, restarts=[rec(1, "Grow", ago=1)], attempt=2),
     Observed(pods=tuple(replace(p, deleting=True) for p in gang(1)), nodes=ok_nodes, now=NOW),
     Action.WAIT, C.RESIZING, None, {"rule": "attempt_not_created", "message_has": "have saved their checkpoint"}),
    ("shrunk-run-recreates-at-its-size", elastic_spec(), status(nodes=2, restarts=[rec(0, "Shrink", ago=1)],
                                                                 attempt=1),
     Observed(now=NOW), Action.CREATE, C.CREATING, None, {"nodes": 2, "rule": "attempt_not_created",
                                                         "message_has": "the 2 pods of attempt 1"}),
]


(test_decide, test_every_decision_leads_to_a_status_that_tells_one_story,
 test_every_elastic_rule_has_a_case) = policy_table_tests(elastic, CASES)
