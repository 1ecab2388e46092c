"""Table tests of the failure policy (``kubetitan.decide.failure``): which cause a failed pod means and in which order
of evidence, whether the gang restarts or the run fails (the restart budgets, the backoff), the nodes a run avoids, a
lost node's grace, and the launchers' in-place restarts (recorded, or escalated to a new gang)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kubetitan import conditions as C
from kubetitan_core import contract
from kubetitan.decide import Action, decide
from kubetitan.decide import failure
from kubetitan.decide.failure import backoff_seconds, classify_pod, nodes_to_avoid
from kubetitan.observation import NodeObs, Observed, Progress
from kubetitan.observation import tracking as T
from kubetitan.status import next_status
from kubetitan.timestamps import iso_ms
from kubetitan import status as S
from kubetitan_core.api import AttemptObservation
from support.decide_cases import (IN_PLACE, NOW, RESTART_ALL, SEEN, TRAINING, gang, ip_rec, ok_nodes, pod,
                                  policy_table_tests, rec, spec, status)


XID_79 = ("[kubetitan] GPUXidError: Xid 79 (GPU has fallen off the bus) (worker local rank 3, exit code 1); not "
          "restarted in place: RuntimeError: CUDA error: unknown error")
"""The termination message a launcher writes for a worker whose failure report showed Xid 79 (``launch.failures.report_detected``;
tests/trainer/test_launch_causes.py checks that the launcher writes this shape)."""
PREFLIGHT_N1 = ("PreflightFailed: node n1 failed the pre-flight gate: matmul_tflops: cuda:3 301.5 TF/s < 495 TF/s, the "
                "H100 floor (50% of its 989.4 TF/s dense bf16 peak)")
"""The termination message a launcher writes when its pod's pre-flight gate failed (``launch.gate.finish``;
tests/trainer/test_preflight.py checks that the launcher writes this shape)."""


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


def test_missing_node_timed_from_first_sight() -> None:
    s = spec(nodeFailureGraceSeconds=60)
    nodes = {"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False)}
    o = T.track(None, 0, NOW, pods=gang(), nodes=nodes)
    assert o.nodes_missing_since == {"n1": iso_ms(NOW)}
    o2 = T.track(o, 0, NOW + 61, pods=gang(), nodes=nodes)  # first sight kept, not "now" again
    d = decide(s, status(), T.observed(o2, pods=gang(), nodes=nodes, now=NOW + 61))
    assert (d.action, d.cause, d.force_delete) == (Action.RESTART, "NodeFailure", ("j-a0-1",))


def test_a_missing_node_is_remembered_after_its_pods_are_gone_and_forgotten_when_it_is_back() -> None:
    """The pod garbage collector deletes the pods of a deleted node: the node drops out of the nodes the attempt's
    pods are on, yet its ranks disappeared because of it, so it stays in ``nodesMissingSince`` (with its first
    sight) for the rest of the attempt; a node that exists again goes."""
    missing = {"n0": NodeObs("n0"), "n1": NodeObs("n1", exists=False, ready=False)}
    o = T.track(None, 0, NOW, pods=gang(), nodes=missing)
    o2 = T.track(o, 0, NOW + 45, pods=gang()[:1], nodes={"n0": NodeObs("n0")})  # rank 1's pod garbage-collected
    assert o2.nodes_missing_since == {"n1": iso_ms(NOW)}
    d = decide(spec(nodeFailureGraceSeconds=600), status(),
               T.observed(o2, pods=gang()[:1], nodes={"n0": NodeObs("n0")}, now=NOW + 45))
    assert (d.action, d.cause, d.node_name, d.delete) == (Action.RESTART, "NodeFailure", "n1", ("j-a0-0",)), d
    back = T.track(o2, 0, NOW + 50, pods=gang(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1")})
    assert back.nodes_missing_since == {}
    assert T.track(o2, 1, NOW + 50, pods=gang(1), nodes={"n0": NodeObs("n0")}).nodes_missing_since == {}  # new attempt


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


CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
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
    # the pod garbage collector deleted the pod of a deleted node (kube-controller-manager's orphan pods, 40 s after
    # the node went) before nodeFailureGraceSeconds ran out: the node's failure, not someone's delete
    ("pod-gone-from-a-missing-node-is-node-failure", spec(nodeFailureGraceSeconds=600), status(),
     Observed(pods=gang()[:1], nodes={"n0": NodeObs("n0")}, ranks_seen=SEEN, now=NOW,
              observation=AttemptObservation(attempt=0, nodes_missing_since={"n1": iso_ms(NOW - 45)})),
     Action.RESTART, C.RESTARTED, "NodeFailure",
     {"delete": ("j-a0-0",), "force_delete": (), "node_name": "n1",
      "message_has": "node n1 is missing and pod(s) of rank 1 of attempt 0 disappeared (the pod garbage collector"}),
    ("pod-gone-while-a-missing-node-still-holds-a-pod-is-pod-deleted", spec(nodeFailureGraceSeconds=600), status(),
     Observed(pods=gang()[1:], nodes={"n1": NodeObs("n1", exists=False, ready=False, not_ready_since=NOW - 45)},
              ranks_seen=SEEN, now=NOW,
              observation=AttemptObservation(attempt=0, nodes_missing_since={"n1": iso_ms(NOW - 45)})),
     Action.RESTART, C.RESTARTED, "PodDeleted", {"delete": (), "force_delete": ("j-a0-1",), "message_has":
                                                 "pod(s) of rank 0 of attempt 0 disappeared (deleted, not by the operator)"}),
    ("pod-deleted-by-hand-exits-75-is-pod-deleted-not-preempted", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 75, "deleting": True}}), nodes=ok_nodes,
              ranks_seen=SEEN, now=NOW), Action.RESTART, C.RESTARTED, "PodDeleted",
     {"delete": ("j-a0-0",), "node_name": "n1", "message_has": "not by the operator"}),
    ("missing-children-not-recreated-for-an-attempt-that-ends", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, ranks_seen=SEEN, now=NOW,
              missing_children=("j-config",)), Action.RESTART, C.RESTARTED, "ContainerFailed",
     {**RESTART_ALL, "node_name": "n1", "recreate": ()}),
    # ---- in-place restarts (the launchers restart every rank's workers; the operator records, never deletes)
    ("worker-killed-on-healthy-node-restarts-in-place", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=IN_PLACE, ranks_seen=SEEN, now=NOW),
     Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "ContainerFailed",
     {"node_name": "n1", "ready": True, "rule": "restarted_in_place", "message_has": "killed by signal 9"}),
    ("in-place-nan-loss-keeps-its-cause", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(IN_PLACE, restart_exit_code=3), ranks_seen=SEEN,
              now=NOW), Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, "NonFiniteLoss", {"node_name": "n1", "ready": True}),
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
]


(test_decide, test_every_decision_leads_to_a_status_that_tells_one_story,
 test_every_failure_rule_has_a_case) = policy_table_tests(failure, CASES)
