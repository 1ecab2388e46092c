"""What the operator saw of a run, typed: the one place observations are built and the types every rule reads.

- this module: the observation types (:class:`PodObs`, :class:`NodeObs`, :class:`Progress`, :class:`Capacity`,
  :class:`ChildError`) and :class:`Observed`, everything one decision reads;
- ``pods`` — a pod or node of the API (a plain dict) -> :class:`PodObs` / :class:`NodeObs`;
- ``scrape`` — the bounded scrape of rank 0's /metrics and its parse;
- ``spec`` — what changed between the spec an attempt was created from and the spec now;
- ``tracking`` — this cycle's read folded into the persisted ``status.observation``, and :class:`Observed` from it;
- ``snapshot`` — :class:`~kubetitan.observation.snapshot.Snapshot`, one cycle's frozen read of a run;
- ``read`` — the read that fills it (the object, the watches' indexes, the scrape, the attempt's applied spec).

Pure but ``scrape`` (HTTP GETs) and ``read`` (the API reads of one cycle). ``kubetitan.decide`` reads
:class:`Observed` only; no other module builds an observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kubetitan import conditions as C
from kubetitan_core.api import AttemptObservation, TrainingStatus
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS

DEFAULT_RESIZE_MIN_INTERVAL_SECONDS = 600.0
"""The operator's ``--resize-min-interval-seconds`` by default: an elastic run resizes at most once per 10 minutes."""


@dataclass(frozen=True)
class PodObs:
    """What matters about one training pod (see ``observation.pods.pod_obs``)."""

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
    """Trainer container waiting reason, e.g. ``ImagePullBackOff``, ``ContainerCreating``."""
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
    scheduled_since: float | None = None
    """When the pod's ``PodScheduled`` condition turned True (its ``lastTransitionTime``)."""
    running_since: float | None = None
    finished_at: float | None = None
    """The container's ``state.terminated.finishedAt`` (epoch seconds; the API gives whole seconds), if it ended."""
    deleting: bool = False
    pod_group: str | None = None
    """The PodGroup the pod names in ``spec.schedulingGroup`` (None: none; ``plan.uses_pod_group``)."""


@dataclass(frozen=True)
class NodeObs:
    """Health of a node that runs (or ran) a pod of the run."""

    name: str
    exists: bool = True
    ready: bool | None = True
    """Node ``Ready`` condition; None when Unknown (the kubelet stopped reporting)."""
    not_ready_since: float | None = None
    """``lastTransitionTime`` of a Ready condition that is not True; for a missing node, when the operator first
    saw it missing (kept in ``status.observation``)."""
    ready_since: float | None = None
    """``lastTransitionTime`` of a Ready condition that is True (how long the node has been Ready)."""
    unschedulable: bool = False
    """``spec.unschedulable`` (cordoned)."""
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()
    """(key, value, effect) of each taint."""
    allocatable: tuple[tuple[str, str], ...] = ()
    """``status.allocatable`` but cpu, memory, ephemeral-storage and pods: (resource, quantity) of each extended
    resource and huge page size the node offers (``nvidia.com/gpu``, ``vpc.amazonaws.com/efa``, ``hugepages-2Mi``)."""


@dataclass(frozen=True)
class Capacity:
    """Nodes that fit one pod of the gang (``kubetitan.elastic.capacity``): now, and Ready for at least
    ``runPolicy.elastic.growCheckSeconds``."""

    schedulable: int
    stable: int


@dataclass(frozen=True)
class Progress:
    """Training progress of the current attempt, from rank 0's metrics and ``status.observation``."""

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
    metrics_available: bool | None = None
    """Did the newest scrape of rank 0's /metrics answer (None: none tried for this attempt yet)?"""
    metrics_ok_time: float | None = None
    """When rank 0's /metrics last answered for this attempt."""
    metrics_error: str | None = None
    """Why the newest scrape failed (with the URL), when it did."""
    generation: int = 0
    """Worker generation rank 0 reports (+1 per in-place restart); step and times above are this one's."""
    generation_start_time: float | None = None
    """When the current generation began (the failure its launcher reported)."""
    previous_generation_step: int | None = None
    """Newest step the previous generation reported."""
    restart_exit_code: int | None = None
    restart_node_rank: int | None = None
    """Exit code and pod rank of the worker failure that began the current generation."""
    step_seconds_median: float | None = None
    """Median step time of the current generation's recent steps (the trainer's own measure)."""


@dataclass(frozen=True)
class ChildError:
    """A child the API refused to create (403 Forbidden, 422 Invalid, or a name held by another owner)."""

    kind: str
    name: str
    reason: str
    """conditions.FORBIDDEN / INVALID / NAME_CONFLICT / API_TIMEOUT / API_UNAVAILABLE."""
    message: str

    def account(self, reason: bool = False) -> str:
        """What happened to the create (with ``reason`` before the message: the ``FailedCreate`` Event), for the status
        and the Event: a refusal is the API's answer, a timeout is no answer (``message`` says for how long), never
        "refused"."""
        said = f"{self.reason}: {self.message}" if reason else self.message
        if self.reason == C.API_TIMEOUT:
            return f"the create of {self.kind} {self.name} timed out: {said}"
        return f"the API refused {self.kind} {self.name}: {said}"


@dataclass(frozen=True)
class Observed:
    pods: tuple[PodObs, ...] = ()
    nodes: Mapping[str, NodeObs] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    now: float = 0.0
    generation: int | None = None
    spec_block: str | None = None
    """A spec change that the next attempt must not pick up (a message), or None."""
    spec_block_reason: str = C.IMMUTABLE_FIELD_CHANGED
    """The reason of ``spec_block`` (``PolicyViolation``/``InvalidSpec``: a started run's spec that the admin
    policy now refuses or that became invalid; its live pods are still observed, no new attempt starts)."""
    spec_deferred: str | None = None
    """Spec changes that wait for the next attempt (a message), or None."""
    training: TrainingStatus | None = None
    """Freshly scraped numbers for ``status.training`` (None keeps the old ones)."""
    ranks_seen: frozenset[int] = frozenset()
    """Ranks of the current attempt whose pod has been observed at least once (``status.observation``): a
    missing rank that was seen disappeared (the attempt ends); one never seen is created (again)."""
    child_errors: tuple[ChildError, ...] = ()
    """Children the API refused on the last create of this attempt (cleared by a create that worked)."""
    observation: AttemptObservation | None = None
    """The observation these inputs came from (``tracking.track``); ``status.next_status`` persists it."""
    missing_children: tuple[str, ...] = ()
    """Names of the run's ConfigMap/Service that the API no longer shows although the current attempt's pods
    exist (deleted by hand): created again at once, with no restart (``Decision.recreate``)."""
    hang_floor_seconds: float = float(AUTO_HANG_FLOOR_SECONDS)
    """The ``Auto`` hang timeout's floor (the operator's ``--hang-floor-seconds``, :data:`kubetitan_core.hang.AUTO_HANG_FLOOR_SECONDS`
    by default): Auto never waits less than this, whatever the step time."""
    attempt_steps: int | None = None
    """``spec.training.steps`` of the spec the current attempt was created from (its trainer's count; the spec's
    may have changed since); None when unknown."""
    attempt_nodes: int | None = None
    """``spec.resources.nodes`` of the spec the current attempt was created from: its gang size, whatever the spec
    says now (a live attempt is never added to); None when unknown (the spec's count then). ``status.nodes``, when
    set, wins (an elastic run's size is not its spec's)."""
    capacity: Capacity | None = None
    """Nodes that fit one pod of the gang (elastic runs only; None: not observed, and then no resize)."""
    resize_min_interval_seconds: float = DEFAULT_RESIZE_MIN_INTERVAL_SECONDS
    """The admin's cap on how often a run may resize (the operator's ``--resize-min-interval-seconds``): no resize
    sooner than this after the previous one."""
