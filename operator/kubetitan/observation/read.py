"""One read of a run into a ``Snapshot`` (``kubetitan.observation.snapshot``).

The object and its status, the spec's parse (and the admin policy's check), the run's pods and their nodes from the
watches' indexes, its ConfigMap/Service from theirs, rank 0's /metrics (paced by ``--scrape-interval``; a failed
scrape is an observation, never a training failure), and the spec the current attempt was created from (read from
its ConfigMap once per attempt). The only API reads here: that ConfigMap, the scrape, and a re-read of the run when
a new leader term starts or the decision finds the status stale.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from kubetitan_core import validation, warning_rules
from kubetitan import elastic, plan, policy, scraped
from kubetitan.decide.failure import nodes_to_avoid
from kubetitan import status as status_mod
from kubetitan.observation import NodeObs
from kubetitan.observation.pods import node_obs, pod_obs
from kubetitan.observation.snapshot import Scrape, Snapshot, all_nodes, child_names, children_of, nodes_of, pods_of
from kubetitan.observation.spec import spec_changes
from kubetitan.reconcile.context import APPLIED_SPEC_KEY, LEGACY_ANNOTATION_APPLIED_SPEC, Context
from kubetitan.reconcile.memory import Packed, RunMemory, spec_digest


def read_run(memory: RunMemory, body: Mapping[str, Any], now: float, pol: policy.Policy | None) -> Snapshot:
    """The object's part of the snapshot: identity, the status to start from, the spec's parse (pure)."""
    meta = body["metadata"]
    raw = memory.reread if memory.reread is not None else body.get("status")
    mine = memory.written
    written = mine is not None
    old = mine if mine is not None else status_mod.load(raw)
    # Against what the server holds: our last write, or (first cycle here) the read status less kopf's bookkeeping.
    old_raw = old.dump() if written else {k: v for k, v in (raw or {}).items() if k != "kopf"}
    lpt, errors, desired = parse(memory, body, pol)
    warnings = frozenset((w.rule, str(w)) for w in warning_rules.warnings_for(lpt)) if lpt is not None else frozenset()
    return Snapshot(body=body, namespace=meta.get("namespace", "default"), name=meta["name"], uid=meta["uid"],
                    generation=meta.get("generation"), now=now, status=old, status_raw=old_raw, status_written=written,
                    lpt=lpt, errors=tuple(errors), desired=desired, warnings=warnings)


async def observe(ctx: Context, memory: RunMemory, body: Mapping[str, Any], *, pods_index: Any, nodes_index: Any,
                  children_index: tuple[Any, Any] | None, pods_override: tuple[Any, ...] | None) -> Snapshot:
    """Read the run into a snapshot (see the module's docstring); a refused spec stops the read at the parse."""
    snap = read_run(memory, body, ctx.options.clock(), ctx.options.policy)
    if snap.invalid:
        return snap
    pods = pods_override if pods_override is not None else pods_of(pods_index, snap.uid)
    nodes = nodes_of(nodes_index, pods)
    if ctx.client is not None:
        nodes = await confirm_missing(nodes, ctx.client.get)
    snap = dataclasses.replace(snap, pods=pods, nodes=nodes, children_shown=children_of(children_index, snap.uid,
                                                                                         snap.name))
    if snap.lpt.spec.run_policy.elastic is not None:  # the nodes that fit one pod of the gang (only then: a walk)
        snap = dataclasses.replace(snap, capacity=elastic.run_capacity(
            snap.lpt, snap.attempt, nodes_to_avoid(snap.status.restarts), all_nodes(nodes_index), snap.now))
    current = snap.current
    if current and not memory.applied_loaded:  # before the scrape: the attempt's spec bounds its values too
        assert ctx.client is not None
        cm = await ctx.client.get("configmaps", snap.namespace, plan.config_map_name(snap.name))
        memory.applied_spec, memory.applied_loaded = applied_spec_of(cm), True
    scrape = await _scrape(ctx, memory, snap)
    missing = ()
    if current and snap.children_shown is not None:
        missing = memory.expected.missing(snap.attempt, {c: c in snap.children_shown for c in child_names(snap.name)})
    return dataclasses.replace(snap, scrape=scrape, applied_spec=memory.applied_spec, gate=_gate(memory, snap),
                               missing=missing, child_errors=memory.refusals.of(snap.attempt))


def applied_spec_of(cm: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The spec the attempt was created from, as its ConfigMap holds it (None: none there)."""
    raw = ((cm or {}).get("data") or {}).get(APPLIED_SPEC_KEY) or \
        (((cm or {}).get("metadata") or {}).get("annotations") or {}).get(LEGACY_ANNOTATION_APPLIED_SPEC)
    return json.loads(raw) if raw else None


async def confirm_missing(nodes: Mapping[str, NodeObs], get: Callable[..., Awaitable[Any]]) -> Mapping[str, NodeObs]:
    """The nodes that the index does not hold although a pod is bound to them, read from the API server.

    The node index and the pod index are fed by two watches, and nothing orders their events: a pod bound to a node
    that has just joined can arrive before that node does, and with ``nodeFailureGraceSeconds: 0`` the gang would be
    restarted for a node that exists. Only a node the API server does not have either is missing (one GET per
    absent node and cycle: absent nodes are rare)."""
    absent = [name for name, n in nodes.items() if not n.exists]
    if not absent:
        return nodes
    out = dict(nodes)
    for name in absent:
        out[name] = node_obs(name, await get("nodes", None, name))
    return MappingProxyType(out)


def parse(memory: RunMemory, body: Mapping[str, Any], pol: policy.Policy | None = None
          ) -> tuple[Any, list[Any], dict[str, Any]]:
    """``validation.parse`` of the object, then the admin policy's check of a valid one (``policy.Violation``s
    count as errors), cached while its spec is unchanged.

    The parse reads the spec and the immutable identity (apiVersion, kind, name, namespace, uid); status
    writes and kopf's annotation patches change none of them, so most cycles reuse the last result.
    """
    memo, digest = memory.memo, spec_digest(body.get("spec"))
    if memo.parsed is None or digest != memo.parsed_from:
        lpt, errors = validation.parse(dict(body))
        if lpt is not None and not errors and pol is not None:
            errors = list(policy.check(lpt, pol))
        desired = lpt.spec.model_dump(by_alias=True, exclude_none=True, mode="json") if lpt is not None else {}
        memo.parsed_from, memo.parsed = digest, (Packed.of(lpt) if lpt is not None else None, errors, desired)
        return lpt, errors, desired
    packed, errors, desired = memo.parsed
    return (packed.get() if packed is not None else None), errors, desired


def _gate(memory: RunMemory, snap: Snapshot) -> tuple[str | None, str | None, str | None]:
    """``status.spec_gate`` of the desired spec against the applied one, cached for the (applied, desired) pair."""
    applied, memo = memory.applied_spec, memory.memo
    if applied is None or snap.status.attempt is None:
        return None, None, None
    if memo.changes_for is None or memo.changes_for[0] is not applied or memo.changes_for[1] is not snap.desired:
        memo.changes_for = (applied, snap.desired)
        memo.gate = status_mod.spec_gate(applied, snap.lpt.spec, spec_changes(applied, snap.desired))
    return memo.gate


async def _scrape(ctx: Context, memory: RunMemory, snap: Snapshot) -> Scrape:
    """rank 0's /metrics when its pod runs and the last scrape is ``--scrape-interval`` old; every value checked
    (``scraped.check``) before it can enter the status."""
    rank0 = snap.rank0
    if rank0 is None or rank0.phase != "Running" or not rank0.pod_ip or ctx.scraper is None or \
            snap.now - memory.reported.last_scrape < ctx.options.scrape_interval * ctx.clock_rate():
        return Scrape()
    got = await ctx.scraper.scrape(ctx.session, rank0.pod_ip, snap.lpt.spec.monitoring.metrics_port, key=snap.uid)
    memory.reported.last_scrape = snap.now
    if got.reason is not None:
        ctx.metrics.scrape_failures.labels(got.reason).inc()
    if got.metrics is None:
        return Scrape(error=got.error, reason=got.reason)
    metrics, refused = scraped.check(got.metrics, attempt=snap.attempt, prev=snap.status.observation, now=snap.now,
                                     bounds=scraped.SpecBounds.of(snap.lpt.spec, memory.applied_spec))
    return Scrape(metrics=metrics, error=got.error, reason=got.reason, refused=tuple(refused))


async def reread(ctx: Context, memory: RunMemory, snap: Snapshot) -> None:
    """Take the API's status of the run (another replica moved it on) and forget the children this replica knew."""
    assert ctx.client is not None
    fresh = await ctx.client.get_run(snap.namespace, snap.name)
    memory.start_from(dict((fresh or {}).get("status") or {}))
    memory.forget_children()


async def rebuild(ctx: Context, memory: RunMemory, body: Mapping[str, Any]) -> tuple[Any, ...]:
    """Forget what this replica remembers of the run and read it from the API: the status and the pods by label."""
    meta = body["metadata"]
    ns, name, uid = meta.get("namespace", "default"), meta["name"], meta["uid"]
    assert ctx.client is not None
    async with memory.lock:
        memory.forget_children()
        memory.start_from(None)
        fresh = await ctx.client.get_run(ns, name)
        if fresh is not None and (fresh.get("metadata") or {}).get("uid") == uid:
            memory.reread = dict(fresh.get("status") or {})
        items = await ctx.client.list_pods(ns, f"{plan.LABEL_UID}={uid}")
    return tuple(p for p in (pod_obs(i) for i in items) if p is not None)
