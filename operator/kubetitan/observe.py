"""Observation: raw API objects and rank 0's /metrics -> the typed inputs of ``decide``.

Everything here is pure except :func:`scrape` (one HTTP GET with aiohttp). Pods and nodes arrive as
plain dicts (from kopf's index / the API); metrics arrive as Prometheus text and are parsed with
prometheus-client's parser.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
import ipaddress
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kubetitan import plan
from kubetitan.decide import NodeObs, PodObs
from kubetitan.status import training_status  # noqa: F401 - re-exported: observation's numbers for the status


def _ts(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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
        created=_ts(meta.get("creationTimestamp")),
        scheduled_since=_ts(sched.get("lastTransitionTime")) if sched.get("status") == "True" else None,
        running_since=_ts(running.get("startedAt")) if running else None,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def node_obs(name: str, node: Mapping[str, Any] | None) -> NodeObs:
    """Health of a node; ``node`` None means the API says it does not exist."""
    if node is None:
        return NodeObs(name=name, exists=False, ready=False, not_ready_since=None)
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return NodeObs(name=name, ready=None)
    ok = {"True": True, "False": False}.get(ready.get("status"))
    return NodeObs(name=name, ready=ok, not_ready_since=None if ok else _ts(ready.get("lastTransitionTime")))


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of rank 0's exposition by sample name (first sample wins); a sample labelled only with ``phase``
    (the start-up anatomy) also as ``<name>/<phase>``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, float(s.value))
            if set(s.labels) == {"phase"}:
                out.setdefault(f"{s.name}/{s.labels['phase']}", float(s.value))
    return out


# ------------------------------------------------------------------ spec changes
LIVE_FIELDS = ("training.steps", "runPolicy")
"""Applied at once while running: the operator reads them every cycle (steps: from the next attempt
for the trainer, at once for the status)."""
REJECTED_FIELDS = ("model", "tokenizer", "checkpoint.storage", "checkpoint.mountPath", "checkpoint.enabled")
"""Would make the existing checkpoints unusable: refused while the run has an attempt; revert them,
or create a new LlamaPretrain."""


def _flatten(d: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leaf paths of nested dicts (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict is a leaf)."""
    out = {} if out is None else out
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = {} if isinstance(d, dict) else d
    return out


def spec_changes(applied: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Changed wire paths between two specs, as (live, deferred, rejected)."""
    a, b = _flatten(dict(applied)), _flatten(dict(desired))
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    live, deferred, rejected = [], [], []
    for k in changed:
        if any(k == f or k.startswith(f + ".") for f in REJECTED_FIELDS):
            rejected.append(k)
        elif any(k == f or k.startswith(f + ".") for f in LIVE_FIELDS):
            live.append(k)
        else:
            deferred.append(k)
    return live, deferred, rejected


def metrics_url(ip: str, port: int) -> str:
    """rank 0's /metrics URL; an IPv6 address goes in brackets (RFC 3986)."""
    try:
        host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
    except ValueError:
        host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


async def scrape(session: Any, ip: str, port: int, timeout: float) -> tuple[str | None, str | None]:
    """GET rank 0's /metrics: (the text, None) or (None, what went wrong, with the URL).

    A failed scrape is an observation failure, never a training failure: the caller reports it in the
    ``MetricsAvailable`` condition and keeps the last known progress.
    """
    import aiohttp

    url = metrics_url(ip, port)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None, f"GET {url} answered HTTP {r.status}"
            return await r.text(), None
    except TimeoutError:
        return None, f"GET {url} timed out after {timeout:g}s"
    except (aiohttp.ClientError, OSError) as e:
        return None, f"GET {url} failed: {e.__class__.__name__}: {e}".rstrip(": ")
