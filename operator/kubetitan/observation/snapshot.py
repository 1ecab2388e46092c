"""One cycle's read of a run, frozen: everything the policy sees, read once (pure: no kopf, no client).

:func:`kubetitan.observation.read.observe` fills a :class:`Snapshot` from the object, the watches' indexes (pods,
nodes, the run's ConfigMap and Service), rank 0's /metrics and the run's :class:`RunMemory`; nothing in it changes
during the cycle. :func:`decision_inputs` turns it into :class:`~kubetitan.observation.Observed` (the persisted
observation folded with this read by ``observation.tracking.track``), and the rest of the cycle (``decide``,
``status.next_status``, apply, report) reads it without reading the cluster again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kubetitan import conditions as C
from kubetitan import plan, policy
from kubetitan.status import training_status
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan.observation import DEFAULT_RESIZE_MIN_INTERVAL_SECONDS, Capacity, ChildError, NodeObs, Observed, PodObs
from kubetitan.observation.pods import node_obs
from kubetitan.observation.tracking import observed, track


@dataclass(frozen=True)
class Scrape:
    """This cycle's scrape of rank 0's /metrics (all None: no scrape was due, or no slot was free)."""

    metrics: Mapping[str, float] | None = None
    """The samples that passed ``scraped.check`` (None: no answer)."""
    error: str | None = None
    reason: str | None = None
    """The ``MetricsAvailable`` reason of a failed scrape."""
    refused: tuple[Any, ...] = ()
    """The values ``scraped.check`` refused (``scraped.Refusal``)."""


@dataclass(frozen=True)
class Snapshot:
    """A run as one cycle read it. The observed parts stay empty for a run whose spec is refused (``invalid``).

    Frozen; the mappings and the status model in it are shared with the caches they came from and are read only
    (``status.next_status`` works on a deep copy)."""

    body: Mapping[str, Any]
    """The object as watched (kopf's read-only view): Events point at it; its spec re-renders an attempt."""
    namespace: str
    name: str
    uid: str
    generation: int | None
    now: float
    """The operator's clock when the cycle started (every timer of the decision reads it)."""
    status: LlamaPretrainStatus
    """The status the cycle starts from: this replica's last write, else the API's as re-read, else the watch's."""
    status_raw: Mapping[str, Any]
    """That status as the server holds it, as far as this replica knows (the base of the merge patch)."""
    status_written: bool
    """Whether ``status`` is this replica's own last write (not a read)."""
    lpt: Any
    """The parsed LlamaPretrain (None when it does not parse)."""
    errors: tuple[Any, ...]
    """Validation errors and admin-policy violations of the spec."""
    desired: Mapping[str, Any]
    """The spec in wire form (what a new attempt is created from)."""
    warnings: frozenset[tuple[str, str]] = frozenset()
    """The spec's warnings (rule id, message)."""
    pods: tuple[PodObs, ...] = ()
    nodes: Mapping[str, NodeObs] = field(default_factory=lambda: MappingProxyType({}))
    """The health of every node one of ``pods`` runs on (absent from the index: absent from the API)."""
    children_shown: frozenset[str] | None = None
    """The run's ConfigMap/Service names their indexes show (None: no child indexes)."""
    missing: tuple[str, ...] = ()
    """The run's ConfigMap/Service that are gone while the attempt runs (``Expectations.missing``)."""
    applied_spec: Mapping[str, Any] | None = None
    """The spec the current attempt was created from (its ConfigMap's ``applied-spec.json``)."""
    gate: tuple[str | None, str | None, str | None] = (None, None, None)
    """``status.spec_gate`` of the desired spec against ``applied_spec``: (block, its reason, deferred)."""
    child_errors: tuple[ChildError, ...] = ()
    """The API's refusals of the last create round of the current attempt."""
    scrape: Scrape = field(default_factory=Scrape)
    capacity: Capacity | None = None
    """Elastic runs: the nodes that fit one pod of the gang (``kubetitan.elastic``); None otherwise."""

    @property
    def attempt(self) -> int:
        return self.status.attempt if self.status.attempt is not None else 0

    @property
    def current(self) -> tuple[PodObs, ...]:
        """The pods of the current attempt."""
        return tuple(p for p in self.pods if p.attempt == self.attempt)

    @property
    def refused_live(self) -> bool:
        """A started run whose spec is refused now (a policy tightened, an edit a Python-only rule refuses): it
        keeps being observed (its pods are never left untracked) and no new attempt starts."""
        return bool(self.errors) and self.lpt is not None and self.status.attempt is not None

    @property
    def invalid(self) -> bool:
        """Refused outright: a run that never started with a refused spec, or an object that does not parse."""
        return (bool(self.errors) and not self.refused_live) or self.lpt is None

    @property
    def rank0(self) -> PodObs | None:
        return next((p for p in self.pods if p.attempt == self.attempt and p.rank == 0), None)

    def spec_block(self) -> tuple[str | None, str | None, str | None]:
        """(block, its reason, deferred) for the decision: the spec gate, or the refusal of a started run's spec."""
        block, reason, deferred = self.gate if self.applied_spec is not None and self.status.attempt is not None \
            else (None, None, None)
        if self.refused_live:  # (its Warning Event comes with the SpecAccepted=False transition, in the status)
            reason = C.POLICY_VIOLATION if all(isinstance(e, policy.Violation) for e in self.errors) \
                else C.INVALID_SPEC
            block = (f"{'refused by the admin policy' if reason == C.POLICY_VIOLATION else 'invalid spec'}: "
                     f"{'; '.join(map(str, self.errors))}; a running attempt goes on as it was created (and is still "
                     "observed), but no new attempt starts until the spec complies")
        return block, reason, deferred

    def attempt_spec(self, section: str, key: str) -> int | None:
        """An integer of the spec the current attempt was created from (None without a live attempt)."""
        if not self.current:
            return None
        v = ((self.applied_spec or {}).get(section) or {}).get(key)
        return v if isinstance(v, int) else None


def pods_of(index: Any, uid: str) -> tuple[PodObs, ...]:
    """The run's pods from the ``lpt_pods`` index."""
    return tuple(p for p in (index.get(uid, ()) if index is not None else ()) if p is not None)


def nodes_of(index: Any, pods: tuple[PodObs, ...]) -> Mapping[str, NodeObs]:
    """The health of the nodes ``pods`` run on, from the ``lpt_nodes`` index (absent: absent from the API)."""
    out = {}
    for n in sorted({p.node_name for p in pods if p.node_name}):
        hit = next(iter(index.get(n, ())), None) if index is not None else None
        out[n] = hit if hit is not None else node_obs(n, None)
    return MappingProxyType(out)


def children_of(indexes: tuple[Any, Any] | None, uid: str, name: str) -> frozenset[str] | None:
    """The run's ConfigMap/Service names that the ``lpt_configmaps``/``lpt_services`` indexes show."""
    if indexes is None:
        return None
    return frozenset(child for index, child in zip(indexes, child_names(name), strict=True)
                     if child in index.get(uid, ()))


def child_names(name: str) -> tuple[str, str]:
    """The run's ConfigMap and Service (shared by every attempt)."""
    return plan.config_map_name(name), plan.service_name(name)


def all_nodes(index: Any) -> list[NodeObs]:
    """Every node the ``lpt_nodes`` index holds (an elastic run's capacity)."""
    return [v for key in index for v in index[key] if v is not None] if index is not None else []


def decision_inputs(snap: Snapshot, hang_floor_seconds: float,
                    resize_min_interval_seconds: float = DEFAULT_RESIZE_MIN_INTERVAL_SECONDS) -> Observed:
    """``Observed`` from the snapshot: this read folded into the persisted observation (``tracking.track``)."""
    sc, old = snap.scrape, snap.status
    seen = track(old.observation, snap.attempt, snap.now, metrics=sc.metrics, scrape_error=sc.error,
                            scrape_reason=sc.reason, pods=snap.pods, nodes=snap.nodes)
    training = training_status(snap.lpt.spec, sc.metrics, snap.now, old.training) \
        if sc.metrics and not seen.metrics_error else None
    block, reason, deferred = snap.spec_block()
    return observed(seen, pods=snap.pods, nodes=dict(snap.nodes), now=snap.now,
                               generation=snap.generation, spec_block=block, spec_block_reason=reason,
                               spec_deferred=deferred, training=training, child_errors=snap.child_errors,
                               missing_children=snap.missing, attempt_steps=snap.attempt_spec("training", "steps"),
                               attempt_nodes=snap.attempt_spec("resources", "nodes"),
                               hang_floor_seconds=hang_floor_seconds, capacity=snap.capacity,
                               resize_min_interval_seconds=resize_min_interval_seconds)
