"""Node capacity for elastic runs (``runPolicy.elastic``; pure: no kopf, no client, no clock).

How many nodes could hold one pod of a run's gang right now, and how many have done so for
``growCheckSeconds``: nodes that exist, are Ready, are not cordoned, carry the labels of the pod's
``nodeSelector``, match its required node affinity (which carries the nodes the run avoids,
``decide.failure.nodes_to_avoid``), have no ``NoSchedule``/``NoExecute`` taint the pod does not tolerate and list enough
allocatable of every extended resource and huge page size the pod requests (GPUs; on ``eks``/``hyperpod`` also EFA
interfaces and ``hugepages-2Mi``). An elastic gang has one pod per
node (the planner's pod anti-affinity), so this count is the largest gang the nodes fit. Other workloads'
requests are not counted: the scheduler has the last word, and a grown gang it cannot place shrinks again
(``decide.elastic.shrink``), at most once per the operator's ``--resize-min-interval-seconds``.

The handlers compute :class:`Capacity` from the rendered rank-0 pod (:func:`placement`) and the watched
nodes, and hand it to ``decide`` in ``Observed.capacity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubetitan import plan
from kubetitan.observation import Capacity, NodeObs
from kubetitan_core.catalog import HOSTNAME_LABEL

NOT_EXTENDED = frozenset({"cpu", "memory", "ephemeral-storage", "pods"})
"""Resources a node offers that are not counted: other workloads' requests of them are not known here (the
scheduler has the last word); every other one (extended resources, huge pages) a pod requests is."""
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
"""Taint effects that keep a pod off a node unless it tolerates them (``PreferNoSchedule`` only discourages)."""


@dataclass(frozen=True)
class Placement:
    """Where one pod of the gang may run (from its spec)."""

    node_selector: tuple[tuple[str, str], ...] = ()
    terms: tuple[tuple[Mapping[str, Any], ...], ...] = ()
    """Required node affinity: the node must match every expression of at least one term (none: any node)."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    requests: tuple[tuple[str, str], ...] = ()
    """(resource, quantity) of every resource the trainer container requests but :data:`NOT_EXTENDED` (a limit
    without a request is its request, as the API server defaults it)."""


def placement(pod: Mapping[str, Any]) -> Placement:
    """The node constraints of a rendered pod (``plan.pod``)."""
    spec = pod.get("spec") or {}
    req = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
           .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = tuple(tuple(t.get("matchExpressions") or ()) + tuple(
        {**f, "field": True} for f in t.get("matchFields") or ()) for t in req.get("nodeSelectorTerms") or ())
    res = (spec.get("containers") or [{}])[0].get("resources") or {}
    asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    return Placement(node_selector=tuple(sorted((spec.get("nodeSelector") or {}).items())), terms=terms,
                     tolerations=tuple(spec.get("tolerations") or ()),
                     requests=tuple(sorted((k, str(v)) for k, v in asked.items() if k not in NOT_EXTENDED)))


def quantity(text: str) -> Decimal:
    """A Kubernetes quantity (``8``, ``5120Mi``, ``2Gi``) as a number; an unreadable one as 0."""
    from kubernetes.utils.quantity import parse_quantity  # the client's own parser (imported on first use)

    try:
        return parse_quantity(text)
    except ValueError:
        return Decimal(0)


def _expression(e: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """One ``NodeSelectorRequirement`` against a node's labels (``field``: a ``matchFields`` one, on its name)."""
    key, op, values = e.get("key", ""), e.get("operator", ""), list(e.get("values") or ())
    value = name if e.get("field") else labels.get(key)
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def _tolerated(taint: tuple[str, str, str], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    key, value, effect = taint
    for t in tolerations:
        if t.get("effect") and t["effect"] != effect:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == key:
                return True
        elif t.get("key") == key and (t.get("value") or "") == value:
            return True
    return False


def fits(node: NodeObs, p: Placement) -> bool:
    """Whether one pod with placement ``p`` may run on ``node`` (Ready, not cordoned, selected, tolerated, and
    enough allocatable of each extended resource it requests)."""
    if not node.exists or node.ready is not True or node.unschedulable:
        return False
    labels = {HOSTNAME_LABEL: node.name, **dict(node.labels)}
    if any(labels.get(k) != v for k, v in p.node_selector):
        return False
    if p.terms and not any(all(_expression(e, labels, node.name) for e in term) for term in p.terms):
        return False
    if any(eff in BLOCKING_EFFECTS and not _tolerated((k, v, eff), p.tolerations) for k, v, eff in node.taints):
        return False
    offered = dict(node.allocatable)
    return all(quantity(offered.get(name, "0")) >= quantity(want) for name, want in p.requests)


def capacity(nodes: Iterable[NodeObs], p: Placement, now: float, stable_seconds: float) -> Capacity:
    """How many ``nodes`` fit one pod now, and how many of those have been Ready for ``stable_seconds``."""
    ok = [n for n in nodes if fits(n, p)]
    stable = [n for n in ok if n.ready_since is None or now - n.ready_since >= stable_seconds]
    return Capacity(schedulable=len(ok), stable=len(stable))


def run_capacity(lpt: Any, attempt: int, avoid: Sequence[str], nodes: Iterable[NodeObs], now: float) -> Capacity | None:
    """The capacity for an elastic LlamaPretrain's gang (its rank-0 pod of ``attempt`` avoiding ``avoid``); None for a
    run that is not elastic."""
    e = lpt.spec.run_policy.elastic
    if e is None:
        return None
    return capacity(nodes, placement(plan.pod(lpt, attempt, 0, avoid_nodes=avoid)), now, e.grow_check_seconds)


__all__ = ["run_capacity", "Capacity", "Placement", "capacity", "fits", "placement"]
