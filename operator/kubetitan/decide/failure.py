"""The failure policy: why a pod ends its attempt (:func:`classify_pod`, in the cause table's order of evidence),
whether the gang is restarted or the run fails (:func:`restart_or_fail`, the restart budgets and the backoff), the
nodes a run avoids, a lost node's grace, and the launchers' in-place restarts (recorded, or escalated to a new gang).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kubetitan import conditions as C
from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus, RestartCause, RestartRecord
from kubetitan_core import causes, hang
from kubetitan_core.causes import RESIZE_CAUSES
from kubetitan_core.contract import EXIT_SIGKILL, EXIT_SIGTERM, ExitCode
from kubetitan.observation import Observed, PodObs
from kubetitan.timestamps import iso, iso_ms
from kubetitan.decide.core import Action, Decision, Facts, cleanup, node_failed


NODE_FAILURES_TO_AVOID = causes.by_id("NodeFailure").avoid_node_after
"""A node blamed for this many ``NodeFailure`` restarts of the run is kept out of later attempts (anti-affinity);
each cause's own number is its row's ``avoid_node_after`` (``GPUXidError``: 1)."""
DELETED_EXIT_CODES = frozenset({int(ExitCode.TERMINATED_CHECKPOINTED), EXIT_SIGTERM, EXIT_SIGKILL})
"""Exit codes of a pod that stopped because it was deleted (saved on SIGTERM, or killed after the grace)."""


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


def pod_failed(f: Facts) -> Decision | None:
    """A failure of any pod, a lost node past its grace, or a rank that disappeared ends the attempt."""
    failed = [(p, x) for p in f.current if (x := classify_pod(p)) is not None]
    failures = [x for _, x in sorted(failed, key=lambda px: _root_first(*px))]
    failures += [x for x, _left in _lost_nodes(f) if x is not None]
    if not failures:
        gone = sorted(f.obs.ranks_seen - {p.rank for p in f.current})  # (one set: a gang's ranks squared was 1 M)
        if gone:
            failures.append(_disappeared(f, gone))
    if not failures:
        return None
    fatal = next((x for x in failures if x.cause is None), None)
    # pods on a lost node, or on one missing from the API, are force-deleted: no kubelet is left to end them
    lost = {x.node_name for x in failures if x.cause == "NodeFailure"} | {n for n, v in f.obs.nodes.items()
                                                                           if not v.exists}
    force = tuple(p.name for p in f.current if p.node_name in lost and not p.deleting)
    if fatal is not None:
        return Decision(Action.FAIL, fatal.fatal_reason or C.CONFIG_ERROR, f"{fatal.message} (not retried)",
                        delete=cleanup(f.spec, f.current), force_delete=force, node_name=fatal.node_name)
    first = failures[0]
    extra = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
    return restart_or_fail(f, replace(first, message=first.message + extra), force)


def _disappeared(f: Facts, gone: list[int]) -> Failure:
    """Ranks seen earlier in the attempt whose pods are gone: deleted by the cluster's pod garbage collector when
    their node was deleted (a node of the attempt missing from the API that no pod of it is on any more), else by
    someone other than the operator."""
    ranks = f"pod(s) of rank {', '.join(map(str, gone))} of attempt {f.attempt}"
    missing = sorted(set(f.obs.observation.nodes_missing_since if f.obs.observation is not None else ())
                     - {p.node_name for p in f.current})
    if missing:
        return Failure("NodeFailure", f"node {', '.join(missing)} is missing and {ranks} disappeared (the pod "
                       "garbage collector deletes the pods of a deleted node)", "", missing[0])
    return Failure("PodDeleted", f"{ranks} disappeared (deleted, not by the operator)", "", None)


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
        if not node_failed(n) or p.phase in ("Succeeded", "Failed"):
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


def may_restart_in_place(f: Facts) -> bool:
    """The attempt's launchers still restart in place (``maxInPlaceRestarts`` not used up)."""
    return len(in_place_records(f)) < f.rp.max_in_place_restarts


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


def restart_or_fail(f: Facts, failure: Failure, force: tuple[str, ...] = (),
                    record: RestartRecord | None = None) -> Decision:
    """End the attempt: restart it, unless ``maxRestarts`` or ``maxRestartsWithoutProgress`` are used up
    (``record``: the restart as it would be recorded, when not the gang's own)."""
    rp = f.rp
    if f.status.restart_count >= rp.max_restarts:
        return Decision(Action.FAIL, C.MAX_RESTARTS_EXCEEDED, f"{failure.message}; runPolicy.maxRestarts="
                        f"{rp.max_restarts} restarts are used up", cause=failure.cause,
                        delete=cleanup(f.spec, f.current), force_delete=force, node_name=failure.node_name)
    pending = [*f.status.restarts, record or restart_record(f.status, failure, f.obs)]
    if trailing_without_progress(pending) >= rp.max_restarts_without_progress + 1:
        return Decision(Action.FAIL, C.NO_PROGRESS, f"{failure.message}; {rp.max_restarts_without_progress} "
                        "restarts in a row made no step progress (runPolicy.maxRestartsWithoutProgress)",
                        cause=failure.cause, delete=cleanup(f.spec, f.current), force_delete=force,
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
