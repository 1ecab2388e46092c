"""Table tests of the liveness policy (``kubetitan.decide.liveness``): pods stuck before running, the hang and start-up
timers (positive evidence only: an unreachable /metrics is reported, never a restart), what running means."""

from __future__ import annotations

from dataclasses import replace


from kubetitan import conditions as C
from kubetitan_core import contract
from kubetitan.decide import Action, decide
from kubetitan.decide import liveness
from kubetitan.observation import NodeObs, Observed
from kubetitan.observation import tracking as T
from kubetitan import status as S
from support.decide_cases import (IN_PLACE, NOW, RESTART_ALL, SCRAPED_NO_STEP, SEEN, TRAINING, UNREACHABLE, gang,
                                  ip_rec, ok_nodes, pod, policy_table_tests, rec, spec, status, steps_spec)


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


CASES = [
    # (id, spec, status, observed, want action, want reason, want cause, the rest of the decision)
    ("all-running-no-step-yet", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.WAITING_FOR_FIRST_STEP, None, {"ready": False, "rule": "running"}),
    ("training", spec(), status(), Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
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
     Action.KEEP, C.PROGRESS_UNKNOWN, None, {"ready": False}),  # 40 s running, never answered: not "Starting",
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
    ("configmap-and-service-deleted-while-training-are-recreated", spec(), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW,
              missing_children=("j-config", "j")), Action.KEEP, C.TRAINING, None,
     {"ready": True, "recreate": ("j-config", "j"), "rule": "running"}),
    ("steps-lowered-but-not-checkpointed-there-yet-keeps-training", steps_spec(15), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW, attempt_steps=100),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("steps-raised-but-rank0-still-training-keeps-going", steps_spec(150), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW, attempt_steps=100),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
    ("worker-exit-0-is-not-failure", spec(), status(),
     Observed(pods=gang(over={1: {"phase": "Succeeded", "exit_code": 0}}), nodes=ok_nodes, progress=TRAINING,
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.WAITING_FOR_PODS, None, {}),
    ("previous-attempt-deleted", spec(), status(attempt=1, restarts=[rec(0, ago=99)]),
     Observed(pods=gang(0) + gang(1), nodes=ok_nodes, progress=TRAINING, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {**RESTART_ALL, "ready": True}),
    ("previous-attempt-stuck-on-dead-node-forced", spec(nodeFailureGraceSeconds=0), status(attempt=1, restarts=[rec(0)]),
     Observed(pods=(replace(pod(0, 0), deleting=True, node_name="dead"),) + gang(1),
              nodes={**ok_nodes, "dead": NodeObs("dead", exists=False, ready=False)}, progress=TRAINING,
              ranks_seen=SEEN, now=NOW), Action.KEEP, C.TRAINING, None, {"force_delete": ("j-a0-0",), "ready": True}),
    ("in-place-generation-already-recorded-keeps-training", spec(), status(restarts=[ip_rec(1, "n1")]),
     Observed(pods=gang(), nodes=ok_nodes, progress=IN_PLACE, ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True, "rule": "running"}),
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
    ("fixed-hang-ignores-the-step-time", spec(hangTimeoutSeconds=900, hangTimeoutPolicy="Fixed"), status(),
     Observed(pods=gang(), nodes=ok_nodes, progress=replace(TRAINING, step=21, step_seconds_median=0.2,
                                                            last_progress_time=NOW - 100), ranks_seen=SEEN, now=NOW),
     Action.KEEP, C.TRAINING, None, {"ready": True}),
]


(test_decide, test_every_decision_leads_to_a_status_that_tells_one_story,
 test_every_liveness_rule_has_a_case) = policy_table_tests(liveness, CASES)
