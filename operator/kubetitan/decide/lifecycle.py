"""The lifecycle policy: a run's phase from creation to the end. A stale status, a finished run's clean-up and TTL,
the deadline, suspension, success (and a steps count raised or lowered while an attempt ran), creating the attempt
(after the backoff, at its size, missing ranks), unschedulable pods, and the PodGroups of ended attempts."""

from __future__ import annotations

from kubetitan import conditions as C
from kubetitan_core.api import elastic_sizes
from kubetitan_core.contract import ExitCode
from kubetitan.observation import PodObs
from kubetitan.timestamps import iso, parse_time
from kubetitan.decide.core import Action, Decision, Facts, cleanup, node_failed
from kubetitan.decide.failure import backoff_seconds, nodes_to_avoid


# ------------------------------------------------------------------ rules (in order; the first answer wins)
def status_behind_cluster(f: Facts) -> Decision | None:
    """Pods of a newer attempt exist: another replica moved on. Touch nothing; re-read the status."""
    if not f.newer:
        return None
    newest = max(p.attempt for p in f.newer)
    return Decision(Action.WAIT, C.STALE_STATUS, f"pods of attempt {newest} exist but the status says attempt "
                    f"{f.attempt}; re-reading the status before acting", stale_status=True, requeue_after=0.0)


def finished(f: Facts) -> Decision | None:
    """Finished runs: clean up, then the TTL."""
    if not (C.is_true(f.status.conditions, C.SUCCEEDED) or C.is_true(f.status.conditions, C.FAILED)):
        return None
    done = parse_time(f.status.completion_time) or f.now
    ttl = f.rp.ttl_seconds_after_finished
    expired = ttl is not None and f.now >= done + ttl
    return Decision(Action.FINISHED, delete=cleanup(f.spec, f.current), delete_self=expired,
                    requeue_after=None if ttl is None or expired else done + ttl - f.now)


def deadline_exceeded(f: Facts) -> Decision | None:
    """``runPolicy.activeDeadlineSeconds`` of the whole run."""
    start = parse_time(f.status.start_time)
    limit = f.rp.active_deadline_seconds
    if limit is None or start is None or f.now - start < limit:
        return None
    return Decision(Action.FAIL, C.DEADLINE_EXCEEDED, f"the run exceeded runPolicy.activeDeadlineSeconds={limit}",
                    delete=cleanup(f.spec, f.current))


def suspended(f: Facts) -> Decision | None:
    """Suspension: stop every pod gracefully (each rank checkpoints on SIGTERM). Not when rank 0 already exited 0 at
    the spec's step count: the run finished before the suspension reached it, and it succeeds (``rank0_succeeded``)."""
    if not f.rp.suspend:
        return None
    trained = f.obs.attempt_steps
    if _exited_ok(f.rank0) and (trained is None or trained >= f.spec.training.steps):
        return None
    live = [p for p in f.current if not p.deleting]
    return Decision(Action.SUSPEND, C.SUSPENDED_BY_USER if not live else C.SUSPENDING,
                    "suspended by runPolicy.suspend; set it to false to resume from the newest checkpoint",
                    delete=tuple(p.name for p in live), ends_attempt=bool(live))


def _exited_ok(p: PodObs | None) -> bool:
    return p is not None and (p.phase == "Succeeded" or p.exit_code == ExitCode.OK)


def steps_raised(f: Facts) -> Decision | None:
    """Rank 0 exited 0 at the step count its attempt was created with, but ``spec.training.steps`` was raised
    since: the run is not done. The attempt ends (no restart: nothing failed) and the next one resumes from its
    final checkpoint (torchtitan saves the last step) with the new count."""
    trained = f.obs.attempt_steps
    if not _exited_ok(f.rank0) or trained is None or trained >= f.spec.training.steps:
        return None
    return Decision(Action.CONTINUE, C.STEPS_RAISED, f"attempt {f.attempt} trained to its {trained} steps; "
                    f"spec.training.steps was raised to {f.spec.training.steps} while it ran: attempt "
                    f"{f.attempt + 1} resumes from the newest checkpoint (step {trained}) and trains on",
                    delete=tuple(p.name for p in f.current if not p.deleting), ends_attempt=True)


def rank0_succeeded(f: Facts) -> Decision | None:
    """Rank 0 exited 0: training reached the attempt's step count (``spec.training.steps``, or more when the
    spec lowered it while the attempt ran: a lowered count reaches the trainer with the next attempt)."""
    if not _exited_ok(f.rank0):
        return None
    steps = f.spec.training.steps
    trained = f.obs.attempt_steps if f.obs.attempt_steps is not None else steps
    msg = f"training reached step {trained}"
    if trained > steps:
        msg += f" (spec.training.steps was lowered to {steps} while the attempt ran with {trained})"
    return Decision(Action.SUCCEED, C.COMPLETED, msg, delete=cleanup(f.spec, [p for p in f.current if p.rank != 0]))


def lowered_steps_reached(f: Facts) -> Decision | None:
    """``spec.training.steps`` was lowered below the count the running attempt was created with, and that attempt
    has checkpointed at or past the new count: the run is done. It succeeds now and its pods are stopped
    (gracefully; the trainer would otherwise train on to its own count)."""
    trained, ck, steps = f.obs.attempt_steps, f.obs.progress.last_checkpoint_step, f.spec.training.steps
    if not f.current or trained is None or trained <= steps or ck is None or ck < steps:
        return None
    return Decision(Action.SUCCEED, C.COMPLETED, f"training reached step {ck} (checkpoint saved), at or past "
                    f"spec.training.steps={steps}, which was lowered while the attempt ran with {trained}; its pods "
                    "are stopped", delete=tuple(p.name for p in f.current if not p.deleting))


def attempt_not_created(f: Facts) -> Decision | None:
    """No pod of the current attempt: create them, unless a blocked spec change or the restart backoff waits."""
    if f.current:
        return None
    if f.obs.spec_block:
        return Decision(Action.WAIT, C.RESTART_BLOCKED, f"attempt {f.attempt} cannot start: {f.obs.spec_block}")
    last = f.status.restarts[-1] if f.status.restarts else None
    if last is not None and last.attempt == f.attempt - 1 and last.cause == "Grow":
        saving = [p for p in f.previous if p.attempt == last.attempt and p.phase not in ("Succeeded", "Failed")
                  and not node_failed(f.obs.nodes.get(p.node_name) if p.node_name else None)]
        if saving:  # a planned grow: save, then re-create (the new gang resumes the checkpoint the old one saves)
            return Decision(Action.WAIT, C.RESIZING, f"attempt {f.attempt} ({last.to_nodes} nodes) starts once the "
                            f"{len(saving)} pod(s) of attempt {last.attempt} have saved their checkpoint and exited")
    if last is not None and last.attempt == f.attempt - 1:
        backoff = backoff_seconds(f.spec, f.status.restarts)
        ready_at = (parse_time(last.time) or f.now) + backoff
        if f.now < ready_at:
            return Decision(Action.WAIT, C.BACKOFF, f"attempt {f.attempt} starts at {iso(ready_at)} (restart "
                            f"backoff of {backoff:g}s)", requeue_after=ready_at - f.now)
    return _create(f, f"creating the {attempt_size(f)} pods of attempt {f.attempt}")


def attempt_size(f: Facts) -> int:
    """The gang size of an attempt created now: ``resources.nodes``; for an elastic run the size its last resize set
    (``status.nodes``), within ``minNodes..maxNodes``."""
    if f.rp.elastic is None:
        return f.spec.resources.nodes
    sizes = elastic_sizes(f.spec)
    n = f.status.nodes if f.status.nodes is not None else f.spec.resources.nodes
    return min(max(n, sizes.start), sizes.stop - 1)


def _create(f: Facts, message: str) -> Decision:
    errs = f.obs.child_errors
    if errs:
        e = errs[0]
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        message = f"{message}; {e.account()}{more}; retrying"
    n = f.nodes if f.current else attempt_size(f)  # missing ranks of a live attempt: its own size
    return Decision(Action.CREATE, C.CREATING, message, avoid_nodes=nodes_to_avoid(f.status.restarts), nodes=n)


def ranks_missing(f: Facts) -> Decision | None:
    """Ranks never seen (a create that failed, or not done yet): create them, no restart."""
    ranks = {p.rank for p in f.current}
    missing = [r for r in range(f.nodes) if r not in ranks]  # the attempt's own gang: never a rank more
    if not missing:
        return None
    return _create(f, f"creating the missing pod(s) of rank {', '.join(map(str, missing))} of attempt {f.attempt}")


def unschedulable(f: Facts) -> Decision | None:
    """Pods not placed: wait up to ``unschedulableTimeoutSeconds``, then report (or fail)."""
    unscheduled = [p for p in f.current if p.unschedulable_message is not None]
    if not unscheduled:
        return None
    oldest = min((p.created for p in f.current if p.created is not None), default=f.now)
    waited = f.now - oldest
    msg = f"{len(unscheduled)}/{len(f.current)} pods of attempt {f.attempt} cannot be scheduled (since " \
          f"{iso(oldest)}): {unscheduled[0].unschedulable_message}"
    if waited >= f.rp.unschedulable_timeout_seconds:
        if f.rp.unschedulable_action == "Fail":
            return Decision(Action.FAIL, C.UNSCHEDULABLE_TIMEOUT, msg + " (runPolicy.unschedulableAction=Fail)",
                            delete=cleanup(f.spec, f.current), unschedulable=True)
        return Decision(Action.WAIT, C.PODS_UNSCHEDULABLE, msg, unschedulable=True)
    return Decision(Action.WAIT, C.WAITING_FOR_NODES, msg, requeue_after=f.rp.unschedulable_timeout_seconds - waited)


ENDS_ATTEMPT = frozenset({Action.RESTART, Action.FAIL, Action.SUCCEED, Action.SUSPEND, Action.FINISHED,
                          Action.CONTINUE})
"""Decisions after which the current attempt's pods are never scheduled again (a new attempt, or none)."""


def attempt_pod_groups(f: Facts, d: Decision) -> tuple[str, ...]:
    """The PodGroups of ended attempts, deleted with their pods: those the pods of earlier attempts name, and the
    current attempt's when ``d`` ends it (its pods may be gone before the next cycle sees them as an earlier
    attempt's). Never the PodGroup of an attempt that goes on: a rank created again would wait for it forever."""
    ended = [*f.previous, *(f.current if d.action in ENDS_ATTEMPT or d.ends_attempt else ())]
    return tuple(dict.fromkeys(p.pod_group for p in ended if p.pod_group))
