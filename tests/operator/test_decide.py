"""Table tests of the pure restart decision (each rule of ``decide.RULES``), the status it leads to
(``kubetitan.status``), and the conditions helpers.

Each case is (id, spec, status, observed, want): ``want`` is the whole Decision as a dict (every field but
the message, which ``message_has`` checks), built from the Decision defaults plus what the case names, so a
rule that starts deleting, forcing or requeueing something else fails the diff."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan_core import contract
from kubetitan_core.api import AttemptObservation, Condition, LlamaPretrainSpec, LlamaPretrainStatus, RestartRecord, TrainingStatus
from kubetitan.decide import RULES, Action, Decision, backoff_seconds, classify_pod, decide, nodes_to_avoid
from kubetitan.observation import Capacity, ChildError, NodeObs, Observed, PodObs, Progress
from kubetitan.observation import tracking as T
from kubetitan.timestamps import iso, iso_ms
from kubetitan.status import next_status
from support.runs import condition

NOW = 1_000_000.0


def spec(**run_policy: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "runPolicy": run_policy})


def steps_spec(steps: int, **run_policy: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "training": {"steps": steps},
                                             "runPolicy": run_policy})


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


def ip_rec(generation: int, node: str, ago: float = 50.0, attempt: int = 0) -> RestartRecord:
    return RestartRecord(attempt=attempt, mode="InPlace", generation=generation, cause="ContainerFailed",
                         time=iso(NOW - ago), node_name=node, resumed_from_step=10, lost_steps=4, downtime_seconds=2.0)


TRAINING = Progress(step=20, start_step=0, last_checkpoint_step=10, last_progress_time=NOW - 1, first_step_time=NOW - 30,
                    metrics_available=True, metrics_ok_time=NOW)
IN_PLACE = Progress(step=12, start_step=10, last_checkpoint_step=10, last_progress_time=NOW - 1, first_step_time=NOW - 2,
                    metrics_available=True, metrics_ok_time=NOW, generation=1, generation_start_time=NOW - 5,
                    previous_generation_step=14, restart_exit_code=137, restart_node_rank=1)
"""Rank 0's workers of generation 1 train (rank 1's worker was SIGKILLed at step 14; resumed from 10)."""
SCRAPED_NO_STEP = Progress(metrics_available=True, metrics_ok_time=NOW)
UNREACHABLE = Progress(metrics_available=False, metrics_error="GET http://10.0.0.1:9090/metrics timed out")
SEEN = frozenset({0, 1})
ok_nodes = {"n0": NodeObs("n0"), "n1": NodeObs("n1")}

RESTART_ALL = {"delete": ("j-a0-0", "j-a0-1")}


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
ELASTIC_CASES = [
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
XID_79 = ("[kubetitan] GPUXidError: Xid 79 (GPU has fallen off the bus) (worker local rank 3, exit code 1); not "
          "restarted in place: RuntimeError: CUDA error: unknown error")
"""The termination message a launcher writes for a worker whose failure report showed Xid 79 (``launch.failures.report_detected``;
tests/trainer/test_launch_causes.py checks that the launcher writes this shape)."""
PREFLIGHT_N1 = ("PreflightFailed: node n1 failed the pre-flight gate: matmul_tflops: cuda:3 301.5 TF/s < 495 TF/s, the "
                "H100 floor (50% of its 989.4 TF/s dense bf16 peak)")
"""The termination message a launcher writes when its pod's pre-flight gate failed (``launch.gate.finish``;
tests/trainer/test_preflight.py checks that the launcher writes this shape)."""
CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
    ("fresh-run-creates", spec(), LlamaPretrainStatus(), Observed(now=NOW), Action.CREATE, C.CREATING, None,
     {"rule": "attempt_not_created"}),
    ("all-running-no-step-yet", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.WAITING_FOR_FIRST_STEP, None, {"ready": False, "rule": "running"}),
    ("training", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("exit-1-restarts", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, progress=TRAINING, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {**RESTART_ALL, "node_name": "n1", "rule": "pod_failed"}),
    ("exit-6-retryable-restarts", spec(), status(),  # contract.ExitCode.RETRYABLE: a transient failure
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 6}}), nodes=ok_nodes, progress=TRAINING, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {**RESTART_ALL, "node_name": "n0", "rule": "pod_failed"}),
    ("oom", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 137, "terminated_reason": "OOMKilled"}}),
              nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "OOMKilled", {**RESTART_ALL, "node_name": "n0"}),
    ("evicted", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "reason": "Evicted"}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "Evicted", {**RESTART_ALL, "node_name": "n0"}),
    ("preempted-by-scheduler", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 143, "disruption_reason": "PreemptionByScheduler"}}),
              nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "Preempted", {**RESTART_ALL, "node_name": "n0"}),
    ("pod-gc-is-node-failure", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Running", "deleting": True, "disruption_reason": "DeletionByPodGC"}}),
              nodes=ok_nodes, now=NOW), Action.RESTART, C.RESTARTED, "NodeFailure",
     {"delete": ("j-a0-0",), "node_name": "n1"}),
    ("taint-manager-disruption-is-node-failure-before-exit", spec(), status(),
     Observed(pods=gang(over={0: {"disruption_reason": "DeletionByTaintManager"}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"delete": ("j-a0-1",), "force_delete": ("j-a0-0",),
                                                  "node_name": "n0"}),
    ("sigterm-checkpointed-75", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 75}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "Preempted", {**RESTART_ALL, "node_name": "n0"}),
    ("nan-loss-3", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 3}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "NonFiniteLoss", {**RESTART_ALL, "node_name": "n1"}),
    ("config-error-2-fails-fast-keeps-failed-pod", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 2, "termination_message": "bad flavour"}}),
              nodes=ok_nodes, now=NOW), Action.FAIL, C.CONFIG_ERROR, None,
     {"message_has": "bad flavour", "delete": ("j-a0-1",), "node_name": "n0"}),
    ("storage-full-4-fails-without-restart", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 4}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.STORAGE_FULL, None, {"message_has": "free space", "delete": ("j-a0-1",), "node_name": "n0"}),
    ("network-not-efa-5-fails-without-restart", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 5}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.NETWORK_NOT_EFA, None, {"message_has": "networkFallback", "delete": ("j-a0-1",),
                                            "node_name": "n0"}),
    ("image-pull-fails-fast", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "waiting_reason": "ErrImagePull"}}), now=NOW),
     Action.FAIL, C.IMAGE_PULL_FAILED, None, {"message_has": "spec.resources.image", **RESTART_ALL,
                                              "node_name": "n0"}),
    ("invalid-image-name", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Pending", "waiting_reason": "InvalidImageName"}}), now=NOW),
     Action.FAIL, C.IMAGE_PULL_FAILED, None, {**RESTART_ALL, "node_name": "n0"}),
    ("max-restarts-exhausted-keeps-failed-pod", spec(maxRestarts=2),
     status(restarts=[rec(0, lost=5), rec(1, lost=5, resumed=5)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.MAX_RESTARTS_EXCEEDED, "ContainerFailed",
     {"message_has": "maxRestarts=2", "delete": ("j-a2-0",), "node_name": "n1"}),
    ("cleanup-none-keeps-every-pod-on-failure", spec(maxRestarts=0, cleanupPolicy="None"), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.MAX_RESTARTS_EXCEEDED, "ContainerFailed", {"delete": (), "node_name": "n1"}),
    ("no-progress-stops-early", spec(maxRestartsWithoutProgress=2), status(restarts=[rec(0), rec(1)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.FAIL, C.NO_PROGRESS, "ContainerFailed",
     {"message_has": "maxRestartsWithoutProgress", "delete": ("j-a2-0",), "node_name": "n1"}),
    ("progress-resets-no-progress-count", spec(maxRestartsWithoutProgress=2),
     status(restarts=[rec(0), rec(1, lost=7)], attempt=2),
     Observed(pods=gang(2, over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {"delete": ("j-a2-0", "j-a2-1"), "node_name": "n1"}),
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
    # GPUXidError (kubetitan_core.causes): the Xid its launcher wrote into the termination message; the gang is
    # re-created and the node is avoided from the next attempt on (once is enough: avoid_node_after=1)
    ("gpu-xid-79-in-termination-message-recreates", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1, "termination_message": XID_79}}),
              nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "GPUXidError", {**RESTART_ALL, "node_name": "n1", "rule": "pod_failed",
                                                  "message_has": "Xid 79 (GPU has fallen off the bus)"}),
    ("gpu-fault-is-not-restarted-in-place-even-with-in-place-on", spec(maxInPlaceRestarts=3), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 134, "termination_message":
                                  "RuntimeError: CUDA error: uncorrectable ECC error encountered"}}),
              nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "GPUXidError", {**RESTART_ALL, "node_name": "n0", "rule": "pod_failed"}),
    ("application-xid-13-is-a-container-failure", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1, "termination_message":
                                  "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics Exception"}}),
              nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {**RESTART_ALL, "node_name": "n1", "rule": "pod_failed"}),
    ("config-error-beats-an-xid-in-its-message", spec(), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 2, "termination_message": XID_79}}),
              nodes=ok_nodes, now=NOW), Action.FAIL, C.CONFIG_ERROR, None, {"delete": ("j-a0-1",), "node_name": "n0"}),
    ("gpu-fault-once-avoids-the-node", spec(), status(restarts=[rec(0, "GPUXidError", ago=99, node="gpu-bad")],
                                                      attempt=1), Observed(now=NOW),
     Action.CREATE, C.CREATING, None, {"avoid_nodes": ("gpu-bad",)}),
    # PreflightFailed (kubetitan_core.causes): a pod's launcher found its node unfit before any worker started (exit 8,
    # the termination message naming the node and the check); the gang is re-created without the node at once
    ("preflight-failed-8-recreates-blaming-the-node", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 8, "termination_message": PREFLIGHT_N1}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "PreflightFailed", {**RESTART_ALL, "node_name": "n1", "rule": "pod_failed",
                                                      "message_has": "(pre-flight gate failed): PreflightFailed: node "
                                                                     "n1 failed the pre-flight gate: matmul_tflops"}),
    ("preflight-failed-is-not-restarted-in-place", spec(maxInPlaceRestarts=3), status(),
     Observed(pods=gang(over={0: {"phase": "Failed", "exit_code": 8}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "PreflightFailed", {**RESTART_ALL, "node_name": "n0", "rule": "pod_failed"}),
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
    ("hang", spec(hangTimeoutSeconds=60, maxInPlaceRestarts=0), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 61), now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "rule": "hung"}),
    ("hang-timer-stops-while-metrics-unreachable", spec(hangTimeoutSeconds=60), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 600,
                                                            metrics_available=False, metrics_ok_time=NOW - 599),
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.PROGRESS_UNKNOWN, None,
     {"ready": False, "rule": "running", "message_has": "last known step 20"}),
    ("hang-measured-to-the-last-answering-scrape", spec(hangTimeoutSeconds=60), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 600,
                                                            metrics_ok_time=NOW - 590),
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.TRAINING, None, {"ready": True}),
    ("startup-timeout-with-metrics-answering", spec(startupTimeoutSeconds=30), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=SCRAPED_NO_STEP, now=NOW), Action.RESTART, C.RESTARTED,
     "StartupTimeout", {**RESTART_ALL, "rule": "startup_timed_out"}),
    ("no-startup-timeout-while-metrics-unreachable", spec(startupTimeoutSeconds=30), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=UNREACHABLE, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.PROGRESS_UNKNOWN, None, {"ready": False}),  # 40 s running, never answered: not "Starting"
    ("metrics-unreachable-within-the-startup-timeout", spec(startupTimeoutSeconds=100), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=UNREACHABLE, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.METRICS_UNAVAILABLE, None, {"requeue_after": 60.0}),
    ("no-startup-timeout-before-any-scrape", spec(startupTimeoutSeconds=30), status(),
     Observed(pods=gang(), nodes=ok_nodes, ranks_seen=SEEN, now=NOW), Action.KEEP, C.WAITING_FOR_FIRST_STEP, None, {}),
    ("pending-on-a-node-reports-kubelet-reason", spec(startupTimeoutSeconds=100), status(),
     Observed(pods=gang(over={1: {"phase": "Pending", "waiting_reason": "ContainerCreating", "scheduled_since": NOW - 40,
                                  "waiting_message": "MountVolume.SetUp failed for volume ckpt"}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW), Action.KEEP, C.PODS_NOT_STARTED, None,
     {"message_has": "MountVolume.SetUp failed", "requeue_after": 60.0, "rule": "stuck_before_running"}),
    ("pending-on-a-node-past-deadline-restarts", spec(startupTimeoutSeconds=30), status(),
     Observed(pods=gang(over={1: {"phase": "Pending", "waiting_reason": "ContainerCreating", "scheduled_since": NOW - 40}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW), Action.RESTART, C.RESTARTED, "StartupTimeout",
     {**RESTART_ALL, "node_name": "n1", "message_has": "ContainerCreating on node n1 since"}),
    ("node-not-ready-in-grace-waits", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=None, not_ready_since=NOW - 10)},
              ranks_seen=SEEN, now=NOW), Action.WAIT, C.WAITING_FOR_PODS, None,
     {"requeue_after": 50.0, "rule": "node_grace"}),
    ("node-not-ready-past-grace-force-deletes", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=False, not_ready_since=NOW - 61)},
              now=NOW), Action.RESTART, C.RESTARTED, "NodeFailure",
     {"force_delete": ("j-a0-1",), "delete": ("j-a0-0",), "node_name": "n1"}),
    ("node-missing-timed-from-first-sight", spec(nodeFailureGraceSeconds=60), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False,
                                                                     not_ready_since=NOW - 20)},
              ranks_seen=SEEN, now=NOW), Action.WAIT, C.WAITING_FOR_PODS, None, {"requeue_after": 40.0}),
    ("node-missing-past-grace", spec(nodeFailureGraceSeconds=0), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False)}, now=NOW),
     Action.RESTART, C.RESTARTED, "NodeFailure", {"force_delete": ("j-a0-1",), "delete": ("j-a0-0",),
                                                  "node_name": "n1"}),
    ("pod-seen-then-gone-restarts", spec(), status(), Observed(pods=gang()[:1], nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "PodDeleted", {"delete": ("j-a0-0",), "message_has": "disappeared"}),
    ("pod-deleted-by-hand-exits-75-is-pod-deleted-not-preempted", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 75, "deleting": True}}), nodes=ok_nodes,
              ranks_seen=SEEN, now=NOW), Action.RESTART, C.RESTARTED, "PodDeleted",
     {"delete": ("j-a0-0",), "node_name": "n1", "message_has": "not by the operator"}),
    ("configmap-and-service-deleted-while-training-are-recreated", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW,
              missing_children=("j-config", "j")), Action.KEEP, C.TRAINING, None,
     {"ready": True, "recreate": ("j-config", "j"), "rule": "running"}),
    ("missing-service-while-waiting-for-pods-is-recreated", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Pending", "node_name": None,
                                  "unschedulable_message": "0/3 nodes are available"}}),
              nodes=ok_nodes, ranks_seen=SEEN, now=NOW, missing_children=("j",)),
     Action.WAIT, C.WAITING_FOR_NODES, None, {"recreate": ("j",), "requeue_after": 850.0, "rule": "unschedulable"}),
    ("missing-children-not-recreated-for-an-attempt-that-ends", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW,
              missing_children=("j-config",)), Action.RESTART, C.RESTARTED, "ContainerFailed",
     {**RESTART_ALL, "node_name": "n1", "recreate": ()}),
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
    ("steps-lowered-but-not-checkpointed-there-yet-keeps-training", steps_spec(15), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW, attempt_steps=100),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("steps-raised-but-rank0-still-training-keeps-going", steps_spec(150), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW, attempt_steps=100),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("worker-exit-0-is-not-failure", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, progress=TRAINING,
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.WAITING_FOR_PODS, None, {}),
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
    ("previous-attempt-deleted", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=gang(0) + gang(1), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {**RESTART_ALL, "ready": True}),
    ("previous-attempt-stuck-on-dead-node-forced", spec(nodeFailureGraceSeconds=0), status(attempt=1, restarts=[rec(0)]),
     Observed(pods=(replace(pod(0, 0), deleting=True, node_name="dead"),) + gang(1),
              nodes={**ok_nodes, "dead": NodeObs("dead", exists=False, ready=False)}, progress=TRAINING,
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.TRAINING, None, {"force_delete": ("j-a0-0",), "ready": True}),
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
    # ---- in-place restarts (the launchers restart every rank's workers; the operator records, never deletes)
    ("worker-killed-on-healthy-node-restarts-in-place", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=IN_PLACE, ranks_seen=SEEN, now=NOW),
     Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "ContainerFailed",
     {"node_name": "n1", "ready": True, "rule": "restarted_in_place", "message_has": "killed by signal 9"}),
    ("in-place-nan-loss-keeps-its-cause", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(IN_PLACE, restart_exit_code=3), ranks_seen=SEEN,
              now=NOW), Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "NonFiniteLoss", {"node_name": "n1", "ready": True}),
    ("in-place-generation-already-recorded-keeps-training", spec(), status(restarts=[ip_rec(1, "n1")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=IN_PLACE, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("in-place-budget-used-up-recreates", spec(maxInPlaceRestarts=1), status(restarts=[ip_rec(1, "n0")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(IN_PLACE, generation=2), ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed",
     {**RESTART_ALL, "node_name": "n1", "message_has": "maxInPlaceRestarts=1", "rule": "restarted_in_place"}),
    ("same-node-failing-in-place-twice-recreates", spec(), status(restarts=[ip_rec(1, "n1")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(IN_PLACE, generation=2), ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed",
     {**RESTART_ALL, "node_name": "n1", "message_has": "node n1 failed in place twice in a row"}),
    ("a-node-failing-again-after-another-node-stays-in-place", spec(),
     status(restarts=[ip_rec(1, "n1"), ip_rec(2, "n0")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(IN_PLACE, generation=3), ranks_seen=SEEN, now=NOW),
     Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "ContainerFailed", {"node_name": "n1", "ready": True}),
    ("in-place-counts-towards-max-restarts", spec(maxRestarts=1), status(restarts=[rec(0, lost=5)], attempt=1),
     Observed(pods=gang(1), nodes=ok_nodes, progress=IN_PLACE, ranks_seen=SEEN, now=NOW),
     Action.FAIL, C.MAX_RESTARTS_EXCEEDED, "ContainerFailed", {"delete": ("j-a1-0", "j-a1-1"), "node_name": "n1"}),
    ("pod-failure-wins-over-in-place-record", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 137}}), nodes=ok_nodes, progress=IN_PLACE,
              ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "ContainerFailed", {**RESTART_ALL, "node_name": "n1", "rule": "pod_failed"}),
    ("not-ready-node-recreates-even-with-in-place-on", spec(nodeFailureGraceSeconds=0), status(),
     Observed(pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=None, not_ready_since=NOW - 1)},
              progress=TRAINING, ranks_seen=SEEN, now=NOW), Action.RESTART, C.RESTARTED, "NodeFailure",
     {"force_delete": ("j-a0-1",), "delete": ("j-a0-0",), "node_name": "n1", "rule": "pod_failed"}),
    ("no-startup-timeout-for-a-young-generation-of-old-pods", spec(startupTimeoutSeconds=30), status(restarts=[ip_rec(1, "n1")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(SCRAPED_NO_STEP, generation=1,
                                                            generation_start_time=NOW - 5),
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.WAITING_FOR_FIRST_STEP, None, {"rule": "running"}),
    # ---- the automatic hang timeout: min(hangTimeoutSeconds, max(10 x median step, 30 s)) after 5 steps
    ("auto-hang-fires-at-10x-median-step", spec(hangTimeoutSeconds=900, maxInPlaceRestarts=0), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=4.0,
                                                            last_progress_time=NOW - 41), now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "rule": "hung", "message_has": "hangTimeoutPolicy=Auto"}),
    ("auto-hang-not-before-10x-median-step", spec(hangTimeoutSeconds=900), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=4.0,
                                                            last_progress_time=NOW - 39), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("auto-hang-floor-30s-for-fast-steps", spec(hangTimeoutSeconds=900), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 29), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
    ("auto-hang-floor-lowered-by-the-operator", spec(hangTimeoutSeconds=900, maxInPlaceRestarts=0), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 6), now=NOW, hang_floor_seconds=5),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "rule": "hung", "message_has": "max(10 x median step 0.2s, 5s)"}),
    ("auto-hang-lowered-floor-still-10x-median-step", spec(hangTimeoutSeconds=900), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=4.0,
                                                            last_progress_time=NOW - 39), ranks_seen=SEEN, now=NOW,
              hang_floor_seconds=5), Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("auto-hang-keeps-the-save-window-on-a-checkpoint-step", spec(hangTimeoutSeconds=900), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=500, start_step=400, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 300), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
    ("auto-hang-waits-for-5-steps-of-the-generation", spec(hangTimeoutSeconds=900), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, start_step=17, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 100), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
    ("auto-hang-never-longer-than-hang-timeout", spec(hangTimeoutSeconds=60, maxInPlaceRestarts=0), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=100.0,
                                                            last_progress_time=NOW - 61), now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "message_has": "hangTimeoutSeconds=60"}),
    # ---- with in-place restarts left, the launchers' watchdogs stop a hung worker first (an in-place restart);
    # the operator re-creates the gang only IN_PLACE_GRACE_SECONDS (30) after the same limit
    ("hang-waits-for-the-launchers-while-in-place-restarts-are-left", spec(hangTimeoutSeconds=60), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 89), ranks_seen=SEEN,
              now=NOW), Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("hang-recreates-when-no-launcher-restarted-in-place", spec(hangTimeoutSeconds=60), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, last_progress_time=NOW - 91), now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "rule": "hung",
                                          "message_has": "the launchers did not restart in place within 30s more"}),
    ("hang-no-grace-once-in-place-restarts-are-used-up", spec(hangTimeoutSeconds=60, maxInPlaceRestarts=1),
     status(restarts=[ip_rec(1, "n0")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, generation=1, last_progress_time=NOW - 61),
              now=NOW), Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "rule": "hung"}),
    ("launcher-hang-stop-restarts-in-place-with-cause-hang", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, generation=1, restart_exit_code=7,
                                                            restart_node_rank=1, generation_start_time=NOW - 3),
              ranks_seen=SEEN, now=NOW),
     Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "Hang",
     {"node_name": "n1", "message_has": "the step stood still for the hang limit", "rule": "restarted_in_place",
      "ready": True}),
    # a hang with no stopped worker: every rank's step stood still together, no node is named, and two such hangs
    # in a row are not "the same node failing twice" (only maxInPlaceRestarts bounds them)
    ("launcher-hang-without-a-stopped-worker-names-no-node", spec(), status(restarts=[ip_rec(1, None)]),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, generation=2, restart_exit_code=7,
                                                            restart_node_rank=None, generation_start_time=NOW - 3),
              ranks_seen=SEEN, now=NOW),
     Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "Hang",
     {"node_name": None, "message_has": "no one node is named", "rule": "restarted_in_place", "ready": True}),
    ("launcher-out-of-in-place-restarts-exits-7-recreates-with-cause-hang", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 7}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.RESTART, C.RESTARTED, "Hang", {**RESTART_ALL, "node_name": "n1", "message_has": "hang limit",
                                          "rule": "pod_failed"}),
    ("fixed-hang-ignores-the-step-time", spec(hangTimeoutSeconds=900, hangTimeoutPolicy="Fixed"), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 100), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
    *ELASTIC_CASES,
]


def _want(action: Action, reason: str, cause: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    size = 2 if action == Action.CREATE else None  # a create names the attempt's size: every case's spec has 2 nodes
    want = {**asdict(Decision(action, reason, cause=cause, nodes=size)),
            **{k: v for k, v in extra.items() if k != "message_has"}}
    want.pop("message")
    if "rule" not in extra:
        want.pop("rule")
    return want


@pytest.mark.parametrize(("spec_", "status_", "obs", "action", "reason", "cause", "extra"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(spec_, status_, obs, action, reason, cause, extra) -> None:
    d = decide(spec_, status_, obs)
    want = _want(action, reason, cause, extra)
    got = {k: v for k, v in asdict(d).items() if k in want}
    assert got == want, d.message
    if "message_has" in extra:
        assert extra["message_has"] in d.message, d.message


@pytest.mark.parametrize(("spec_", "status_", "obs"), [c[1:4] for c in CASES], ids=[c[0] for c in CASES])
def test_every_decision_leads_to_a_status_that_tells_one_story(spec_, status_, obs) -> None:
    """Each case's decision, turned into the status: the phase is the conditions' phase, no condition contradicts
    another, ChildrenCreated speaks of the current attempt, no waiting message carries a running counter
    (``conditions.contradictions``)."""
    new = next_status(spec_, status_, decide(spec_, status_, obs), obs)
    assert C.contradictions(new.phase, new.conditions, new.attempt) == [], [c.dump() for c in new.conditions]


def test_every_rule_has_a_case() -> None:
    """Each rule of decide.RULES decides at least one table case."""
    fired = {decide(c[1], c[2], c[3]).rule for c in CASES}
    assert {r.__name__ for r in RULES} <= fired, {r.__name__ for r in RULES} - fired


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


def test_a_gpu_fault_avoids_its_node_at_once_and_counts_with_node_failures() -> None:
    assert nodes_to_avoid([rec(0, "GPUXidError", node="g"), rec(1, "NodeFailure", node="n")]) == ("g",)
    # a node that failed as a node once and then lost a GPU: the GPU fault's own limit (1) applies
    assert nodes_to_avoid([rec(0, "NodeFailure", node="n"), rec(1, "GPUXidError", node="n")]) == ("n",)


def test_a_failed_pre_flight_gate_restarts_the_gang_and_the_next_attempt_avoids_the_node() -> None:
    """decide -> the status it leads to -> decide again after the backoff: the restart record blames the node, and
    the next attempt's pods are created with that node avoided."""
    s = spec()
    obs = Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 8, "termination_message": PREFLIGHT_N1}}),
                   nodes=ok_nodes, ranks_seen=SEEN, now=NOW)
    d = decide(s, status(), obs)
    new = next_status(s, status(), d, obs)
    r = new.restarts[0]
    assert (r.cause, r.node_name, new.attempt) == ("PreflightFailed", "n1", 1) and PREFLIGHT_N1 in r.message
    later = Observed(now=NOW + 3600)
    create = decide(s, new, later)
    assert (create.action, create.avoid_nodes) == (Action.CREATE, ("n1",))


@pytest.mark.parametrize(("p", "want"), [
    (pod(0, phase="Running"), None),
    (pod(0, phase="Failed", exit_code=137), "ContainerFailed"),
    (pod(0, phase="Failed", exit_code=143, disruption_reason="DeletionByTaintManager"), "NodeFailure"),
    (pod(0, phase="Pending", waiting_reason="CreateContainerConfigError"), "fatal"),
], ids=["running", "sigkill", "taint-manager", "container-config-error"])
def test_classify_pod(p, want) -> None:
    f = classify_pod(p)
    assert (None if f is None else f.cause or "fatal") == want


# (rank 0's container, rank 1's container) -> the pod the restart names: the rank that ended first, and within one
# second of finishedAt a cause of its own, then a signal's kill, then a plain exit, then the lower rank
_OOM = {"phase": "Failed", "exit_code": 137, "terminated_reason": "OOMKilled"}
ROOT_CASES = [
    ("killed-rank-1-then-peer-exit-1-same-second",
     {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 2}, {"phase": "Failed", "exit_code": 137, "finished_at": NOW - 2},
     "j-a0-1", "killed by signal 9"),
    ("peer-exit-1-a-second-after-the-kill",
     {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 1}, {"phase": "Failed", "exit_code": 137, "finished_at": NOW - 2},
     "j-a0-1", "killed by signal 9"),
    ("rank-0-crashed-first-rank-1-killed-later",
     {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 3}, {"phase": "Failed", "exit_code": 137, "finished_at": NOW - 2},
     "j-a0-0", "exited with code 1"),
    ("oom-killed-before-a-plain-kill-in-the-same-second",
     {"phase": "Failed", "exit_code": 137, "finished_at": NOW - 2}, {**_OOM, "finished_at": NOW - 2}, "j-a0-1", "OOM"),
    ("two-plain-exits-same-second-lower-rank",
     {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 2}, {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 2},
     "j-a0-0", "exited with code 1"),
    ("no-end-times-cause-of-its-own-first",
     {"phase": "Failed", "exit_code": 1}, _OOM, "j-a0-1", "OOM"),
    ("image-pull-before-a-peer-that-ended",
     {"phase": "Failed", "exit_code": 1, "finished_at": NOW - 2},
     {"phase": "Pending", "waiting_reason": "ImagePullBackOff", "waiting_message": "no such image"}, "j-a0-1", "ImagePullBackOff"),
]


@pytest.mark.parametrize(("r0", "r1", "named", "says"), [c[1:] for c in ROOT_CASES], ids=[c[0] for c in ROOT_CASES])
def test_a_restart_names_the_failure_that_came_first(r0, r1, named, says) -> None:
    s = spec()
    obs = Observed(pods=gang(over={0: r0, 1: r1}), nodes=ok_nodes, progress=TRAINING, now=NOW)
    d = decide(s, status(), obs)
    assert d.action in (Action.RESTART, Action.FAIL), d
    new = next_status(s, status(), d, obs)
    msg = new.restarts[0].message if new.restarts else d.message
    assert f"pod {named}" in msg and says in msg and ("(+1 more)" in msg or d.action == Action.FAIL), msg


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


def test_restart_record_settles_the_resumed_step_even_when_no_step_was_scraped_before_the_failure() -> None:
    """A rank killed at the first checkpoint, before the operator scraped any step: the record is written with
    nothing known (resumed 0, lost unknown); the next attempt's first step still settles the step it resumed from."""
    s = spec()
    obs = Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 137}}), nodes=ok_nodes, now=NOW,
                   progress=Progress())
    new = next_status(s, status(), decide(s, status(), obs), obs)
    assert (new.restarts[0].resumed_from_step, new.restarts[0].lost_steps) == (0, None)
    obs2 = Observed(pods=gang(1), nodes=ok_nodes, now=NOW + 20,
                    progress=Progress(step=3, start_step=2, last_progress_time=NOW + 19, first_step_time=NOW + 18))
    r = next_status(s, new, decide(s, new, obs2), obs2).restarts[0]
    assert (r.resumed_from_step, r.lost_steps, r.downtime_seconds) == (2, None, 18.0)


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


@pytest.mark.parametrize(("conds", "phase"), [
    ((), "Pending"),
    (((C.CHILDREN_CREATED, "False", C.CREATING),), "Pending"),
    (((C.CHILDREN_CREATED, "True", C.CHILDREN_OK),), "Starting"),
    (((C.READY, "True", C.TRAINING), (C.CHILDREN_CREATED, "True", C.CHILDREN_OK)), "Running"),
    (((C.READY, "Unknown", C.PROGRESS_UNKNOWN), (C.CHILDREN_CREATED, "True", C.CHILDREN_OK)), "Running"),
    (((C.RESTARTING, "True", C.RESTARTED),), "Restarting"),
    (((C.RESTARTING, "True", C.RESTART_BLOCKED),), "Blocked"),
    (((C.SUSPENDED, "True", C.SUSPENDED_BY_USER), (C.RESTARTING, "True", C.RESTART_BLOCKED)), "Suspended"),
    (((C.SUCCEEDED, "True", C.COMPLETED), (C.READY, "True", C.TRAINING)), "Succeeded"),
    (((C.FAILED, "True", C.CONFIG_ERROR),), "Failed"),
], ids=["nothing", "pods-missing", "starting", "running", "running-progress-unknown", "restarting", "blocked",
        "suspended-wins", "succeeded", "failed"])
def test_derive_phase(conds, phase) -> None:
    assert C.derive_phase([Condition(type=t, status=st, reason=r) for t, st, r in conds]) == phase


# ------------------------------------------------------------------ the status builder (kubetitan.status)
from kubetitan import status as S  # noqa: E402


@pytest.mark.parametrize(("scrape", "want"), [
    ({}, ("Unknown", C.NOT_SCRAPED)),
    ({"metrics": {contract.M_STEP: 3.0}}, ("True", C.SCRAPED)),
    ({"scrape_error": "GET http://10.0.0.1:9090/metrics timed out after 3s"}, ("False", C.SCRAPE_FAILED)),
], ids=["not-scraped", "answered", "unreachable"])
def test_metrics_available_condition(scrape, want) -> None:
    s, st = spec(), status()
    o = T.track(None, 0, NOW, pods=gang(), **scrape)
    obs = T.observed(o, pods=gang(), nodes=ok_nodes, now=NOW)
    new = S.next_status(s, st, decide(s, st, obs), obs)
    assert condition(new, C.METRICS_AVAILABLE) == want
    assert new.restart_count == 0 and new.observation == o


def test_timers_survive_an_operator_restart() -> None:
    """The observation is written into the status; a new operator reading that status goes on from it: a failed
    scrape right after the restart neither fires nor resets the hang timer."""
    s = spec(hangTimeoutSeconds=60, maxInPlaceRestarts=0)  # the operator's own hang rule, no launcher's first
    m = {contract.M_STEP: 20.0, contract.M_ATTEMPT: 0.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 50}
    o = T.track(None, 0, NOW - 50, metrics=m, pods=gang())
    obs = T.observed(o, pods=gang(), nodes=ok_nodes, now=NOW - 50)
    written = S.next_status(s, status(), decide(s, status(), obs), obs).dump()
    # a new operator: only the API's status
    st = S.load(written)
    o2 = T.track(st.observation, 0, NOW, scrape_error="GET http://10.0.0.1:9090/metrics: connection refused",
                 pods=gang())
    d = decide(s, st, T.observed(o2, pods=gang(), nodes=ok_nodes, now=NOW))
    assert (d.action, d.reason) == (Action.KEEP, C.PROGRESS_UNKNOWN)
    assert T.progress(o2).last_progress_time == NOW - 50  # not reset
    # the step still stands when /metrics answers again: 70 s idle > 60 s, measured from the persisted time
    o3 = T.track(o2, 0, NOW + 20, metrics=m, pods=gang())
    d = decide(s, st, T.observed(o3, pods=gang(), nodes=ok_nodes, now=NOW + 20))
    assert (d.action, d.cause) == (Action.RESTART, "Hang")


def test_missing_node_timed_from_first_sight() -> None:
    s = spec(nodeFailureGraceSeconds=60)
    nodes = {"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False)}
    o = T.track(None, 0, NOW, pods=gang(), nodes=nodes)
    assert o.nodes_missing_since == {"n1": iso_ms(NOW)}
    o2 = T.track(o, 0, NOW + 61, pods=gang(), nodes=nodes)  # first sight kept, not "now" again
    d = decide(s, status(), T.observed(o2, pods=gang(), nodes=nodes, now=NOW + 61))
    assert (d.action, d.cause, d.force_delete) == (Action.RESTART, "NodeFailure", ("j-a0-1",))


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


def test_in_place_restart_is_tracked_recorded_and_settled_per_generation() -> None:
    """Rank 0's metrics move to worker generation 1 (rank 1's worker was SIGKILLed at step 14, the new workers
    resumed from checkpoint 10): the steps go back, the hang timer restarts with the generation, the status gets
    one InPlace record (same attempt, no pod deleted), settled at the generation's first trained step."""
    s = spec(hangTimeoutSeconds=60)
    m0 = {contract.M_STEP: 14.0, contract.M_ATTEMPT: 0.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 100,
          contract.M_LAST_CHECKPOINT_STEP: 10.0, contract.M_RESTART_GENERATION: 0.0}
    o = T.track(None, 0, NOW - 100, metrics=m0, pods=gang())
    obs = T.observed(o, pods=gang(), nodes=ok_nodes, now=NOW - 100)
    st = S.next_status(s, status(), decide(s, status(), obs), obs)
    # generation 1 answers, loaded checkpoint 10, no step of its own yet (heartbeat 0); 90 s after the old heartbeat
    m1 = {**m0, contract.M_STEP: 10.0, contract.M_LAST_STEP_TIMESTAMP: 0.0, contract.M_RESTART_GENERATION: 1.0,
          contract.M_RESTART_EXIT_CODE: 137.0, contract.M_RESTART_NODE_RANK: 1.0, contract.M_RESTART_TIMESTAMP: NOW - 12}
    o1 = T.track(st.observation, 0, NOW - 10, metrics=m1, pods=gang())
    assert (o1.generation, o1.step, o1.start_step, o1.first_step_time, o1.previous_generation_step) == (1, 10, 10, None, 14)
    obs1 = T.observed(o1, pods=gang(), nodes=ok_nodes, now=NOW - 10)
    d = decide(s, st, obs1)
    assert (d.action, d.cause, d.node_name, d.delete, d.force_delete) == (
        Action.RESTARTED_IN_PLACE, "ContainerFailed", "n1", (), ())
    st1 = S.next_status(s, st, d, obs1)
    r = st1.restarts[0]
    assert (st1.attempt, st1.restart_count, r.mode, r.generation, r.attempt, r.node_name) == (0, 1, "InPlace", 1, 0, "n1")
    assert r.downtime_seconds is None and C.is_true(st1.conditions, C.RESTARTING)
    # the first step of generation 1, 3 s after the failure: settled; recorded once
    m2 = {**m1, contract.M_STEP: 11.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 9}
    o2 = T.track(o1, 0, NOW - 8, metrics=m2, pods=gang())
    obs2 = T.observed(o2, pods=gang(), nodes=ok_nodes, now=NOW - 8)
    d2 = decide(s, st1, obs2)
    assert (d2.action, d2.reason) == (Action.KEEP, C.TRAINING)
    st2 = S.next_status(s, st1, d2, obs2)
    r = st2.restarts[0]
    assert (len(st2.restarts), r.resumed_from_step, r.lost_steps, r.downtime_seconds) == (1, 10, 4, 3.0)
    assert not C.is_true(st2.conditions, C.RESTARTING) and C.is_true(st2.conditions, C.READY)


@pytest.mark.parametrize("previous, want", [
    (16.0, 16),   # the launcher's heartbeat count: generation 0 trained 2 steps past the operator's last scrape (14)
    (-1.0, 14),   # unknown (a launcher without heartbeats): what the operator saw
    (None, 14),   # a trainer without the gauge: the same
    (13.0, 14),   # never below what the operator saw
])
def test_the_work_an_in_place_restart_lost_counts_the_steps_past_the_last_scrape(previous, want) -> None:
    """lostSteps = the previous generation's last step - the step resumed from; the last step comes from the
    launcher's heartbeats (kubetitan_trainer_restart_previous_step): under two CPU hogs the e2e in-place test saw
    lostSteps 2 where generation 0 had trained 4 steps past the checkpoint (the last scrape was 2 steps old)."""
    m = {contract.M_STEP: 14.0, contract.M_ATTEMPT: 0.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 100,
         contract.M_LAST_CHECKPOINT_STEP: 10.0, contract.M_RESTART_GENERATION: 0.0}
    o = T.track(None, 0, NOW - 100, metrics=m, pods=gang())
    m1 = {**m, contract.M_STEP: 10.0, contract.M_LAST_STEP_TIMESTAMP: 0.0, contract.M_RESTART_GENERATION: 1.0}
    if previous is not None:
        m1[contract.M_RESTART_PREVIOUS_STEP] = previous
    assert T.track(o, 0, NOW - 8, metrics=m1, pods=gang()).previous_generation_step == want


@pytest.mark.parametrize("resumed, steps_seen, start", [
    (10, 12.0, 10),   # the first scrape of generation 1 came two steps after its load: still resumed from 10
    (10, 11.0, 10),
    (-1, 12.0, 11),   # a trainer that has not loaded yet says -1: the old guess (first step seen - 1) stands
    (None, 12.0, 11),  # a trainer without the gauge: the same guess
    (0, 3.0, 0),      # a fresh start scraped at step 3
])
def test_the_step_a_generation_resumed_from_is_what_the_trainer_loaded(resumed, steps_seen, start) -> None:
    """The record's resumedFromStep comes from the trainer's resumed-from gauge, not from the first step the
    operator happened to scrape (the e2e in-place test once saw 5 where the workers had loaded checkpoint 4)."""
    m = {contract.M_STEP: 14.0, contract.M_ATTEMPT: 0.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 100,
         contract.M_LAST_CHECKPOINT_STEP: 10.0, contract.M_RESTART_GENERATION: 0.0}
    o = T.track(None, 0, NOW - 100, metrics=m, pods=gang())
    m1 = {**m, contract.M_STEP: steps_seen, contract.M_LAST_STEP_TIMESTAMP: NOW - 9, contract.M_RESTART_GENERATION: 1.0}
    if resumed is not None:
        m1[contract.M_RESUMED_FROM_STEP] = float(resumed)
    o1 = T.track(o, 0, NOW - 8, metrics=m1, pods=gang())
    assert (o1.generation, o1.start_step) == (1, start)


@pytest.mark.parametrize("first, want", [
    (NOW - 10.5, NOW - 10.5),  # scraped two steps after the first: the downtime still ends at the first step
    (0.0, NOW - 9),            # a trainer that has not stepped yet says 0: the heartbeat stands
    (None, NOW - 9),           # a trainer without the gauge: the heartbeat of the first step seen
])
def test_a_generations_first_step_time_is_what_the_trainer_recorded(first, want) -> None:
    """The end of a restart's downtime comes from the trainer's first-step timestamp, not from the heartbeat of
    whichever step the first scrape saw (the e2e fault test once measured 1.75 s too long on a loaded machine)."""
    m = {contract.M_STEP: 14.0, contract.M_ATTEMPT: 0.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 100,
         contract.M_LAST_CHECKPOINT_STEP: 10.0, contract.M_RESTART_GENERATION: 0.0}
    o = T.track(None, 0, NOW - 100, metrics=m, pods=gang())
    m1 = {**m, contract.M_STEP: 12.0, contract.M_LAST_STEP_TIMESTAMP: NOW - 9, contract.M_RESTART_GENERATION: 1.0,
          contract.M_RESUMED_FROM_STEP: 10.0}
    if first is not None:
        m1[contract.M_FIRST_STEP_TIMESTAMP] = first
    o1 = T.track(o, 0, NOW - 8, metrics=m1, pods=gang())
    assert T.progress(o1).first_step_time == pytest.approx(want, abs=1e-3)


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


def test_a_large_gang_is_decided_in_time_linear_in_its_pods() -> None:
    """The decision reads each pod's rank a bounded number of times: a 512-pod gang training, every rank seen (the
    check for a rank that disappeared built the set of the gang's ranks once per rank seen: 262,144 reads a
    cycle, every cycle of a 1,024-pod gang's creation)."""
    reads = [0]

    class Counted(PodObs):
        def __getattribute__(self, name: str) -> Any:
            if name == "rank":
                reads[0] += 1
            return object.__getattribute__(self, name)

    n = 512
    gang = tuple(Counted(**asdict(pod(r))) for r in range(n))
    sp = LlamaPretrainSpec.model_validate({"resources": {"nodes": n}})
    nodes = {f"n{r}": NodeObs(f"n{r}") for r in range(n)}
    d = decide(sp, status(), Observed(pods=gang, nodes=nodes, progress=TRAINING, ranks_seen=frozenset(range(n)),
                                      now=NOW))
    assert d.reason == C.TRAINING, d.message
    assert reads[0] < 20 * n, reads[0]
