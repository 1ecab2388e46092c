"""What every rule of the decision shares: the :class:`Decision` it returns, the :class:`Facts` it reads, and the
small helpers more than one policy needs (pure: no kopf, no client, no clock)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus, RestartCause
from kubetitan.observation import NodeObs, Observed, PodObs



MAX_RESTART_RECORDS = 50


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


def cleanup(spec: LlamaPretrainSpec, pods: Sequence[PodObs]) -> tuple[str, ...]:
    """Pods that ``runPolicy.cleanupPolicy`` removes when the run ends (None keeps failed pods for logs)."""
    policy = spec.run_policy.cleanup_policy
    if policy == "All":
        return tuple(p.name for p in pods if not p.deleting)
    if policy == "Running":
        return tuple(p.name for p in pods if not p.deleting and p.phase in ("Pending", "Running", "Unknown"))
    return ()


def node_failed(n: NodeObs | None) -> bool:
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
            if p.deleting and node_failed(n):
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


def all_running(f: Facts) -> bool:
    return bool(f.current) and all(p.phase == "Running" for p in f.current)


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
