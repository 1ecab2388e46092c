"""A pod or node of the API (a plain dict, from kopf's index or a read) -> the typed observation the rules read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubetitan import plan
from kubetitan.elastic import NOT_EXTENDED
from kubetitan.observation import NodeObs, PodObs
from kubetitan.timestamps import parse_time


def pod_obs(pod: Mapping[str, Any]) -> PodObs | None:
    """The decision-relevant view of one training pod; None for a pod without our labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        attempt, rank = int(labels[plan.LABEL_ATTEMPT]), int(labels[plan.LABEL_RANK])
    except (KeyError, ValueError):
        return None
    st = pod.get("status") or {}
    cs = next((c for c in st.get("containerStatuses") or [] if c.get("name") == plan.CONTAINER_NAME),
              (st.get("containerStatuses") or [None])[0]) or {}
    state = cs.get("state") or {}
    waiting, running, term = state.get("waiting") or {}, state.get("running"), state.get("terminated")
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    sched = conds.get("PodScheduled") or {}
    unsched = None
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        unsched = sched.get("message") or "Unschedulable"
    disruption = conds.get("DisruptionTarget") or {}
    return PodObs(
        name=meta.get("name", ""),
        attempt=attempt,
        rank=rank,
        phase=st.get("phase") or "Pending",
        node_name=(pod.get("spec") or {}).get("nodeName"),
        pod_ip=st.get("podIP"),
        reason=st.get("reason"),
        message=st.get("message"),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        exit_code=term.get("exitCode") if term else None,
        terminated_reason=term.get("reason") if term else None,
        termination_message=term.get("message") if term else None,
        disruption_reason=disruption.get("reason") if disruption.get("status") == "True" else None,
        unschedulable_message=unsched,
        created=parse_time(meta.get("creationTimestamp")),
        scheduled_since=parse_time(sched.get("lastTransitionTime")) if sched.get("status") == "True" else None,
        running_since=parse_time(running.get("startedAt")) if running else None,
        finished_at=parse_time(term.get("finishedAt")) if term else None,
        deleting=bool(meta.get("deletionTimestamp")),
        pod_group=((pod.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName"),
    )


def node_obs(name: str, node: Mapping[str, Any] | None) -> NodeObs:
    """Health of a node; ``node`` None means the API says it does not exist."""
    if node is None:
        return NodeObs(name=name, exists=False, ready=False, not_ready_since=None)
    spec, status = node.get("spec") or {}, node.get("status") or {}
    place = {"unschedulable": bool(spec.get("unschedulable")),
             "labels": tuple(sorted(((node.get("metadata") or {}).get("labels") or {}).items())),
             "taints": tuple((t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in spec.get("taints") or []),
             "allocatable": tuple(sorted((k, str(v)) for k, v in (status.get("allocatable") or {}).items()
                                         if k not in NOT_EXTENDED))}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return NodeObs(name=name, ready=None, **place)
    ok = {"True": True, "False": False}.get(ready.get("status"))
    since = parse_time(ready.get("lastTransitionTime"))
    return NodeObs(name=name, ready=ok, not_ready_since=None if ok else since, ready_since=since if ok else None,
                   **place)
