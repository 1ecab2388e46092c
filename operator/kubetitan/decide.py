"""The restart decision and the status it leads to (pure: no kopf, no client, no clock).

``decide(spec, status, observed)`` looks at what the cluster shows for one LlamaPretrain and returns
one :class:`Decision`: create the current attempt's children, keep running, wait, restart the gang
with a cause, fail, succeed, suspend, or clean up a finished run. ``next_status`` turns the decision
into the new status (conditions, attempt, restart history). The kopf handlers only observe, call
these two, write the status once, then delete/create what the decision lists and send its events.

Any failure of one pod ends the whole attempt (gang); the next attempt has new pod names and resumes
from the newest complete checkpoint, so a pod stuck terminating never blocks it.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kubetitan import conditions as C
from kubetitan.api import LlamaPretrainSpec, LlamaPretrainStatus, RestartCause, RestartRecord, TrainingStatus
from kubetitan.contract import EXIT_SIGKILL, EXIT_SIGTERM, ExitCode

MAX_RESTART_RECORDS = 50
NODE_FAILURES_TO_AVOID = 2
"""A node blamed for this many restarts of the run is kept out of later attempts (anti-affinity)."""
MISSING_POD_GRACE_SECONDS = 30.0
"""A rank missing this long after its siblings were created, or while they run, ends the attempt."""

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CONFIG_WAIT_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})


# ------------------------------------------------------------------ observed state
@dataclass(frozen=True)
class PodObs:
    """What matters about one training pod (see ``observe.pod_obs``)."""

    name: str
    attempt: int
    rank: int
    phase: str = "Pending"
    """Pod phase: Pending, Running, Succeeded, Failed, Unknown."""
    node_name: str | None = None
    pod_ip: str | None = None
    reason: str | None = None
    """``status.reason`` of the pod, e.g. ``Evicted``."""
    message: str | None = None
    waiting_reason: str | None = None
    """Trainer container waiting reason, e.g. ``ImagePullBackOff``."""
    waiting_message: str | None = None
    exit_code: int | None = None
    terminated_reason: str | None = None
    """Trainer container terminated reason, e.g. ``OOMKilled``, ``Error``, ``Completed``."""
    termination_message: str | None = None
    disruption_reason: str | None = None
    """Reason of the ``DisruptionTarget`` pod condition, e.g. ``PreemptionByScheduler``."""
    unschedulable_message: str | None = None
    """Set while the pod's ``PodScheduled`` condition is False with reason Unschedulable."""
    created: float | None = None
    running_since: float | None = None
    deleting: bool = False


@dataclass(frozen=True)
class NodeObs:
    """Health of a node that runs (or ran) a pod of the run."""

    name: str
    exists: bool = True
    ready: bool | None = True
    """Node ``Ready`` condition; None when Unknown (the kubelet stopped reporting)."""
    not_ready_since: float | None = None
    """``lastTransitionTime`` of a Ready condition that is not True."""


@dataclass(frozen=True)
class Progress:
    """Training progress of the current attempt, from rank 0's metrics (see ``observe``)."""

    step: int | None = None
    """Newest step this attempt reported (None: no step yet)."""
    start_step: int | None = None
    """Step the attempt started from (the checkpoint step it published after loading, else its first reported
    step minus one), when known."""
    last_checkpoint_step: int | None = None
    last_progress_time: float | None = None
    """When the step last advanced (the trainer's heartbeat, or when the operator saw it move)."""
    first_step_time: float | None = None
    """When the attempt's first trained step completed (its heartbeat; not the checkpoint load)."""


@dataclass(frozen=True)
class Observed:
    pods: tuple[PodObs, ...] = ()
    nodes: Mapping[str, NodeObs] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    now: float = 0.0
    generation: int | None = None
    spec_block: str | None = None
    """A spec change that the next attempt must not pick up (a message), or None."""
    spec_deferred: str | None = None
    """Spec changes that wait for the next attempt (a message), or None."""
    training: TrainingStatus | None = None
    """Freshly scraped numbers for ``status.training`` (None keeps the old ones)."""


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
    """Suspension stopped the current attempt's pods: resuming starts a new attempt."""


# ------------------------------------------------------------------ helpers
def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> float | None:
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def made_progress(records: Sequence[RestartRecord], i: int) -> bool:
    """Did the attempt that ended in ``records[i]`` advance past the step it started from?"""
    r = records[i]
    if r.lost_steps is None:
        return False
    start = (records[i - 1].resumed_from_step or 0) if i > 0 else 0
    return (r.resumed_from_step or 0) + r.lost_steps > start


def trailing_without_progress(records: Sequence[RestartRecord]) -> int:
    n = 0
    for i in range(len(records) - 1, -1, -1):
        if made_progress(records, i):
            break
        n += 1
    return n


def backoff_seconds(spec: LlamaPretrainSpec, records: Sequence[RestartRecord]) -> float:
    """Delay before the attempt after ``records[-1]``: doubles per earlier failure without progress."""
    rp = spec.run_policy
    k = trailing_without_progress(records[:-1]) if records and not made_progress(records, len(records) - 1) else 0
    return float(min(rp.max_backoff_seconds, rp.backoff_seconds * (2 ** min(k, 30))))


NODE_CAUSES: frozenset[str] = frozenset({"NodeFailure"})
"""Restart causes that blame the node itself. A crashed or killed container (ContainerFailed, OOMKilled,
NonFiniteLoss, ...) says nothing about its node: counting those would, after a few ordinary crashes,
exclude every node the gang can use and leave the next attempt unschedulable."""


def nodes_to_avoid(records: Sequence[RestartRecord]) -> tuple[str, ...]:
    """Nodes that failed (as nodes) at least ``NODE_FAILURES_TO_AVOID`` times in this run."""
    counts: dict[str, int] = {}
    for r in records:
        if r.node_name and r.cause in NODE_CAUSES:
            counts[r.node_name] = counts.get(r.node_name, 0) + 1
    return tuple(sorted(n for n, c in counts.items() if c >= NODE_FAILURES_TO_AVOID))


@dataclass(frozen=True)
class Failure:
    cause: RestartCause | None
    """None for failures that are never retried (``fatal_reason`` says which)."""
    message: str
    pod: str
    node_name: str | None = None
    fatal_reason: str | None = None


def classify_pod(p: PodObs) -> Failure | None:
    """Why this pod ends its attempt, or None if it does not (yet)."""
    if p.waiting_reason in IMAGE_PULL_REASONS:
        return Failure(None, f"pod {p.name}: {p.waiting_reason}: {p.waiting_message or 'cannot pull the image'}; "
                       "fix spec.resources.image (or imagePullSecrets)", p.name, p.node_name, C.IMAGE_PULL_FAILED)
    if p.waiting_reason in CONFIG_WAIT_REASONS:
        return Failure(None, f"pod {p.name}: {p.waiting_reason}: {p.waiting_message or ''}".rstrip(": "),
                       p.name, p.node_name, C.CONFIG_ERROR)
    if p.reason == "Evicted":
        return Failure("Evicted", f"pod {p.name} was evicted from node {p.node_name}: {p.message or ''}".rstrip(": "),
                       p.name, p.node_name)
    if p.phase not in ("Failed", "Succeeded") and p.exit_code is None:
        return None
    if p.phase == "Succeeded" or p.exit_code == ExitCode.OK:
        return None  # a finished rank is not a failure; rank 0 decides success
    code = p.exit_code
    tail = f": {p.termination_message.strip()}" if p.termination_message else ""
    what = f"pod {p.name} (rank {p.rank}) exited with code {code}"
    if code == ExitCode.CONFIG_ERROR:
        return Failure(None, f"{what} (configuration error){tail}; fix the spec and re-apply",
                       p.name, p.node_name, C.CONFIG_ERROR)
    if p.terminated_reason == "OOMKilled":
        return Failure("OOMKilled", f"{what}: OOMKilled (raise spec.resources.memory or lower the batch)",
                       p.name, p.node_name)
    if p.disruption_reason == "PreemptionByScheduler" or p.disruption_reason == "PreemptionByKubeScheduler":
        return Failure("Preempted", f"{what} after preemption", p.name, p.node_name)
    if p.disruption_reason in ("DeletionByTaintManager", "TerminationByKubelet"):
        return Failure("NodeFailure", f"{what}: {p.disruption_reason} on node {p.node_name}", p.name, p.node_name)
    if code == ExitCode.TERMINATED_CHECKPOINTED:
        return Failure("Preempted", f"{what} (SIGTERM, checkpoint saved)", p.name, p.node_name)
    if code == ExitCode.NON_FINITE_LOSS:
        return Failure("NonFiniteLoss", f"{what}: the loss became NaN/inf{tail}", p.name, p.node_name)
    if code in (EXIT_SIGKILL, EXIT_SIGTERM):
        return Failure("ContainerFailed", f"{what} (killed by signal {code - 128}){tail}", p.name, p.node_name)
    return Failure("ContainerFailed", f"{what}{tail}", p.name, p.node_name)


def _cleanup(spec: LlamaPretrainSpec, pods: Sequence[PodObs]) -> tuple[str, ...]:
    policy = spec.run_policy.cleanup_policy
    if policy == "All":
        return tuple(p.name for p in pods if not p.deleting)
    if policy == "Running":
        return tuple(p.name for p in pods if not p.deleting and p.phase in ("Pending", "Running", "Unknown"))
    return ()


def _node_failed(n: NodeObs | None) -> bool:
    return n is not None and (not n.exists or n.ready is not True)


# ------------------------------------------------------------------ decide
def decide(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, obs: Observed) -> Decision:  # noqa: C901
    now, rp = obs.now, spec.run_policy
    attempt = status.attempt if status.attempt is not None else 0
    current = [p for p in obs.pods if p.attempt == attempt]
    previous = [p for p in obs.pods if p.attempt != attempt]

    # Earlier attempts' pods go first; a pod stuck terminating on a dead node is forced out.
    stale = tuple(p.name for p in previous if not p.deleting)
    stuck = tuple(
        p.name for p in previous
        if p.deleting and p.node_name and _node_failed(obs.nodes.get(p.node_name))
        and now - (obs.nodes[p.node_name].not_ready_since or now) >= rp.node_failure_grace_seconds
    )

    # 1. Finished runs: clean up, then the TTL.
    if C.is_true(status.conditions, C.SUCCEEDED) or C.is_true(status.conditions, C.FAILED):
        done = parse_time(status.completion_time) or now
        ttl = rp.ttl_seconds_after_finished
        expired = ttl is not None and now >= done + ttl
        return Decision(Action.FINISHED, delete=stale + _cleanup(spec, current), force_delete=stuck,
                        delete_self=expired,
                        requeue_after=None if ttl is None or expired else done + ttl - now)

    # 2. Active deadline of the whole run.
    start = parse_time(status.start_time)
    if rp.active_deadline_seconds is not None and start is not None and now - start >= rp.active_deadline_seconds:
        return Decision(Action.FAIL, C.DEADLINE_EXCEEDED,
                        f"the run exceeded runPolicy.activeDeadlineSeconds={rp.active_deadline_seconds}",
                        delete=stale + _cleanup(spec, current), force_delete=stuck)

    # 3. Suspension: stop every pod gracefully (each rank checkpoints on SIGTERM).
    if rp.suspend:
        live = [p for p in current if not p.deleting]
        return Decision(Action.SUSPEND, C.SUSPENDED_BY_USER if not live else C.SUSPENDING,
                        "suspended by runPolicy.suspend; set it to false to resume from the newest checkpoint",
                        delete=stale + tuple(p.name for p in live), force_delete=stuck, ends_attempt=bool(live))

    # 4. Rank 0 finished the run.
    rank0 = next((p for p in current if p.rank == 0), None)
    if rank0 is not None and (rank0.phase == "Succeeded" or rank0.exit_code == ExitCode.OK):
        return Decision(Action.SUCCEED, C.COMPLETED, f"training reached step {spec.training.steps}",
                        delete=stale + _cleanup(spec, [p for p in current if p.rank != 0]), force_delete=stuck)

    # 5. No pods of the current attempt: create them (after the restart backoff).
    if not current:
        if obs.spec_block:
            return Decision(Action.WAIT, C.IMMUTABLE_FIELD_CHANGED, obs.spec_block, delete=stale,
                            force_delete=stuck)
        last = status.restarts[-1] if status.restarts else None
        if last is not None and last.attempt == attempt - 1:
            ready_at = (parse_time(last.time) or now) + backoff_seconds(spec, status.restarts)
            if now < ready_at:
                return Decision(Action.WAIT, C.BACKOFF,
                                f"attempt {attempt} starts in {ready_at - now:.0f}s (restart backoff)",
                                delete=stale, force_delete=stuck, requeue_after=ready_at - now)
        return Decision(Action.CREATE, C.CREATING, f"creating the {spec.resources.nodes} pods of attempt {attempt}",
                        delete=stale, force_delete=stuck, avoid_nodes=nodes_to_avoid(status.restarts))

    # 6. A failure of any pod ends the attempt.
    failures = [f for p in current if (f := classify_pod(p)) is not None]
    node_wait: float | None = None
    for p in current:
        n = obs.nodes.get(p.node_name) if p.node_name else None
        if _node_failed(n) and p.phase not in ("Succeeded", "Failed"):
            assert n is not None
            since = n.not_ready_since if n.not_ready_since is not None else now
            left = since + rp.node_failure_grace_seconds - now
            state = "is missing" if not n.exists else "is NotReady"
            if left <= 0:
                failures.append(Failure("NodeFailure", f"node {n.name} {state}; pod {p.name} (rank {p.rank}) "
                                        "is lost", p.name, n.name))
            else:
                node_wait = left if node_wait is None else min(node_wait, left)
    ranks = {p.rank for p in current}
    missing = [r for r in range(spec.resources.nodes) if r not in ranks]
    if missing and not failures:
        oldest = min((p.created for p in current if p.created is not None), default=now)
        progressed = any(p.phase != "Pending" for p in current)
        if progressed or now - oldest >= MISSING_POD_GRACE_SECONDS:
            failures.append(Failure("Unknown", f"pod(s) of rank {', '.join(map(str, missing))} of attempt "
                                    f"{attempt} disappeared", "", None))
        else:
            return Decision(Action.CREATE, C.CREATING, f"creating the missing pods of attempt {attempt}",
                            delete=stale, force_delete=stuck, avoid_nodes=nodes_to_avoid(status.restarts))

    if failures:
        fatal = next((f for f in failures if f.cause is None), None)
        end = tuple(p.name for p in current if not p.deleting)
        lost_nodes = {f.node_name for f in failures if f.cause == "NodeFailure"}
        force = stuck + tuple(p.name for p in current if p.node_name in lost_nodes)
        graceful = stale + tuple(n for n in end if n not in force)
        if fatal is not None:
            return Decision(Action.FAIL, fatal.fatal_reason or C.CONFIG_ERROR, f"{fatal.message} (not retried)",
                            delete=stale + _cleanup(spec, current), force_delete=force, node_name=fatal.node_name)
        first = failures[0]
        extra = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        if status.restart_count >= rp.max_restarts:
            return Decision(Action.FAIL, C.MAX_RESTARTS_EXCEEDED,
                            f"{first.message}{extra}; runPolicy.maxRestarts={rp.max_restarts} restarts are used up",
                            cause=first.cause, delete=graceful, force_delete=force, node_name=first.node_name)
        pending = [*status.restarts, _record(status, first, obs)]
        if trailing_without_progress(pending) >= rp.max_restarts_without_progress + 1:
            return Decision(Action.FAIL, C.NO_PROGRESS,
                            f"{first.message}{extra}; {rp.max_restarts_without_progress} restarts in a row made "
                            "no step progress (runPolicy.maxRestartsWithoutProgress)",
                            cause=first.cause, delete=graceful, force_delete=force, node_name=first.node_name)
        return Decision(Action.RESTART, C.RESTARTED, first.message + extra, cause=first.cause,
                        node_name=first.node_name, delete=graceful, force_delete=force)

    # 7. Scheduling: all pods placed within the limit?
    unscheduled = [p for p in current if p.unschedulable_message is not None]
    if unscheduled:
        oldest = min((p.created for p in current if p.created is not None), default=now)
        waited = now - oldest
        msg = f"{len(unscheduled)}/{len(current)} pods of attempt {attempt} cannot be scheduled for " \
              f"{waited:.0f}s: {unscheduled[0].unschedulable_message}"
        if waited >= rp.unschedulable_timeout_seconds:
            if rp.unschedulable_action == "Fail":
                return Decision(Action.FAIL, C.UNSCHEDULABLE_TIMEOUT, msg + " (runPolicy.unschedulableAction=Fail)",
                                delete=stale + _cleanup(spec, current), force_delete=stuck, unschedulable=True)
            return Decision(Action.WAIT, C.PODS_UNSCHEDULABLE, msg, delete=stale, force_delete=stuck,
                            unschedulable=True)
        return Decision(Action.WAIT, C.WAITING_FOR_PODS, msg, delete=stale, force_delete=stuck,
                        requeue_after=rp.unschedulable_timeout_seconds - waited)

    # 8. Hang: no step progress for too long.
    running = [p for p in current if p.phase == "Running"]
    pr = obs.progress
    if len(running) == len(current) and node_wait is None:
        # The hang timer starts with the attempt's first trained step: loading a checkpoint (after which the
        # trainer publishes the resumed step) and the first step's warm-up/compile count as start-up.
        if pr.first_step_time is not None and pr.last_progress_time is not None:
            idle = now - pr.last_progress_time
            limit = rp.hang_timeout_seconds
            ck = spec.checkpoint
            if pr.step is not None and (pr.step >= spec.training.steps
                                        or (ck.enabled and pr.step % ck.interval_steps == 0)):
                # after a checkpoint step (and the last one: final save, then exit) a whole save may pass
                limit += ck.save_timeout_seconds
            if idle >= limit:
                return _restart_or_fail(spec, status, obs, Failure(
                    "Hang", f"no step progress for {idle:.0f}s (step {pr.step}; runPolicy.hangTimeoutSeconds="
                    f"{rp.hang_timeout_seconds}" + (f" + checkpoint.saveTimeoutSeconds={ck.save_timeout_seconds} "
                    "after a checkpoint step" if limit > rp.hang_timeout_seconds else "") + ")", "", None),
                    current, stale, stuck)
        elif pr.first_step_time is None:
            since = max((p.running_since or now) for p in running)
            if now - since >= rp.startup_timeout_seconds:
                return _restart_or_fail(spec, status, obs, Failure(
                    "StartupTimeout", f"no first step {now - since:.0f}s after all pods started "
                    f"(runPolicy.startupTimeoutSeconds={rp.startup_timeout_seconds})", "", None),
                    current, stale, stuck)
        if pr.step is not None:
            return Decision(Action.KEEP, C.TRAINING, f"attempt {attempt} is training (step {pr.step})",
                            delete=stale, force_delete=stuck, ready=True)
        return Decision(Action.KEEP, C.WAITING_FOR_FIRST_STEP, f"all pods of attempt {attempt} run; waiting for the "
                        "first step", delete=stale, force_delete=stuck)
    if node_wait is not None:
        return Decision(Action.WAIT, C.WAITING_FOR_PODS, "a node of the attempt is NotReady; waiting "
                        f"{node_wait:.0f}s more (runPolicy.nodeFailureGraceSeconds)", delete=stale,
                        force_delete=stuck, requeue_after=node_wait, ready=pr.step is not None)
    return Decision(Action.KEEP, C.WAITING_FOR_PODS,
                    f"{len(running)}/{len(current)} pods of attempt {attempt} are running",
                    delete=stale, force_delete=stuck)


def _restart_or_fail(spec, status, obs, failure: Failure, current, stale, stuck) -> Decision:
    rp = spec.run_policy
    end = stale + tuple(p.name for p in current if not p.deleting)
    if status.restart_count >= rp.max_restarts:
        return Decision(Action.FAIL, C.MAX_RESTARTS_EXCEEDED, f"{failure.message}; runPolicy.maxRestarts="
                        f"{rp.max_restarts} restarts are used up", cause=failure.cause,
                        delete=stale + _cleanup(spec, current), force_delete=stuck)
    pending = [*status.restarts, _record(status, failure, obs)]
    if trailing_without_progress(pending) >= rp.max_restarts_without_progress + 1:
        return Decision(Action.FAIL, C.NO_PROGRESS, f"{failure.message}; {rp.max_restarts_without_progress} "
                        "restarts in a row made no step progress (runPolicy.maxRestartsWithoutProgress)",
                        cause=failure.cause, delete=stale + _cleanup(spec, current), force_delete=stuck)
    return Decision(Action.RESTART, C.RESTARTED, failure.message, cause=failure.cause, delete=end,
                    force_delete=stuck)


def _record(status: LlamaPretrainStatus, f: Failure | Decision, obs: Observed) -> RestartRecord:
    pr = obs.progress
    ckpt = pr.last_checkpoint_step
    lost = None if pr.step is None else max(0, pr.step - (ckpt or 0))
    return RestartRecord(
        attempt=status.attempt or 0, cause=f.cause or "Unknown", message=f.message, time=iso(obs.now),
        node_name=f.node_name, resumed_from_step=ckpt if ckpt is not None else 0, lost_steps=lost,
    )


# ------------------------------------------------------------------ next status
def next_status(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, d: Decision,
                obs: Observed) -> LlamaPretrainStatus:
    """The status after ``d``: conditions, attempt, restart history, training numbers."""
    s = status.model_copy(deep=True)
    now = iso(obs.now)
    gen = obs.generation
    conds = s.conditions
    s.observed_generation = gen
    attempt = s.attempt if s.attempt is not None else 0

    def cond(type_: str, st: str, reason: str, msg: str) -> None:
        C.set_condition(conds, type_, st, reason, msg, now, gen)

    if obs.training is not None:
        s.training = obs.training
    if s.training is None:
        s.training = TrainingStatus()
    s.training.total_steps = spec.training.steps
    step = s.training.step
    s.training.progress = f"{step if step is not None else 0}/{spec.training.steps}"

    if d.action == Action.CREATE and s.start_time is None:
        s.start_time = now
    if s.attempt is None and d.action in (Action.CREATE, Action.WAIT, Action.KEEP):
        s.attempt = 0

    # The downtime of the last restart ends with the next attempt's first step. By then the step that attempt
    # really resumed from is known too: the record's guess (the newest checkpoint scraped before the failure)
    # misses a save that completed between the last scrape and the failure, and then overstates lostSteps.
    if s.restarts and s.restarts[-1].downtime_seconds is None and s.restarts[-1].attempt < attempt \
            and obs.progress.first_step_time is not None:
        last = s.restarts[-1]
        t0 = parse_time(last.time) or obs.now
        last.downtime_seconds = round(max(0.0, obs.progress.first_step_time - t0), 3)
        if obs.progress.start_step is not None and last.lost_steps is not None:
            ended = (last.resumed_from_step or 0) + last.lost_steps  # the failed attempt's last step
            last.resumed_from_step = obs.progress.start_step
            last.lost_steps = max(0, ended - obs.progress.start_step)

    if d.action == Action.RESTART:
        rec = _record(status, d, obs)
        s.restarts = [*s.restarts, rec][-MAX_RESTART_RECORDS:]
        s.restart_count += 1
        s.attempt = attempt + 1
        s.training.step = None
    if d.action == Action.SUSPEND and d.ends_attempt:
        s.attempt = attempt + 1  # the stopped gang's names are used up; resume makes a new attempt
    if d.action in (Action.FAIL, Action.SUCCEED) and s.completion_time is None:
        s.completion_time = now
    if d.action == Action.SUCCEED:
        s.training.step = spec.training.steps if s.training.step is None else s.training.step

    # ---- conditions (all set on every visit, Unknown-free: we always know)
    if obs.spec_block:
        cond(C.SPEC_ACCEPTED, "False", C.IMMUTABLE_FIELD_CHANGED, obs.spec_block)
    elif obs.spec_deferred:
        cond(C.SPEC_ACCEPTED, "True", C.DEFERRED_TO_NEXT_ATTEMPT, obs.spec_deferred)
    else:
        cond(C.SPEC_ACCEPTED, "True", C.SPEC_APPLIED, "the spec is valid and applied")

    terminal = d.action in (Action.FAIL, Action.SUCCEED, Action.FINISHED)
    if d.action == Action.SUCCEED:
        cond(C.SUCCEEDED, "True", d.reason, d.message)
        cond(C.FAILED, "False", C.NOT_FINISHED, "the run succeeded")
    elif d.action == Action.FAIL:
        cond(C.FAILED, "True", d.reason, d.message)
        cond(C.SUCCEEDED, "False", d.reason, "the run failed")
    elif not terminal:
        cond(C.SUCCEEDED, "False", C.NOT_FINISHED, "training has not reached spec.training.steps yet")
        cond(C.FAILED, "False", C.NOT_FINISHED, "the run has not failed")

    if not terminal:
        if d.action == Action.SUSPEND:
            cond(C.SUSPENDED, "True", d.reason, d.message)
        else:
            cond(C.SUSPENDED, "False", C.NOT_SUSPENDED, "runPolicy.suspend is false")
        restarting = d.action == Action.RESTART or (
            C.is_true(conds, C.RESTARTING) and not d.ready and d.action != Action.SUSPEND)
        if restarting:
            last = s.restarts[-1] if s.restarts else None
            msg = d.message if d.action in (Action.RESTART, Action.WAIT) or last is None else \
                f"attempt {attempt} replaces attempt {last.attempt} ({last.cause}: {last.message})"
            cond(C.RESTARTING, "True", d.reason if d.action != Action.KEEP else C.RESTARTED, msg)
        else:
            cond(C.RESTARTING, "False", C.NOT_RESTARTING, "no restart in progress")
        if d.unschedulable:
            cond(C.UNSCHEDULABLE, "True", d.reason, d.message)
        else:
            cond(C.UNSCHEDULABLE, "False", C.PODS_SCHEDULED, "no pod waits longer than unschedulableTimeoutSeconds")
    elif d.action == Action.FAIL or d.action == Action.SUCCEED:
        cond(C.RESTARTING, "False", C.NOT_RESTARTING, "the run is finished")
        cond(C.SUSPENDED, "False", C.NOT_SUSPENDED, "the run is finished")

    if d.action == Action.FINISHED:
        pass  # terminal conditions stay as they are
    elif d.ready:
        cond(C.READY, "True", C.TRAINING, d.message)
    else:
        cond(C.READY, "False", d.reason or C.WAITING_FOR_PODS, d.message)

    s.phase = C.derive_phase(conds, attempt_exists=bool(obs.pods) or d.action in (Action.CREATE,))
    if d.action != Action.FINISHED:
        s.message = d.message
    conds.sort(key=lambda c: C.ALL_TYPES.index(c.type) if c.type in C.ALL_TYPES else len(C.ALL_TYPES))
    return s


def restart_event(d: Decision, attempt: int) -> tuple[str, str, str] | None:
    """The Kubernetes Event (type, reason, message) a decision sends after the status write."""
    if d.action == Action.RESTART:
        return "Warning", f"Restart{d.cause}", f"Attempt {attempt} ended: {d.message}; starting attempt {attempt + 1}"
    if d.action == Action.FAIL:
        return "Warning", d.reason, d.message
    if d.action == Action.SUCCEED:
        return "Normal", d.reason, d.message
    return None


__all__ = [
    "Action", "Decision", "NodeObs", "Observed", "PodObs", "Progress", "backoff_seconds", "classify_pod",
    "decide", "made_progress", "next_status", "nodes_to_avoid", "replace",
]
