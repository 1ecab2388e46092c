"""The restart decision (pure: no kopf, no client, no clock).

``decide(spec, status, observed)`` looks at what the cluster shows for one LlamaPretrain and returns
one :class:`Decision`: create the current attempt's children, keep running, wait, restart the gang
with a cause, fail, succeed, suspend, or clean up a finished run. The decision is the first answer of
an ordered list of small named rules (:data:`RULES`, JobSet's failure-policy style): each rule reads
the :class:`Facts` of this cycle and either decides or passes (None). ``kubetitan.status`` turns the
decision into the new status; the kopf handlers only observe, call these two, write the status once,
then delete/create what the decision lists and send its events.

Any failure of one pod ends the whole attempt (gang); the next attempt has new pod names and resumes
from the newest complete checkpoint, so a pod stuck terminating never blocks it.

Observation is not failure: a failed scrape of rank 0's metrics never restarts a run. The hang and
start-up timers fire only on positive evidence (rank 0's metrics answered and showed no new step);
they are measured from times kept in the status (``status.observation``), so an operator restart or
fail-over neither resets nor fires them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kubetitan import conditions as C
from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus, RestartCause, RestartRecord, elastic_sizes
from kubetitan_core import causes, hang
from kubetitan_core.causes import RESIZE_CAUSES
from kubetitan_core.contract import EXIT_SIGKILL, EXIT_SIGTERM, ExitCode
from kubetitan.observation import NodeObs, Observed, PodObs
from kubetitan.timestamps import iso, iso_ms, parse_time

MAX_RESTART_RECORDS = 50
NODE_FAILURES_TO_AVOID = causes.by_id("NodeFailure").avoid_node_after
"""A node blamed for this many ``NodeFailure`` restarts of the run is kept out of later attempts (anti-affinity);
each cause's own number is its row's ``avoid_node_after`` (``GPUXidError``: 1)."""
DELETED_EXIT_CODES = frozenset({int(ExitCode.TERMINATED_CHECKPOINTED), EXIT_SIGTERM, EXIT_SIGKILL})
"""Exit codes of a pod that stopped because it was deleted (saved on SIGTERM, or killed after the grace)."""


# ------------------------------------------------------------------ decision
class Action(str, enum.Enum):
    CREATE = "Create"
    """Create the current attempt's children (all that are missing; AlreadyExists is success)."""
    KEEP = "Keep"
    """Nothing to change; the attempt is starting or training."""
    WAIT = "Wait"
    """Wait (backoff, unschedulable, node grace, blocked spec change) and look again."""
    RESTART = "Restart"
    """End the attempt (delete its pods) and move to the next one after the backoff."""
    FAIL = "Fail"
    SUCCEED = "Succeed"
    SUSPEND = "Suspend"
    FINISHED = "Finished"
    """The run is over; only clean-up and TTL remain."""
    RESTARTED_IN_PLACE = "RestartedInPlace"
    """The launchers restarted every rank's workers in the same pods: record it; delete nothing."""
    CONTINUE = "Continue"
    """The attempt finished its own step count but the spec asks for more: end it (nothing failed, no restart) and
    let the next attempt resume from its final checkpoint."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    """A conditions.* reason constant."""
    message: str = ""
    cause: RestartCause | None = None
    node_name: str | None = None
    delete: tuple[str, ...] = ()
    """Pods to delete gracefully (the trainer checkpoints on SIGTERM)."""
    force_delete: tuple[str, ...] = ()
    """Pods to delete with grace period 0 (their node is gone)."""
    avoid_nodes: tuple[str, ...] = ()
    requeue_after: float | None = None
    unschedulable: bool = False
    delete_self: bool = False
    """TTL after finished has passed: delete the LlamaPretrain."""
    ready: bool = False
    """The current attempt trains."""
    ends_attempt: bool = False
    """Suspension (or ``Action.CONTINUE``) stopped the current attempt's pods: a new attempt follows."""
    rule: str = ""
    """Name of the rule that decided (for logs and tests)."""
    stale_status: bool = False
    """The status is older than the cluster (pods of a newer attempt exist): re-read it before acting."""
    recreate: tuple[str, ...] = ()
    """ConfigMap/Service names to create again while the attempt goes on (they were deleted by hand)."""
    nodes: int | None = None
    """``Action.CREATE``: the attempt's gang size; ``Action.RESTART`` with cause Shrink/Grow: the next attempt's."""
    grow_plan: tuple[int, int] | None = None
    """A grow planned this cycle: (the size, the checkpoint step a newer complete checkpoint must follow)."""
    cancel_grow: bool = False
    """A planned grow no longer fits the nodes: forget it."""
    delete_pod_groups: tuple[str, ...] = ()
    """PodGroups of ended attempts to delete (``attempt_pod_groups``): an earlier attempt's, and the current one's
    when the decision ends it."""


# ------------------------------------------------------------------ helpers
def made_progress(records: Sequence[RestartRecord], i: int) -> bool:
    """Did the attempt that ended in ``records[i]`` advance past the step it started from?"""
    r = records[i]
    if r.lost_steps is None:
        return False
    start = (records[i - 1].resumed_from_step or 0) if i > 0 else 0
    return (r.resumed_from_step or 0) + r.lost_steps > start


def trailing_without_progress(records: Sequence[RestartRecord]) -> int:
    records = [r for r in records if r.cause not in RESIZE_CAUSES]  # a resize has its own budget (maxResizes)
    n = 0
    for i in range(len(records) - 1, -1, -1):
        if made_progress(records, i):
            break
        n += 1
    return n


def backoff_seconds(spec: LlamaPretrainSpec, records: Sequence[RestartRecord]) -> float:
    """Delay before the attempt after ``records[-1]``: doubles per earlier failure without progress."""
    rp = spec.run_policy
    if records and records[-1].cause in RESIZE_CAUSES:
        return 0.0  # a planned resize (or a shrink that waited shrinkAfterSeconds already) starts at once
    k = trailing_without_progress(records[:-1]) if records and not made_progress(records, len(records) - 1) else 0
    return float(min(rp.max_backoff_seconds, rp.backoff_seconds * (2 ** min(k, 30))))


def nodes_to_avoid(records: Sequence[RestartRecord], table: Sequence[causes.Cause] = causes.CAUSES) -> tuple[str, ...]:
    """Nodes blamed often enough in this run to keep out of later attempts: by causes whose row blames the node
    (``avoid_node_after``: ``NodeFailure`` twice, ``GPUXidError`` once). A crashed or killed container
    (ContainerFailed, OOMKilled, NonFiniteLoss, ...) says nothing about its node: counting those would, after a few
    ordinary crashes, exclude every node the gang can use and leave the next attempt unschedulable."""
    return causes.avoided_nodes(((r.node_name, r.cause) for r in records), table)


@dataclass(frozen=True)
class Failure:
    cause: RestartCause | None
    """None for failures that are never retried (``fatal_reason`` says which)."""
    message: str
    pod: str
    node_name: str | None = None
    fatal_reason: str | None = None


def classify_pod(p: PodObs, table: Sequence[causes.Cause] = causes.CAUSES) -> Failure | None:
    """Why this pod ends its attempt, or None if it does not (yet). The evidence is read in a fixed order (the
    kubelet cannot start the container; the pod was evicted or its node is going; an exit code that ends the run;
    a cause detected in the termination message; the container's terminated reason; a deletion by someone else; a
    preemption; the exit code); which cause each piece of evidence means, and whether it is retried, is
    ``table``'s (:data:`kubetitan_core.causes.CAUSES`)."""
    if (c := causes.by_waiting_reason(p.waiting_reason, table)) is not None:
        msg = f"pod {p.name}: {p.waiting_reason}: {p.waiting_message or ''}".rstrip(": ")
        return _failure(c, msg + (f"; {c.fix}" if c.fix else ""), p)
    if (c := causes.by_pod_reason(p.reason, table)) is not None:
        return _failure(c, f"pod {p.name} was evicted from node {p.node_name}: {p.message or ''}".rstrip(": "), p)
    if (c := causes.by_disruption(p.disruption_reason, table)) is not None and c.avoid_node_after is not None \
            and p.phase not in ("Succeeded",) and p.exit_code != ExitCode.OK:
        # a disruption that blames the node (its row's avoid_node_after): the node is going or gone, and the pod is
        # lost whether or not its container has reported an exit yet
        what = f"pod {p.name} (rank {p.rank})" + (f" exited with code {p.exit_code}" if p.exit_code is not None
                                                   else " is being removed")
        return _failure(c, f"{what}: {p.disruption_reason} on node {p.node_name}", p)
    if p.phase not in ("Failed", "Succeeded") and p.exit_code is None:
        return None
    if p.phase == "Succeeded" or p.exit_code == ExitCode.OK:
        return None  # a finished rank is not a failure; rank 0 decides success
    return _exited(p, table)


def _exited(p: PodObs, table: Sequence[causes.Cause]) -> Failure:
    """A trainer container that exited with a non-zero code (or a Failed pod): the rest of ``classify_pod``."""
    code = p.exit_code
    tail = f": {p.termination_message.strip()}" if p.termination_message else ""
    what = f"pod {p.name} (rank {p.rank}) exited with code {code}"
    coded = causes.by_exit_code(code, table)
    if coded is not None and not coded.retried:
        return _failure(coded, f"{what}{coded.observed}{tail}; {coded.fix}", p)
    if (found := causes.by_message(p.termination_message, table)) is not None:
        c, seen = found
        return _failure(c, f"{what}: {seen}{c.observed}" + (f"; {c.fix}" if c.fix else "") + tail, p)
    if (c := causes.by_terminated_reason(p.terminated_reason, table)) is not None:
        return _failure(c, f"{what}{c.observed}" + (f" ({c.fix})" if c.fix else ""), p)
    if p.deleting and p.disruption_reason is None and code in DELETED_EXIT_CODES:
        # the operator deletes the current attempt's pods only when it ends the attempt (then they are an earlier
        # attempt's) or suspends the run (decided before this): someone else deleted this one
        return _failure(causes.by_id("PodDeleted", table), f"{what} after it was deleted, not by the operator{tail}", p)
    if (c := causes.by_disruption(p.disruption_reason, table)) is not None:
        return _failure(c, f"{what} after preemption", p)
    if coded is not None and code not in (EXIT_SIGKILL, EXIT_SIGTERM):
        return _failure(coded, f"{what}{coded.observed}{tail}", p)
    if code in (EXIT_SIGKILL, EXIT_SIGTERM):
        return _failure(causes.by_id(causes.CONTAINER_FAILED, table), f"{what} (killed by signal {code - 128}){tail}", p)
    return _failure(causes.by_id(causes.CONTAINER_FAILED, table), f"{what}{tail}", p)


def _failure(c: causes.Cause, message: str, p: PodObs) -> Failure:
    """``c``'s failure of pod ``p``: a restart cause, or (a cause that is not retried) the run's failure reason."""
    if c.retried:
        return Failure(c.id, message, p.name, p.node_name)  # type: ignore[arg-type]
    return Failure(None, message, p.name, p.node_name, c.id)


def _cleanup(spec: LlamaPretrainSpec, pods: Sequence[PodObs]) -> tuple[str, ...]:
    """Pods that ``runPolicy.cleanupPolicy`` removes when the run ends (None keeps failed pods for logs)."""
    policy = spec.run_policy.cleanup_policy
    if policy == "All":
        return tuple(p.name for p in pods if not p.deleting)
    if policy == "Running":
        return tuple(p.name for p in pods if not p.deleting and p.phase in ("Pending", "Running", "Unknown"))
    return ()


def _node_failed(n: NodeObs | None) -> bool:
    return n is not None and (not n.exists or n.ready is not True)


# ------------------------------------------------------------------ facts
@dataclass(frozen=True)
class Facts:
    """What every rule reads, computed once per decision."""

    spec: LlamaPretrainSpec
    status: LlamaPretrainStatus
    obs: Observed
    attempt: int
    current: tuple[PodObs, ...]
    """Pods of the status's current attempt."""
    previous: tuple[PodObs, ...]
    """Pods of earlier attempts (deleted first; never pods of a newer attempt)."""
    newer: tuple[PodObs, ...]
    """Pods of an attempt after the status's: the status is stale (another replica moved on)."""

    @property
    def now(self) -> float:
        return self.obs.now

    @property
    def rp(self):  # noqa: ANN201 - RunPolicy
        return self.spec.run_policy

    @property
    def nodes(self) -> int:
        """The current attempt's gang size: ``status.nodes``, else the spec it was created from, else the spec's."""
        if self.status.nodes is not None:
            return self.status.nodes
        return self.obs.attempt_nodes if self.obs.attempt_nodes is not None else self.spec.resources.nodes

    @property
    def rank0(self) -> PodObs | None:
        return next((p for p in self.current if p.rank == 0), None)

    def stuck(self) -> tuple[str, ...]:
        """Earlier attempts' pods stuck terminating on a failed node past the grace: forced out."""
        out = []
        for p in self.previous:
            n = self.obs.nodes.get(p.node_name) if p.node_name else None
            if p.deleting and _node_failed(n):
                assert n is not None
                if self.now - (n.not_ready_since or self.now) >= self.rp.node_failure_grace_seconds:
                    out.append(p.name)
        return tuple(out)


def facts(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, obs: Observed) -> Facts:
    attempt = status.attempt if status.attempt is not None else 0
    return Facts(spec=spec, status=status, obs=obs, attempt=attempt,
                 current=tuple(p for p in obs.pods if p.attempt == attempt),
                 previous=tuple(p for p in obs.pods if p.attempt < attempt),
                 newer=tuple(p for p in obs.pods if p.attempt > attempt))


Rule = Callable[[Facts], "Decision | None"]


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
    return Decision(Action.FINISHED, delete=_cleanup(f.spec, f.current), delete_self=expired,
                    requeue_after=None if ttl is None or expired else done + ttl - f.now)


def deadline_exceeded(f: Facts) -> Decision | None:
    """``runPolicy.activeDeadlineSeconds`` of the whole run."""
    start = parse_time(f.status.start_time)
    limit = f.rp.active_deadline_seconds
    if limit is None or start is None or f.now - start < limit:
        return None
    return Decision(Action.FAIL, C.DEADLINE_EXCEEDED, f"the run exceeded runPolicy.activeDeadlineSeconds={limit}",
                    delete=_cleanup(f.spec, f.current))


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
    return Decision(Action.SUCCEED, C.COMPLETED, msg, delete=_cleanup(f.spec, [p for p in f.current if p.rank != 0]))


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
                  and not _node_failed(f.obs.nodes.get(p.node_name) if p.node_name else None)]
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


# ------------------------------------------------------------------ elastic (runPolicy.elastic)
def _resize_blocked(f: Facts) -> str | None:
    """Why no resize may start now (the budget, the admin's interval), or None."""
    e = f.rp.elastic
    assert e is not None
    if f.status.resize_count >= e.max_resizes:
        return f"runPolicy.elastic.maxResizes={e.max_resizes} resizes are used up"
    last = next((r for r in reversed(f.status.restarts) if r.cause in RESIZE_CAUSES), None)
    at = parse_time(last.time) if last is not None else None
    cap = f.obs.resize_min_interval_seconds
    if at is not None and f.now - at < cap:
        return f"the last resize was at {iso(at)} and the operator allows one per {cap:g}s " \
               "(--resize-min-interval-seconds)"
    return None


def _saving(f: Facts) -> bool:
    """A checkpoint save is in progress: the step is a checkpoint step newer than the newest complete checkpoint, and
    the step stood still for less than ``checkpoint.saveTimeoutSeconds`` (a save that outlived it is not one)."""
    pr, ck = f.obs.progress, f.spec.checkpoint
    if pr.step is None or not ck.enabled:
        return False
    last_step = min(f.spec.training.steps, f.obs.attempt_steps or f.spec.training.steps)
    if not hang.save_window(pr.step, last_step, ck.enabled, ck.interval_steps):
        return False
    if pr.last_checkpoint_step is not None and pr.last_checkpoint_step >= pr.step:
        return False
    since = pr.last_progress_time if pr.last_progress_time is not None else f.now
    return f.now - since < ck.save_timeout_seconds


def _resize(f: Facts, cause: RestartCause, to: int, message: str, force: tuple[str, ...] = ()) -> Decision:
    """End the attempt to re-create it at ``to`` nodes (a restart with its own budget, ``elastic.maxResizes``)."""
    end = tuple(p.name for p in f.current if not p.deleting and p.name not in force)
    return Decision(Action.RESTART, C.RESIZING, message, cause=cause, delete=end, force_delete=force, nodes=to)


def shrink(f: Facts) -> Decision | None:
    """Elastic: a node of the attempt is lost (NotReady or missing) or a pod of it is not placed, and the schedulable
    nodes cannot make up the gang. Wait ``shrinkAfterSeconds`` for a replacement (from when the node was lost or the
    pod created), then end the attempt (cause Shrink) and re-create it at the largest size the nodes fit, never below
    ``minNodes``. With a replacement schedulable, a shrink left in the budget or a shrink not allowed (below
    ``minNodes``, ``maxResizes``, the admin's interval, a save in progress), the ordinary rules decide (NodeFailure
    at the same size, Unschedulable)."""
    e, cap = f.rp.elastic, f.obs.capacity
    if e is None or cap is None or not f.current:
        return None
    lost: list[tuple[PodObs, float]] = []
    for p in f.current:
        n = f.obs.nodes.get(p.node_name) if p.node_name else None
        if _node_failed(n) and p.phase not in ("Succeeded", "Failed"):
            assert n is not None
            lost.append((p, n.not_ready_since if n.not_ready_since is not None else f.now))
        elif p.node_name is None and p.phase == "Pending" and not p.deleting:
            lost.append((p, p.created if p.created is not None else f.now))
    if not lost:
        return None
    on_lost = {p.name for p, _ in lost}
    if any(classify_pod(p) is not None for p in f.current if p.name not in on_lost):
        return None  # another failure: pod_failed restarts at the same size
    size = f.nodes
    target = min(cap.schedulable, elastic_sizes(f.spec).stop - 1)
    if target >= size or target < e.min_nodes or _resize_blocked(f) is not None:
        return None
    since = min(t for _, t in lost)
    left = since + e.shrink_after_seconds - f.now
    first = lost[0][0]
    what = f"node {first.node_name} of pod {first.name} is lost" if first.node_name else \
        f"pod {first.name} (rank {first.rank}) cannot be placed"
    what += f" (+{len(lost) - 1} more)" if len(lost) > 1 else ""
    if _saving(f):  # never a resize mid-save: wait for it (or for checkpoint.saveTimeoutSeconds) before anything else
        pr = f.obs.progress
        wait = (pr.last_progress_time or f.now) + f.spec.checkpoint.save_timeout_seconds - f.now
        return Decision(Action.WAIT, C.WAITING_FOR_REPLACEMENT, f"{what} while the checkpoint of step {pr.step} is "
                        "being saved; the gang shrinks only after the save (at most checkpoint.saveTimeoutSeconds) "
                        "and runPolicy.elastic.shrinkAfterSeconds", requeue_after=max(0.05, wait))
    if left > 0:
        return Decision(Action.WAIT, C.WAITING_FOR_REPLACEMENT, f"{what} and only {cap.schedulable} node(s) fit the "
                        f"gang of {size}; shrinking to {target} at {iso(f.now + left)} unless a replacement comes "
                        "(runPolicy.elastic.shrinkAfterSeconds)", requeue_after=left)
    force = tuple(p.name for p, _ in lost if p.node_name and not p.deleting)
    return _resize(f, "Shrink", target, f"{what}; no replacement within runPolicy.elastic.shrinkAfterSeconds="
                   f"{e.shrink_after_seconds}: shrinking the gang from {size} to {target} nodes (the global batch is "
                   "kept by gradient accumulation)", force)


def grow(f: Facts) -> Decision | None:
    """Elastic: the gang trains below ``maxNodes`` and more nodes have been Ready and schedulable for
    ``growCheckSeconds``: plan a grow; once a complete checkpoint newer than the plan exists and no save is in
    progress, end the attempt (cause Grow; its pods save again on SIGTERM) and re-create it larger."""
    e, cap, pr = f.rp.elastic, f.obs.capacity, f.obs.progress
    if e is None or cap is None or not _all_running(f) or pr.step is None:
        return None
    size = f.nodes
    target = min(cap.stable, elastic_sizes(f.spec).stop - 1)
    o = f.obs.observation
    planned = o.grow_to if o is not None else None
    if target <= size or _resize_blocked(f) is not None:
        if planned is not None:
            return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training; the planned grow to "
                            f"{planned} nodes is called off ({_resize_blocked(f) or f'{cap.stable} node(s) fit'})",
                            ready=True, cancel_grow=True)
        return None
    after = o.grow_after_step if o is not None and o.grow_after_step is not None else None
    if planned is None or after is None:
        ck = pr.last_checkpoint_step if pr.last_checkpoint_step is not None else -1
        return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training on {size} nodes; {target} nodes have "
                        f"been Ready and schedulable for runPolicy.elastic.growCheckSeconds={e.grow_check_seconds}: "
                        f"it grows to {target} right after its next complete checkpoint", ready=True,
                        grow_plan=(target, ck))
    done = pr.last_checkpoint_step is not None and pr.last_checkpoint_step > after
    if not done or _saving(f):
        return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training on {size} nodes; grows to "
                        f"{target} right after its next complete checkpoint (newer than step {after})", ready=True)
    return _resize(f, "Grow", target, f"{target} nodes have been Ready and schedulable for "
                   f"runPolicy.elastic.growCheckSeconds={e.grow_check_seconds} and checkpoint step "
                   f"{pr.last_checkpoint_step} is complete: growing the gang from {size} to {target} nodes")


def pod_failed(f: Facts) -> Decision | None:
    """A failure of any pod, a lost node past its grace, or a rank that disappeared ends the attempt."""
    failed = [(p, x) for p in f.current if (x := classify_pod(p)) is not None]
    failures = [x for _, x in sorted(failed, key=lambda px: _root_first(*px))]
    failures += [x for x, _left in _lost_nodes(f) if x is not None]
    if not failures:
        gone = sorted(f.obs.ranks_seen - {p.rank for p in f.current})  # (one set: a gang's ranks squared was 1 M)
        if gone:
            failures.append(Failure("PodDeleted", f"pod(s) of rank {', '.join(map(str, gone))} of attempt {f.attempt} "
                                    "disappeared (deleted, not by the operator)", "", None))
    if not failures:
        return None
    fatal = next((x for x in failures if x.cause is None), None)
    lost = {x.node_name for x in failures if x.cause == "NodeFailure"}
    force = tuple(p.name for p in f.current if p.node_name in lost and not p.deleting)
    if fatal is not None:
        return Decision(Action.FAIL, fatal.fatal_reason or C.CONFIG_ERROR, f"{fatal.message} (not retried)",
                        delete=_cleanup(f.spec, f.current), force_delete=force, node_name=fatal.node_name)
    first = failures[0]
    extra = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
    return restart_or_fail(f, replace(first, message=first.message + extra), force)


def _root_first(p: PodObs, x: Failure) -> tuple[float, int, int]:
    """Which of several failed pods the restart names (the first in this order): the one that ended first, since
    the others most often ended because of it (a rank killed by the OOM killer takes its peers down with a
    connection reset a moment later: the record must say OOMKilled or "killed by signal 9", not the peers' exit 1).
    ``finishedAt`` has whole seconds, so within one second: a cause of its own (OOMKilled, a detected message, an
    eviction, ...) before a signal's kill before a plain non-zero exit, then the lower rank. A failure seen before
    its container ended (the kubelet cannot start it, an eviction, a node going) has no end time and comes first.
    Each node's kubelet stamps ``finishedAt`` by its own clock: a skew of a second or more between nodes can put
    the wrong pod first (the record then names a peer, as before this order existed)."""
    when = p.finished_at if p.finished_at is not None and p.exit_code is not None else float("-inf")
    if x.cause != causes.CONTAINER_FAILED:
        kind = 0
    elif p.exit_code in (EXIT_SIGKILL, EXIT_SIGTERM):
        kind = 1
    else:
        kind = 2
    return when, kind, p.rank


def _lost_nodes(f: Facts) -> list[tuple[Failure | None, float]]:
    """(failure past the grace, or None with the seconds left) per pod on a NotReady or missing node."""
    out: list[tuple[Failure | None, float]] = []
    for p in f.current:
        n = f.obs.nodes.get(p.node_name) if p.node_name else None
        if not _node_failed(n) or p.phase in ("Succeeded", "Failed"):
            continue
        assert n is not None
        since = n.not_ready_since if n.not_ready_since is not None else f.now
        left = since + f.rp.node_failure_grace_seconds - f.now
        state = "is missing" if not n.exists else "is NotReady"
        if left <= 0:
            out.append((Failure("NodeFailure", f"node {n.name} {state}; pod {p.name} (rank {p.rank}) is lost",
                                p.name, n.name), 0.0))
        else:
            out.append((None, left))
    return out


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
                            delete=_cleanup(f.spec, f.current), unschedulable=True)
        return Decision(Action.WAIT, C.PODS_UNSCHEDULABLE, msg, unschedulable=True)
    return Decision(Action.WAIT, C.WAITING_FOR_NODES, msg, requeue_after=f.rp.unschedulable_timeout_seconds - waited)


def node_grace(f: Facts) -> Decision | None:
    """A node of the attempt is NotReady or missing but still within ``nodeFailureGraceSeconds``."""
    left = [w for x, w in _lost_nodes(f) if x is None]
    if not left:
        return None
    wait = min(left)
    return Decision(Action.WAIT, C.WAITING_FOR_PODS, "a node of the attempt is NotReady or missing; the attempt "
                    f"ends at {iso(f.now + wait)} unless it comes back (runPolicy.nodeFailureGraceSeconds)",
                    requeue_after=wait, ready=f.obs.progress.step is not None and f.obs.progress.metrics_available
                    is not False)


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


def _all_running(f: Facts) -> bool:
    return bool(f.current) and all(p.phase == "Running" for p in f.current)


def hung(f: Facts) -> Decision | None:
    """No step progress for the hang limit (``kubetitan_core.hang``), seen while rank 0's metrics answer. The timer
    starts with the generation's first trained step: loading a checkpoint and the first step's warm-up/compile
    count as start-up. While the attempt may still restart in place, the launchers' watchdogs stop a worker
    that stands still first (an in-place restart, cause Hang); this rule waits ``IN_PLACE_GRACE_SECONDS`` longer
    and re-creates the gang only when they did not."""
    pr = f.obs.progress
    if not _all_running(f) or pr.first_step_time is None or pr.last_progress_time is None:
        return None
    if pr.metrics_available is not True or pr.metrics_ok_time is None:
        return None  # no evidence either way: an unreachable /metrics is reported, never a hang
    idle = pr.metrics_ok_time - pr.last_progress_time  # the step stood still while /metrics answered
    ck = f.spec.checkpoint
    base, how = hang_timeout(f)
    last_step = min(f.spec.training.steps, f.obs.attempt_steps or f.spec.training.steps)  # the trainer's own count
    saving = pr.step is not None and hang.save_window(pr.step, last_step, ck.enabled, ck.interval_steps)
    limit = hang.limit(base, saving, ck.save_timeout_seconds)
    in_place = _may_restart_in_place(f)
    if idle < limit + (hang.IN_PLACE_GRACE_SECONDS if in_place else 0.0):
        return None
    return restart_or_fail(f, Failure(
        "Hang", f"no step progress for {idle:.0f}s (step {pr.step}; {how}" + (
            f" + checkpoint.saveTimeoutSeconds={ck.save_timeout_seconds} after a checkpoint step"
            if saving else "") + (
            f"; the launchers did not restart in place within {hang.IN_PLACE_GRACE_SECONDS:g}s more"
            if in_place else "") + ")", "", None))


def _may_restart_in_place(f: Facts) -> bool:
    """The attempt's launchers still restart in place (``maxInPlaceRestarts`` not used up)."""
    return len(in_place_records(f)) < f.rp.max_in_place_restarts


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
    if not _all_running(f) or pr.first_step_time is not None or pr.metrics_available is not True \
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
    if _all_running(f):
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


def in_place_records(f: Facts) -> list[RestartRecord]:
    """The current attempt's in-place restarts recorded so far."""
    return [r for r in f.status.restarts if r.mode == "InPlace" and r.attempt == f.attempt]


def in_place_failure(f: Facts) -> Failure:
    """The worker failure that began the current generation, as rank 0's metrics report it."""
    pr = f.obs.progress
    code, rank = pr.restart_exit_code, pr.restart_node_rank
    pod = next((p for p in f.current if p.rank == rank), None) if rank is not None else None
    where = f"pod {pod.name} (rank {rank})" if pod else (f"rank {rank}" if rank is not None else "a pod")
    row = causes.by_exit_code(code) if code is not None else causes.by_id(causes.UNKNOWN)
    if row is None or not row.in_place:  # a code the launchers do not restart in place cannot have begun one
        row = causes.by_id(causes.CONTAINER_FAILED)
    cause: RestartCause = row.id  # type: ignore[assignment]
    if code is None:
        what = "a worker failed (no launcher reported which)"
    elif code == ExitCode.HANG and pod is None:  # no stopped worker: every rank's step stood still together
        what = (f"the step stood still for the hang limit on every rank and the launchers stopped "
                f"their workers (exit code {code}; no worker was stopped, so no one node is named)")
    elif code == ExitCode.HANG:
        what = (f"the step stood still for the hang limit and the launcher of {where} stopped its "
                f"workers (exit code {code})")
    elif code in (EXIT_SIGKILL, EXIT_SIGTERM):
        what = f"a worker of {where} was killed by signal {code - 128} (exit code {code})"
    else:
        what = f"a worker of {where} exited with code {code}{row.observed}"
    return Failure(cause, f"{what}; the launchers restarted every rank's workers in place (generation "
                   f"{pr.generation} of attempt {f.attempt})", pod.name if pod else "", pod.node_name if pod else None)


def in_place_record(status: LlamaPretrainStatus, failure: Failure | Decision, obs: Observed) -> RestartRecord:
    """The record of an in-place restart: timed from the failure the launcher saw; the work lost is what the
    previous generation trained past the checkpoint this one resumed from."""
    pr = obs.progress
    start = pr.start_step if pr.start_step is not None else pr.last_checkpoint_step
    prev = pr.previous_generation_step
    lost = None if prev is None else max(0, prev - (start or 0))
    return RestartRecord(
        attempt=status.attempt or 0, mode="InPlace", generation=pr.generation, cause=failure.cause or "Unknown",
        message=failure.message, time=iso_ms(pr.generation_start_time if pr.generation_start_time is not None
                                              else obs.now),
        node_name=failure.node_name, resumed_from_step=start or 0, lost_steps=lost,
    )


def restarted_in_place(f: Facts) -> Decision | None:
    """Rank 0's workers report a generation not recorded yet: the launchers restarted every rank's workers in
    place. Record it; or, when ``maxInPlaceRestarts`` of this attempt are used up or the same node failed in
    place twice in a row, re-create the gang (escalation); ``maxRestarts`` / ``maxRestartsWithoutProgress``
    still apply."""
    pr = f.obs.progress
    earlier = in_place_records(f)
    if pr.generation <= max((r.generation or 0 for r in earlier), default=0):
        return None
    failure = in_place_failure(f)
    rp = f.rp
    if len(earlier) >= rp.max_in_place_restarts:
        why = f"runPolicy.maxInPlaceRestarts={rp.max_in_place_restarts} in-place restarts of attempt {f.attempt} " \
              "are used up"
    elif failure.node_name and earlier and earlier[-1].node_name == failure.node_name:
        why = f"node {failure.node_name} failed in place twice in a row in attempt {f.attempt}"
    else:
        why = ""
    if why:
        return restart_or_fail(f, replace(failure, message=f"{failure.message}; {why}: re-creating the gang"))
    record = in_place_record(f.status, failure, f.obs)
    if f.status.restart_count >= rp.max_restarts or \
            trailing_without_progress([*f.status.restarts, record]) >= rp.max_restarts_without_progress + 1:
        return restart_or_fail(f, failure, record=record)
    return Decision(Action.RESTARTED_IN_PLACE, C.RESTARTED_IN_PLACE, failure.message, cause=failure.cause,
                    node_name=failure.node_name, ready=pr.first_step_time is not None)


RULES: tuple[Rule, ...] = (
    status_behind_cluster, finished, deadline_exceeded, suspended, steps_raised, rank0_succeeded,
    lowered_steps_reached, attempt_not_created,
    shrink, pod_failed, ranks_missing, restarted_in_place, unschedulable, node_grace, stuck_before_running, hung,
    startup_timed_out, grow, running,
)
"""The decision rules in order; ``decide`` returns the first one's answer that is not None."""


def restart_or_fail(f: Facts, failure: Failure, force: tuple[str, ...] = (),
                    record: RestartRecord | None = None) -> Decision:
    """End the attempt: restart it, unless ``maxRestarts`` or ``maxRestartsWithoutProgress`` are used up
    (``record``: the restart as it would be recorded, when not the gang's own)."""
    rp = f.rp
    if f.status.restart_count >= rp.max_restarts:
        return Decision(Action.FAIL, C.MAX_RESTARTS_EXCEEDED, f"{failure.message}; runPolicy.maxRestarts="
                        f"{rp.max_restarts} restarts are used up", cause=failure.cause,
                        delete=_cleanup(f.spec, f.current), force_delete=force, node_name=failure.node_name)
    pending = [*f.status.restarts, record or restart_record(f.status, failure, f.obs)]
    if trailing_without_progress(pending) >= rp.max_restarts_without_progress + 1:
        return Decision(Action.FAIL, C.NO_PROGRESS, f"{failure.message}; {rp.max_restarts_without_progress} "
                        "restarts in a row made no step progress (runPolicy.maxRestartsWithoutProgress)",
                        cause=failure.cause, delete=_cleanup(f.spec, f.current), force_delete=force,
                        node_name=failure.node_name)
    end = tuple(p.name for p in f.current if not p.deleting and p.name not in force)
    return Decision(Action.RESTART, C.RESTARTED, failure.message, cause=failure.cause, node_name=failure.node_name,
                    delete=end, force_delete=force)


def restart_record(status: LlamaPretrainStatus, f: Failure | Decision, obs: Observed) -> RestartRecord:
    pr = obs.progress
    ckpt = pr.last_checkpoint_step
    lost = None if pr.step is None else max(0, pr.step - (ckpt or 0))
    return RestartRecord(
        attempt=status.attempt or 0, cause=f.cause or "Unknown", message=f.message, time=iso(obs.now),
        node_name=f.node_name, resumed_from_step=ckpt if ckpt is not None else 0, lost_steps=lost,
    )


# ------------------------------------------------------------------ decide
def decide(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, obs: Observed,
           rules: Sequence[Rule] = RULES) -> Decision:
    """The first rule's answer, with the earlier attempts' pods added to what it deletes.

    Earlier attempts' pods always go (a pod stuck terminating on a dead node is forced out); pods of the
    current or a newer attempt are deleted only when a rule says so. A missing ConfigMap/Service of an attempt
    that goes on is listed in ``recreate``.
    """
    f = facts(spec, status, obs)
    for rule in rules:
        d = rule(f)
        if d is not None:
            break
    else:  # pragma: no cover - the last rule always answers
        raise AssertionError("no decision rule answered")
    if d.stale_status:
        return replace(d, rule=rule.__name__)
    force = tuple(dict.fromkeys(f.stuck() + d.force_delete))
    stale = tuple(p.name for p in f.previous if not p.deleting)
    delete = tuple(n for n in dict.fromkeys(stale + d.delete) if n not in force)
    # a ConfigMap/Service deleted by hand while the attempt goes on is created again at once (no restart); a
    # decision that creates the attempt's children creates it anyway, one that ends the attempt needs none
    recreate = obs.missing_children if f.current and d.action in (Action.KEEP, Action.WAIT) else ()
    return replace(d, delete=delete, force_delete=force, recreate=recreate, rule=rule.__name__,
                   delete_pod_groups=attempt_pod_groups(f, d))


ENDS_ATTEMPT = frozenset({Action.RESTART, Action.FAIL, Action.SUCCEED, Action.SUSPEND, Action.FINISHED,
                          Action.CONTINUE})
"""Decisions after which the current attempt's pods are never scheduled again (a new attempt, or none)."""


def attempt_pod_groups(f: Facts, d: Decision) -> tuple[str, ...]:
    """The PodGroups of ended attempts, deleted with their pods: those the pods of earlier attempts name, and the
    current attempt's when ``d`` ends it (its pods may be gone before the next cycle sees them as an earlier
    attempt's). Never the PodGroup of an attempt that goes on: a rank created again would wait for it forever."""
    ended = [*f.previous, *(f.current if d.action in ENDS_ATTEMPT or d.ends_attempt else ())]
    return tuple(dict.fromkeys(p.pod_group for p in ended if p.pod_group))


def restart_event(d: Decision, attempt: int, blocked: str | None = None) -> tuple[str, str, str] | None:
    """The Kubernetes Event (type, reason, message) a decision sends after the status write (``blocked``: why the
    next attempt cannot start, when it cannot)."""
    if d.action == Action.RESTART:
        nxt = f"attempt {attempt + 1} cannot start: {blocked}" if blocked else f"starting attempt {attempt + 1}"
        return "Warning", f"Restart{d.cause}", f"Attempt {attempt} ended: {d.message}; {nxt}"
    if d.action == Action.FAIL:
        return "Warning", d.reason, d.message
    if d.action in (Action.SUCCEED, Action.CONTINUE):
        return "Normal", d.reason, d.message
    if d.action == Action.RESTARTED_IN_PLACE:
        return "Warning", d.reason, f"Attempt {attempt}: {d.message}"
    return None


__all__ = [
    "ENDS_ATTEMPT", "RULES", "Action", "Decision", "Facts", "attempt_pod_groups", "backoff_seconds", "classify_pod",
    "decide", "facts", "hang_timeout", "in_place_record", "made_progress", "nodes_to_avoid", "restart_record",
]
