"""The liveness policy: is the attempt making progress? Pods stuck before running, the hang timer (no step while
rank 0's metrics answer), the start-up timer (no first step), and what "running" means when /metrics does not
answer (reported, never a restart: observation is not failure)."""

from __future__ import annotations

from kubetitan import conditions as C
from kubetitan_core import hang
from kubetitan.timestamps import iso
from kubetitan.decide.core import Action, Decision, Facts, all_running
from kubetitan.decide.failure import Failure, may_restart_in_place, restart_or_fail


def stuck_before_running(f: Facts) -> Decision | None:
    """Pods scheduled but not running (a failing volume mount, a slow image pull): report the kubelet's reason;
    past ``startupTimeoutSeconds`` from being scheduled, end the attempt (cause StartupTimeout)."""
    waiting = [p for p in f.current if p.phase == "Pending" and p.node_name and p.unschedulable_message is None]
    if not waiting:
        return None
    p = min(waiting, key=lambda q: q.scheduled_since or q.created or f.now)
    since = p.scheduled_since or p.created or f.now
    waited = f.now - since
    why = p.waiting_reason or "ContainerCreating"
    detail = f": {p.waiting_message}" if p.waiting_message else ""
    msg = f"pod {p.name} (rank {p.rank}) is {why} on node {p.node_name} since {iso(since)}{detail}"
    limit = f.rp.startup_timeout_seconds
    if waited >= limit:
        return restart_or_fail(f, Failure("StartupTimeout", f"{msg} (runPolicy.startupTimeoutSeconds={limit})",
                                          p.name, p.node_name))
    return Decision(Action.KEEP, C.PODS_NOT_STARTED, f"{len(waiting)}/{len(f.current)} pods of attempt "
                    f"{f.attempt} are not running yet; {msg}", requeue_after=limit - waited)


def hung(f: Facts) -> Decision | None:
    """No step progress for the hang limit (``kubetitan_core.hang``), seen while rank 0's metrics answer. The timer
    starts with the generation's first trained step: loading a checkpoint and the first step's warm-up/compile
    count as start-up. While the attempt may still restart in place, the launchers' watchdogs stop a worker
    that stands still first (an in-place restart, cause Hang); this rule waits ``IN_PLACE_GRACE_SECONDS`` longer
    and re-creates the gang only when they did not."""
    pr = f.obs.progress
    if not all_running(f) or pr.first_step_time is None or pr.last_progress_time is None:
        return None
    if pr.metrics_available is not True or pr.metrics_ok_time is None:
        return None  # no evidence either way: an unreachable /metrics is reported, never a hang
    idle = pr.metrics_ok_time - pr.last_progress_time  # the step stood still while /metrics answered
    ck = f.spec.checkpoint
    base, how = hang_timeout(f)
    last_step = min(f.spec.training.steps, f.obs.attempt_steps or f.spec.training.steps)  # the trainer's own count
    saving = pr.step is not None and hang.save_window(pr.step, last_step, ck.enabled, ck.interval_steps)
    limit = hang.limit(base, saving, ck.save_timeout_seconds)
    in_place = may_restart_in_place(f)
    if idle < limit + (hang.IN_PLACE_GRACE_SECONDS if in_place else 0.0):
        return None
    return restart_or_fail(f, Failure(
        "Hang", f"no step progress for {idle:.0f}s (step {pr.step}; {how}" + (
            f" + checkpoint.saveTimeoutSeconds={ck.save_timeout_seconds} after a checkpoint step"
            if saving else "") + (
            f"; the launchers did not restart in place within {hang.IN_PLACE_GRACE_SECONDS:g}s more"
            if in_place else "") + ")", "", None))


def hang_timeout(f: Facts) -> tuple[float, str]:
    """The hang timeout of this cycle, before a checkpoint step's save window, and how it was derived
    (``kubetitan_core.hang.timeout`` on the trainer's median step time of its current worker generation; the floor
    is the operator's ``--hang-floor-seconds``, default 30 s)."""
    rp, pr = f.rp, f.obs.progress
    steps = None if pr.step is None or pr.start_step is None else pr.step - pr.start_step
    return hang.timeout(rp.hang_timeout_policy, rp.hang_timeout_seconds, f.obs.hang_floor_seconds,
                        pr.step_seconds_median, steps)


def startup_timed_out(f: Facts) -> Decision | None:
    """All pods run, rank 0's metrics answer, and no first step ``startupTimeoutSeconds`` after the last pod
    started."""
    pr = f.obs.progress
    if not all_running(f) or pr.first_step_time is not None or pr.metrics_available is not True \
            or pr.metrics_ok_time is None:
        return None
    since = max((p.running_since or f.now) for p in f.current)
    if pr.generation_start_time is not None:  # restarted in place: the pods ran long before these workers
        since = max(since, pr.generation_start_time)
    waited = pr.metrics_ok_time - since  # up to the newest scrape that answered without a step
    if waited < f.rp.startup_timeout_seconds:
        return None
    return restart_or_fail(f, Failure("StartupTimeout", f"no first step {waited:.0f}s after all pods started "
                                      f"(runPolicy.startupTimeoutSeconds={f.rp.startup_timeout_seconds})", "", None))


def _metrics_unanswered(f: Facts) -> Decision:
    """Every pod runs, no step was ever seen, and rank 0's /metrics does not answer: within ``startupTimeoutSeconds``
    of the last pod starting the workers may still be starting (their exporter is not up yet); after it, whether they
    train is unknown (``ProgressUnknown``, phase Running), never ``Starting`` for life. Neither restarts the run."""
    pr, limit = f.obs.progress, f.rp.startup_timeout_seconds
    since = max((p.running_since or f.now) for p in f.current)
    if pr.generation_start_time is not None:  # restarted in place: these workers started then
        since = max(since, pr.generation_start_time)
    why = f"rank 0's /metrics does not answer ({pr.metrics_error})"
    if f.now - since < limit:
        return Decision(Action.KEEP, C.METRICS_UNAVAILABLE, f"all pods of attempt {f.attempt} run; {why}: the workers "
                        f"may still be starting (no step seen yet; runPolicy.startupTimeoutSeconds={limit})",
                        requeue_after=since + limit - f.now)
    return Decision(Action.KEEP, C.PROGRESS_UNKNOWN, f"every pod of attempt {f.attempt} has run since {iso(since)}, "
                    f"longer than runPolicy.startupTimeoutSeconds={limit}, but {why} and no step was ever seen: "
                    "whether it trains is unknown; this alone never restarts the run")


def running(f: Facts) -> Decision | None:
    """Nothing wrong: training, waiting for the first step, or for the other pods to run."""
    pr = f.obs.progress
    if all_running(f):
        if pr.step is None and pr.metrics_available is False:
            return _metrics_unanswered(f)
        if pr.step is not None and pr.metrics_available is False:
            return Decision(Action.KEEP, C.PROGRESS_UNKNOWN, f"every pod of attempt {f.attempt} runs, but whether it "
                            f"trains is unknown: rank 0's /metrics does not answer (last known step {pr.step}); this "
                            "alone never restarts the run")
        if pr.step is not None:
            return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training", ready=True)
        return Decision(Action.KEEP, C.WAITING_FOR_FIRST_STEP, f"all pods of attempt {f.attempt} run; waiting for "
                        "the first step")
    n = sum(p.phase == "Running" for p in f.current)
    return Decision(Action.KEEP, C.WAITING_FOR_PODS, f"{n}/{len(f.current)} pods of attempt {f.attempt} are running")
