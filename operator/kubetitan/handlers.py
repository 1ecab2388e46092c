"""The kopf edge of the operator: read, call the pure core, write status once, apply, send events.

One reconcile *cycle* of one LlamaPretrain (``cycle``):

1. parse + validate the object (invalid: ``Ready=False/InvalidSpec``, no children);
2. observe: its pods from the ``lpt_pods`` index, the nodes they run on, rank 0's ``/metrics``, folded into
   ``status.observation`` by ``status.track`` (timers survive an operator restart);
3. ``decide.decide`` -> a Decision, ``status.next_status`` -> the new status (the one status builder);
4. write the status through the status subresource (only when it changed);
5. delete / force-delete / create what the decision lists (``AlreadyExists`` is success);
6. send the decision's Kubernetes Event and update the operator metrics.

Cycles run from ``on.create``/``on.resume``/``on.update`` and from one daemon per LlamaPretrain, which
loops every ``--scan-interval`` seconds or as soon as a pod of the run changes (level-triggered,
edge-woken). A per-run lock keeps one cycle at a time. The operator deletes no child when a
LlamaPretrain is deleted: every child has an owner reference, and Kubernetes' garbage collector
removes them (the kmock test server emulates that collector).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kubetitan_core import GROUP, PLURAL, VERSION, validation, warning_rules
from kubetitan import __version__, plan, policy
from kubetitan import webhook as webhook_mod  # registers the admission handler (kopf.on.validate)
from kubetitan import conditions as C
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan import status as status_mod
from kubetitan.decide import Action, ChildError, decide, parse_time, restart_event
from kubetitan.kube import Client, ClientClosed, classify, load_config, message_of
from kubetitan.observe import node_obs, parse_metrics, pod_obs, scrape, spec_changes
from kubetitan.operator_metrics import OperatorMetrics

log = logging.getLogger("kubetitan.operator")
ANNOTATION_APPLIED_SPEC = "kubetitan.io/applied-spec"
"""On the run's ConfigMap: the spec (JSON) the current attempt was created from."""
FINALIZER = "kubetitan.io/finalizer"
ENSURED_SECONDS = 10.0
"""How long a child we created counts as existing while the pod index has not shown it yet."""


@dataclass
class Options:
    namespaces: list[str] = field(default_factory=list)
    all_namespaces: bool = False
    peering: str | None = None
    priority: int = 0
    metrics_port: int | None = 8080
    metrics_addr: str = "0.0.0.0"
    liveness: str | None = None
    kubeconfig: str | None = None
    scan_interval: float = 10.0
    """Seconds between two cycles of one run when nothing wakes it."""
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    hang_floor_seconds: float = float(AUTO_HANG_FLOOR_SECONDS)
    """The floor of ``runPolicy.hangTimeoutPolicy: Auto`` (``--hang-floor-seconds``)."""
    clock: Callable[[], float] = time.time
    """Source of 'now' for every decision; tests pass a faster clock instead of lowering API minimums."""
    policy: policy.Policy = field(default_factory=policy.Policy)
    """The cluster admin's policy (``--policy-*`` flags): a valid spec outside it is refused like an invalid one."""
    webhook: webhook_mod.WebhookOptions | None = None
    """The validating admission webhook (``--webhook-*``, ``--requester-checks``; kubetitan.webhook); None: none."""


@dataclass
class JobState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    status: LlamaPretrainStatus | None = None
    """The status this operator wrote last (the watch may still deliver an older one)."""
    api_status: dict[str, Any] | None = None
    """The status as just read from the API (after a fail-over): the next cycle starts from it, not the watch."""
    applied_spec: dict[str, Any] | None = None
    applied_loaded: bool = False
    last_scrape: float = float("-inf")
    metrics_text: dict[str, float] | None = None
    recovered_attempt: int = -1
    parsed_from: Any = None
    """The ``spec`` the cached parse below came from: a cycle re-validates only when the spec changed."""
    parsed: tuple[Any, list[Any], dict[str, Any]] | None = None
    """(LlamaPretrain or None, validation errors, the spec dumped in wire form)."""
    changes_for: tuple[Any, Any] | None = None
    changes: tuple[list[str], list[str], list[str]] = ([], [], [])
    """``spec_changes(applied, desired)`` for the (applied, desired) pair in ``changes_for``."""
    child_errors: tuple[ChildError, ...] = ()
    """Children the API refused on the last create of ``child_errors_attempt`` (fed to the next decision)."""
    child_errors_attempt: int = -1
    refusal_event: str | None = None
    """The refusal of a started run's spec last sent as a Warning Event (sent again only when it changes)."""
    done: bool = False
    """The run is finished and nothing is left to delete or to time: its daemon may end."""
    create_failures: int = 0
    """Creates in a row that the API refused (the retry backoff doubles with each)."""
    create_retry_at: float = float("-inf")
    """Monotonic time before which no create is sent again after a refusal (the backoff)."""
    ensured_attempt: int = -1
    ensured: dict[str, float] = field(default_factory=dict)
    """Children of ``ensured_attempt`` this operator created (or found existing), by monotonic time: the pod
    index lags behind our own creates, so a cycle woken by the first pod events must not POST the whole gang
    again. Entries expire after ``ENSURED_SECONDS``, so a child that vanished before the index saw it is
    created again (as before)."""


    warned: frozenset[tuple[str, str]] = frozenset()
    """The spec warnings (rule id, message: ``kubetitan_core.warning_rules``) this replica last sent as Warning
    Events for the run: each is sent once, and again only after it went away and came back."""

    children_seen: set[str] = field(default_factory=set)
    """The run's ConfigMap/Service names the indexes have shown (for ``ensured_attempt``): one absent after
    that was deleted (by hand) and is created again at once."""

    def forget_children(self) -> None:
        """Drop what this replica believes about children (after a fail-over, re-read from the API)."""
        self.ensured_attempt, self.ensured, self.children_seen = -1, {}, set()
        self.applied_spec, self.applied_loaded = None, False


@dataclass
class Context:
    options: Options
    cfg: Any
    metrics: OperatorMetrics
    client: Client | None = None
    session: Any = None
    jobs: dict[str, JobState] = field(default_factory=dict)

    def job(self, uid: str) -> JobState:
        if uid not in self.jobs:
            self.jobs[uid] = JobState()
        return self.jobs[uid]


def _ctx(memo: Any) -> Context:
    return memo["ctx"] if isinstance(memo, Mapping) else memo.ctx


# ------------------------------------------------------------------ kopf wiring
@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    import aiohttp

    ctx = _ctx(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubetitan.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kubetitan.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # only problems become Events; ours are sent explicitly
    settings.watching.server_timeout = 300
    # Namespaced mode with exact names: no cluster-wide namespace listing (it is 403 under a namespaced Role
    # and kopf then waits for it); only glob patterns ("team-*") need it.
    settings.scanning.disabled = not ctx.options.all_namespaces and not any(
        ch in ns for ns in ctx.options.namespaces for ch in "*?[!")
    settings.peering.name = ctx.options.peering or settings.peering.name
    settings.peering.priority = ctx.options.priority
    ctx.client = Client(ctx.cfg)
    ctx.session = aiohttp.ClientSession()
    webhook_mod.configure(settings, ctx.options.webhook)


@kopf.on.cleanup()
async def _cleanup(memo: Any, **_: Any) -> None:
    ctx = _ctx(memo)
    if ctx.session is not None:
        await ctx.session.close()
    if ctx.client is not None:
        await ctx.client.aclose()


@kopf.on.login()
def _login(memo: Any, **_: Any) -> Any:
    from kubetitan.kube import connection_info

    return connection_info(_ctx(memo).cfg, kopf)


@kopf.index("pods", labels={plan.LABEL_UID: kopf.PRESENT})
def lpt_pods(body: kopf.Body, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """Pods by their run's uid (only the fields the decision reads)."""
    obs = pod_obs(body)
    return {labels[plan.LABEL_UID]: obs} if obs is not None else {}


@kopf.index("nodes")
def lpt_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    """Health of every node by name (a watch, not one GET per node per cycle; kopf fills the index before any
    handler runs, so a node absent from it does not exist)."""
    return {name: node_obs(name, body)}


@kopf.index("configmaps", labels={plan.LABEL_UID: kopf.PRESENT})
def lpt_configmaps(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """The runs' ConfigMaps by run uid (a watch: one deleted by hand is seen gone at once)."""
    return {labels[plan.LABEL_UID]: name}


@kopf.index("services", labels={plan.LABEL_UID: kopf.PRESENT})
def lpt_services(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """The runs' headless Services by run uid (like ``lpt_configmaps``)."""
    return {labels[plan.LABEL_UID]: name}


@kopf.on.event("pods", labels={plan.LABEL_UID: kopf.PRESENT})
@kopf.on.event("configmaps", labels={plan.LABEL_UID: kopf.PRESENT})
@kopf.on.event("services", labels={plan.LABEL_UID: kopf.PRESENT})
def _pod_changed(labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """Wake the run's daemon at once when one of its children changes (a pod's phase, a ConfigMap deleted by
    hand): observation stays level-based, this only cuts the latency."""
    job = _ctx(memo).jobs.get(labels[plan.LABEL_UID])
    if job is not None:
        job.wake.set()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, memo: Any, lpt_pods: kopf.Index, lpt_nodes: kopf.Index,
                    lpt_configmaps: kopf.Index, lpt_services: kopf.Index, **_: Any) -> None:
    errors = await cycle(_ctx(memo), body, lpt_pods, nodes_index=lpt_nodes,
                         children_index=(lpt_configmaps, lpt_services))
    if isinstance(errors, list) and errors:  # (a float is the daemon's requeue delay)
        raise kopf.PermanentError("invalid spec: " + "; ".join(map(str, errors)))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0)
async def observe_run(body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, lpt_pods: kopf.Index,
                      lpt_nodes: kopf.Index, lpt_configmaps: kopf.Index, lpt_services: kopf.Index, **_: Any) -> None:
    """Re-run the cycle every scan interval, or as soon as one of the run's pods changes.

    kopf starts this daemon for each run when the operator starts, and again when a peering replica resumes
    after a higher-priority one went away (it stops daemons while paused). Either way the first cycle works
    from the API, not from memory: the run's status and its pods are read afresh (``_rebuild``). The daemon
    ends once the run is finished and nothing is left to clean up or to time (TTL).
    """
    ctx = _ctx(memo)
    job = ctx.job(body["metadata"]["uid"])
    pods: tuple[Any, ...] | None = None
    try:
        pods = await _rebuild(ctx, job, body)
    except Exception as e:  # noqa: BLE001 - then the first cycle uses the watched status and the index
        log.warning("Rebuilding the view of LlamaPretrain %s/%s from the API failed: %s",
                    body["metadata"].get("namespace"), body["metadata"]["name"], e)
    while not stopped:
        job.wake.clear()
        wait = ctx.options.scan_interval
        try:
            requeue = await cycle(ctx, body, lpt_pods, from_daemon=True, pods_override=pods, nodes_index=lpt_nodes,
                                  children_index=(lpt_configmaps, lpt_services))
            pods = None
            if job.done:
                log.debug("LlamaPretrain %s/%s is finished; its daemon ends", body["metadata"].get("namespace"),
                          body["metadata"]["name"])
                return
            if isinstance(requeue, float):
                wait = max(0.05, min(wait, requeue))
        except ClientClosed:  # the operator is stopping: its clean-up closed the client under this cycle
            log.debug("LlamaPretrain %s/%s: the operator is stopping; its daemon ends",
                      body["metadata"].get("namespace"), body["metadata"]["name"])
            return
        except Exception as e:  # noqa: BLE001 - the daemon must survive one bad cycle; it is counted and logged
            ctx.metrics.errors.labels(type(e).__name__).inc()
            log.exception("Reconcile of LlamaPretrain %s/%s failed", body["metadata"].get("namespace"),
                          body["metadata"]["name"])
        try:
            await asyncio.wait_for(job.wake.wait(), timeout=wait)
        except TimeoutError:
            pass


async def _rebuild(ctx: Context, job: JobState, body: Mapping[str, Any]) -> tuple[Any, ...]:
    """Forget what this replica remembers of the run and read it from the API: the status and the pods by label."""
    meta = body["metadata"]
    ns, name, uid = meta.get("namespace", "default"), meta["name"], meta["uid"]
    assert ctx.client is not None
    async with job.lock:
        job.forget_children()
        job.status, job.api_status, job.done = None, None, False
        fresh = await ctx.client.get_run(ns, name)
        if fresh is not None and (fresh.get("metadata") or {}).get("uid") == uid:
            job.api_status = dict(fresh.get("status") or {})
        items = await ctx.client.list_pods(ns, f"{plan.LABEL_UID}={uid}")
    return tuple(p for p in (pod_obs(i) for i in items) if p is not None)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def _forget(body: kopf.Body, memo: Any, **_: Any) -> None:
    """Children go with the owner references; only the run's metric series and memory go here."""
    ctx = _ctx(memo)
    ctx.metrics.forget(body["metadata"].get("namespace", ""), body["metadata"]["name"])
    ctx.jobs.pop(body["metadata"]["uid"], None)


# ------------------------------------------------------------------ one cycle
def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 merge patch turning ``old`` into ``new`` (removed keys become None)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out: dict[str, Any] = {}
    for k in old.keys() - new.keys():
        out[k] = None
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_patch(old[k], v)
    return out


async def cycle(ctx: Context, body: Mapping[str, Any], index: Any, from_daemon: bool = False,
                pods_override: tuple[Any, ...] | None = None, nodes_index: Any = None,
                children_index: tuple[Any, Any] | None = None) -> Any:
    """One observe -> decide -> write -> apply round; returns validation errors or the requeue delay.

    ``children_index``: the (``lpt_configmaps``, ``lpt_services``) indexes; None treats both as present."""
    started = time.perf_counter()
    meta = body["metadata"]
    ns, name, uid = meta.get("namespace", "default"), meta["name"], meta["uid"]
    job = ctx.job(uid)
    client = ctx.client
    assert client is not None
    try:
        async with job.lock:
            if meta.get("deletionTimestamp"):
                return None
            ctx.metrics.cycles.labels(ns, name).inc()
            now = ctx.options.clock()
            raw_status = job.api_status if job.api_status is not None else body.get("status")
            old = job.status if job.status is not None else status_mod.load(raw_status)
            lpt, errors, desired = _parse(job, body, ctx.options.policy)
            # A run that has started keeps being observed when its spec is refused later (a policy tightened by an
            # operator restart, an edit a Python-only rule refuses): its pods are never left untracked. The refusal
            # blocks the next attempt instead (spec_block below); only a run that never started is refused outright.
            refused_live = bool(errors) and lpt is not None and old.attempt is not None
            if (errors and not refused_live) or lpt is None:
                await _write_invalid(ctx, ns, name, old, errors, meta.get("generation"), now, job, body)
                return errors
            spec = lpt.spec
            warnings = {(w.rule, str(w)) for w in warning_rules.warnings_for(lpt)}
            for rule, message in sorted(warnings - job.warned):
                _event(body, "Warning", warning_rules.RULE_BY_ID[rule].reason, message)
            job.warned = frozenset(warnings)
            attempt = old.attempt if old.attempt is not None else 0
            if pods_override is not None:
                pods = pods_override
            else:
                pods = tuple(p for p in (index.get(uid, ()) if index is not None else ()) if p is not None)

            names = sorted({p.node_name for p in pods if p.node_name})
            nodes = {n: _node(nodes_index, n) for n in names}

            # rank 0's metrics: a failed scrape is reported (MetricsAvailable), never a training failure
            rank0 = next((p for p in pods if p.attempt == attempt and p.rank == 0), None)
            metrics = scrape_error = None
            if rank0 is not None and rank0.phase == "Running" and rank0.pod_ip and \
                    now - job.last_scrape >= ctx.options.scrape_interval * _clock_rate(ctx):
                text, scrape_error = await scrape(ctx.session, rank0.pod_ip, spec.monitoring.metrics_port,
                                                  ctx.options.scrape_timeout)
                job.last_scrape = now
                if text is not None:
                    try:
                        metrics = parse_metrics(text)
                    except ValueError as e:
                        scrape_error = f"rank 0's /metrics is not Prometheus text: {e}"
            seen = status_mod.track(old.observation, attempt, now, metrics=metrics, scrape_error=scrape_error,
                                    pods=pods, nodes=nodes)
            training = status_mod.training_status(spec, metrics, now, old.training) \
                if metrics and not seen.metrics_error else None

            # spec changes against what the current attempt was created from
            block = deferred = None
            current = [p for p in pods if p.attempt == attempt]
            if current and not job.applied_loaded:
                cm = await client.get("configmaps", ns, plan.config_map_name(name))
                raw = ((cm or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_APPLIED_SPEC)
                job.applied_spec = json.loads(raw) if raw else None
                job.applied_loaded = True
            if job.applied_spec is not None and old.attempt is not None:
                if job.changes_for is None or job.changes_for[0] is not job.applied_spec \
                        or job.changes_for[1] is not desired:
                    job.changes_for, job.changes = (job.applied_spec, desired), spec_changes(job.applied_spec, desired)
                _live, later, rejected = job.changes
                if rejected:
                    block = (f"changing {', '.join(rejected)} would make the run's checkpoints unusable; "
                             "revert it, or create a new LlamaPretrain")
                elif later:
                    deferred = f"{', '.join(later)} changed; applied when the next attempt starts " \
                               "(suspend and resume to apply now)"

            block_reason = None
            if refused_live:
                block_reason = C.POLICY_VIOLATION if all(isinstance(e, policy.Violation) for e in errors) \
                    else C.INVALID_SPEC
                block = (f"{'refused by the admin policy' if block_reason == C.POLICY_VIOLATION else 'invalid spec'}: "
                         f"{'; '.join(map(str, errors))}; a running attempt goes on as it was created (and is still "
                         "observed), but no new attempt starts until the spec complies")
                if block != job.refusal_event:
                    _event(body, "Warning", block_reason, block)
                job.refusal_event = block
            else:
                job.refusal_event = None
            child_errors = job.child_errors if job.child_errors_attempt == attempt else ()
            missing = _missing_children(job, uid, name, attempt, children_index) if current else ()
            steps_then = ((job.applied_spec or {}).get("training") or {}).get("steps") if current else None
            obs = status_mod.observed(seen, pods=pods, nodes=nodes, now=now, generation=meta.get("generation"),
                                      spec_block=block, spec_block_reason=block_reason,
                                      spec_deferred=deferred, training=training,
                                      child_errors=child_errors, missing_children=missing,
                                      attempt_steps=steps_then if isinstance(steps_then, int) else None,
                                      hang_floor_seconds=ctx.options.hang_floor_seconds)
            d = decide(spec, old, obs)
            if d.stale_status:
                # Another replica moved the run on while this one was paused: take the API's status, act later.
                fresh = await client.get_run(ns, name)
                job.status, job.api_status = None, dict((fresh or {}).get("status") or {})
                job.forget_children()
                log.warning("Re-read the status of LlamaPretrain %s/%s: %s", ns, name, d.message)
                return 0.0
            new = status_mod.next_status(spec, old, d, obs)

            # 4. status, once
            # Against what the server holds: our last write, or (first cycle here) the watched status.
            old_raw = old.dump() if job.status is not None else dict(raw_status or {})
            new_raw = new.dump()
            if old_raw != new_raw:
                await client.patch_status(ns, name, merge_patch(old_raw, new_raw))
            job.status, job.api_status = new, None

            # 5. apply
            deletes = [client.delete_pod(ns, n) for n in d.delete if n not in d.force_delete]
            deletes += [client.delete_pod(ns, n, grace_seconds=0) for n in d.force_delete]
            if deletes:
                await asyncio.gather(*deletes)
            requeue = d.requeue_after
            if d.action == Action.CREATE or d.recreate:
                # a refused create is retried after its backoff, however often the run is woken meanwhile
                retry = job.create_retry_at - time.monotonic()
                if retry <= 0:
                    retry = await _create_attempt(ctx, lpt, new, d.avoid_nodes, job, desired,
                                                  {p.name for p in current} | _shown_children(uid, name, children_index),
                                                  body) if d.action == Action.CREATE \
                        else await _create_attempt(ctx, lpt, new, (), job, desired, set(), body, only=d.recreate)
                if retry is not None:
                    requeue = retry if requeue is None else min(requeue, retry)
            elif job.child_errors and job.child_errors_attempt != new.attempt:
                job.child_errors = ()
            if d.delete_self:
                await client.delete_run(ns, name)

            # 6. events and metrics
            ev = restart_event(d, attempt)
            if ev is not None:
                _event(body, *ev)
            if d.action in (Action.RESTART, Action.RESTARTED_IN_PLACE) and d.cause:
                ctx.metrics.restarted(ns, name, d.cause, "InPlace" if d.action == Action.RESTARTED_IN_PLACE
                                      else "Recreate")
            ctx.metrics.set_phase(ns, name, new.phase, C.phase_reason(new.conditions, new.phase))
            ctx.metrics.set_training(ns, name, new.training, new.restart_count)
            job.done = d.action == Action.FINISHED and not d.delete and not d.force_delete \
                and d.requeue_after is None and not d.delete_self
            if d.action in (Action.RESTART, Action.CONTINUE):
                return 0.0  # the next attempt (or its backoff) is decided at once, not on the next pod event
            return requeue
    except Exception as e:
        if not from_daemon:
            ctx.metrics.errors.labels(type(e).__name__).inc()
        raise
    finally:
        ctx.metrics.reconcile.observe(time.perf_counter() - started)


def _event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the run (kopf posts it; only the active peering replica gets here)."""
    kopf.event(dict(body), type=type_, reason=reason, message=message)


def _parse(job: JobState, body: Mapping[str, Any], pol: policy.Policy | None = None
           ) -> tuple[Any, list[Any], dict[str, Any]]:
    """``validation.parse`` of the object, then the admin policy's check of a valid one (``policy.Violation``s
    count as errors), cached while its spec is unchanged.

    The parse reads the spec and the immutable identity (apiVersion, kind, name, namespace, uid); status
    writes and kopf's annotation patches change none of them, so most cycles reuse the last result.
    """
    spec = body.get("spec")
    if job.parsed is None or spec != job.parsed_from:
        lpt, errors = validation.parse(dict(body))
        if lpt is not None and not errors and pol is not None:
            errors = list(policy.check(lpt, pol))
        desired = lpt.spec.model_dump(by_alias=True, exclude_none=True, mode="json") if lpt is not None else {}
        job.parsed_from, job.parsed = copy.deepcopy(spec), (lpt, errors, desired)
    return job.parsed


def _missing_children(job: JobState, uid: str, name: str, attempt: int, indexes: tuple[Any, Any] | None
                      ) -> tuple[str, ...]:
    """The run's ConfigMap/Service that its indexes do not show: once shown and now gone (deleted), or never
    shown and not created by this replica moments ago (the index lags behind our own creates)."""
    if indexes is None:
        return ()
    if job.ensured_attempt != attempt:
        job.ensured_attempt, job.ensured, job.children_seen = attempt, {}, set()
    mono, out = time.monotonic(), []
    for index, child in zip(indexes, (plan.config_map_name(name), plan.service_name(name)), strict=True):
        if child in index.get(uid, ()):
            job.children_seen.add(child)
        elif child in job.children_seen or mono - job.ensured.get(child, float("-inf")) >= ENSURED_SECONDS:
            out.append(child)
    return tuple(out)


def _shown_children(uid: str, name: str, indexes: tuple[Any, Any] | None) -> set[str]:
    """The run's ConfigMap/Service names that the ``lpt_configmaps``/``lpt_services`` indexes show."""
    if indexes is None:
        return set()
    return {child for index, child in zip(indexes, (plan.config_map_name(name), plan.service_name(name)), strict=True)
            if child in index.get(uid, ())}


def _node(index: Any, name: str) -> Any:
    """The node's health from the ``lpt_nodes`` index; absent from the index means absent from the API."""
    hit = next(iter(index.get(name, ())), None) if index is not None else None
    return hit if hit is not None else node_obs(name, None)


def _clock_rate(ctx: Context) -> float:
    """How many clock seconds pass per real second (1 in production; tests run faster clocks)."""
    return getattr(ctx.options.clock, "rate", 1.0)


async def _write_invalid(ctx: Context, ns: str, name: str, old: LlamaPretrainStatus, errors: list[Any],
                         generation: int | None, now: float, job: JobState, body: Mapping[str, Any]) -> None:
    refused = bool(errors) and all(isinstance(e, policy.Violation) for e in errors)
    new = status_mod.invalid_status(old, errors, generation, now, C.POLICY_VIOLATION if refused else C.INVALID_SPEC)
    old_raw = old.dump() if job.status is not None else {}
    if new.dump() != old_raw:
        assert ctx.client is not None
        await ctx.client.patch_status(ns, name, merge_patch(old_raw, new.dump()))
        if refused and new.message != old.message:
            _event(body, "Warning", C.POLICY_VIOLATION, new.message or "")
    job.status = new
    ctx.metrics.set_phase(ns, name, new.phase, C.phase_reason(new.conditions, new.phase))


CREATE_RETRY_BASE_SECONDS = 0.5
CREATE_RETRY_CAP_SECONDS = 60.0


async def _create_attempt(ctx: Context, lpt: Any, status: LlamaPretrainStatus, avoid: tuple[str, ...],
                          job: JobState, desired: dict[str, Any], present: set[str], body: Mapping[str, Any],
                          only: tuple[str, ...] | None = None) -> float | None:
    """Create every child of the current attempt that is not known to exist; existing ones (ours) count as created.

    ``present``: the attempt's pods the index shows and the ConfigMap/Service their indexes show (the ConfigMap is
    still written once per attempt: it carries the attempt's spec). Children this operator created moments ago
    count as existing too (``JobState.ensured``), so the cycles woken by their own watch events send nothing,
    and a create the API refused is not sent again before its backoff (``JobState.create_retry_at``).
    A child the API refuses (403, 422, a name held by an object that is not ours, or 429/5xx after the
    client's retries) becomes a ``ChildrenCreated=False`` condition on the next cycle and one Warning Event
    ``FailedCreate`` per new error; the create is retried after a capped, jittered backoff (the returned
    delay). Never a restart: a child that was never seen is simply created again.

    ``only``: create just these ConfigMap/Service names (deleted by hand while the attempt goes on), rendered
    from the spec the attempt was created from, not a newer one that waits for the next attempt.
    """
    client = ctx.client
    assert client is not None
    attempt = status.attempt or 0
    status_name = lpt.metadata.name
    if job.ensured_attempt != attempt:
        job.ensured_attempt, job.ensured = attempt, {}
    mono = time.monotonic()

    def needed(name: str) -> bool:
        if only is not None:
            return name in only
        if name == plan.config_map_name(status_name) and name not in job.ensured:
            return True  # shared by every attempt: written once per attempt (its applied spec)
        return name not in present and mono - job.ensured.get(name, float("-inf")) >= ENSURED_SECONDS

    spec_of_attempt = desired
    if only is not None and job.applied_spec is not None and job.applied_spec != desired:
        then, errs = validation.parse({**dict(body), "spec": job.applied_spec})
        if then is not None and not errs:
            lpt, spec_of_attempt = then, job.applied_spec
    start = parse_time(status.start_time)
    children = plan.attempt_children(lpt, attempt, job_start_time=start, avoid_nodes=avoid,
                                     hang_floor_seconds=ctx.options.hang_floor_seconds)
    applied = json.dumps(spec_of_attempt, sort_keys=True, separators=(",", ":"))
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    cm["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED_SPEC] = applied
    others = [c for c in children if c["kind"] == "Service" and needed(c["metadata"]["name"])]
    pods = [c for c in children if c["kind"] == "Pod" and only is None and needed(c["metadata"]["name"])]
    ns = cm["metadata"]["namespace"]
    errors: list[ChildError] = []

    async def one(o: dict[str, Any]) -> bool:
        """Create ``o``; False (and an entry in ``errors``) when the API refused it."""
        try:
            return await client.create(o)
        except (ApiException, *aiohttp_errors()) as e:
            errors.append(ChildError(o["kind"], o["metadata"]["name"], classify(e), message_of(e)))
            return False

    if needed(cm["metadata"]["name"]):
        created = await one(cm)
        if not created and not errors:  # ours, shared by all attempts: bring it up to date
            await client.patch("configmaps", ns, cm["metadata"]["name"],
                               {"metadata": {"annotations": cm["metadata"]["annotations"]}, "data": cm["data"]})
        if not errors:
            job.ensured[cm["metadata"]["name"]] = mono
            job.applied_spec, job.applied_loaded = spec_of_attempt, True
    # Service and pods concurrently; the client's semaphore bounds the requests in flight. Pods wait for a
    # ConfigMap/Service the API refused: without them the gang cannot start.
    ok = await asyncio.gather(*(one(o) for o in others))
    for o, _ in zip(others, ok, strict=True):
        if not any(e.name == o["metadata"]["name"] for e in errors):
            job.ensured[o["metadata"]["name"]] = mono
    made: list[dict[str, Any]] = []
    if not errors:
        await asyncio.gather(*(one(o) for o in pods))
        made = [o for o in pods if not any(e.name == o["metadata"]["name"] for e in errors)]
        for o in made:
            job.ensured[o["metadata"]["name"]] = mono
    old_keys = {(e.kind, e.name, e.reason) for e in job.child_errors} if job.child_errors_attempt == attempt else set()
    job.child_errors, job.child_errors_attempt = tuple(errors), attempt
    if errors:
        job.create_failures += 1
        for e in errors:
            if (e.kind, e.name, e.reason) not in old_keys:
                _event(body, "Warning", "FailedCreate", f"Error creating {e.kind} {e.name}: {e.reason}: {e.message}")
        log.warning("Creating attempt %s of LlamaPretrain %s/%s: the API refused %d object(s): %s %s: %s",
                    attempt, ns, lpt.metadata.name, len(errors), errors[0].kind, errors[0].name, errors[0].message)
        cap = min(CREATE_RETRY_CAP_SECONDS, CREATE_RETRY_BASE_SECONDS * 2 ** min(job.create_failures - 1, 10))
        delay = random.uniform(cap / 2, cap)  # real seconds: the API server's pace, not the training clock's
        job.create_retry_at = time.monotonic() + delay
        return delay
    job.create_failures, job.create_retry_at = 0, float("-inf")
    if only is not None:
        for child in only:  # shown gone; now created again: not "missing" until the index has shown it
            job.children_seen.discard(child)
            job.ensured[child] = mono
        _event(body, "Normal", "RecreatedChildren", f"Created {', '.join(only)} again (deleted while attempt "
               f"{attempt} runs); the pods go on")
        log.info("Recreated %s of LlamaPretrain %s/%s (deleted while attempt %s runs)", ", ".join(only), ns,
                 lpt.metadata.name, attempt)
        return None
    if status.restarts and status.restarts[-1].attempt == attempt - 1 and job.recovered_attempt != attempt:
        t0 = parse_time(status.restarts[-1].time)
        if t0 is not None:
            ctx.metrics.recovery.observe(max(0.0, ctx.options.clock() - t0) / _clock_rate(ctx))
        job.recovered_attempt = attempt
    if made:
        log.info("Created attempt %s of LlamaPretrain %s/%s (%d pods)", attempt, ns, lpt.metadata.name, len(made))
    return None


def aiohttp_errors() -> tuple[type[BaseException], ...]:
    """Transport errors that outlive the client's retries (reported like an API refusal, retried later)."""
    import aiohttp

    return (aiohttp.ClientError, TimeoutError)


# ------------------------------------------------------------------ running it
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubetitan operator", description="Run the kubetitan operator (kopf).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (cluster-wide)")
    p.add_argument("--peering", metavar="NAME",
                   help="HA: coordinate replicas through the KopfPeering NAME; only the highest-priority one acts")
    p.add_argument("--priority", type=int, default=0, help="peering priority of this replica (default 0)")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of the operator's /metrics (0: off)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--scan-interval", type=float, default=10.0, help="seconds between cycles of a run (default 10)")
    p.add_argument("--scrape-interval", type=float, default=15.0,
                   help="seconds between scrapes of rank 0's /metrics (default 15)")
    p.add_argument("--hang-floor-seconds", type=_positive_seconds, default=float(AUTO_HANG_FLOOR_SECONDS),
                   metavar="S", help=f"the least the Auto hang timeout waits for a step, whatever the step time "
                   f"(default {AUTO_HANG_FLOOR_SECONDS}; runPolicy.hangTimeoutPolicy)")
    p.add_argument("--log-format", choices=["json", "plain", "full"], default="json",
                   help="log format (default json: one structured object per line)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    policy.add_flags(p)
    webhook_mod.add_flags(p)
    return p


def options_from_args(a: argparse.Namespace) -> Options:
    return Options(namespaces=list(a.namespace), all_namespaces=a.all_namespaces, peering=a.peering,
                   priority=a.priority, metrics_port=a.metrics_port or None, liveness=a.liveness,
                   kubeconfig=a.kubeconfig, scan_interval=a.scan_interval, scrape_interval=a.scrape_interval,
                   hang_floor_seconds=a.hang_floor_seconds, policy=policy.from_flags(a),
                   webhook=webhook_mod.from_args(a))


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (e.g. 30)")
    return v


def run(options: Options, stop_flag: Any = None, ready_flag: Any = None,
        registry: Any = None) -> OperatorMetrics:
    """Run the operator until ``stop_flag`` is set (blocking); returns its metrics (for tests)."""
    if not options.namespaces and not options.all_namespaces:
        raise SystemExit("error: say which namespaces to watch: --namespace NS (repeatable) or --all-namespaces")
    cfg = load_config(options.kubeconfig)
    metrics = OperatorMetrics(registry)
    ctx = Context(options=options, cfg=cfg, metrics=metrics)
    server = None
    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(options.metrics_port, options.metrics_addr, registry=metrics.registry)
    try:
        asyncio.run(kopf.operator(
            clusterwide=options.all_namespaces, namespaces=options.namespaces,
            standalone=options.peering is None, peering_name=options.peering, priority=options.priority,
            liveness_endpoint=options.liveness, stop_flag=stop_flag, ready_flag=ready_flag,
            memo=kopf.Memo(ctx=ctx),
        ))
    finally:
        if server is not None:
            server.shutdown()
    return metrics


def main(argv: list[str]) -> int:
    """``kubetitan operator ...``: the CLI entry point (``kubetitan.cli`` forwards to it)."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        policy.from_flags(a)
    except policy.PolicyError as e:
        p.error(str(e))
    fmt = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}[a.log_format]
    kopf.configure(verbose=a.verbose, log_format=fmt, log_refkey="object")
    if not a.verbose:
        # kopf logs every handler call per object at info ("Handler '_pod_changed' succeeded", once per pod
        # event); keep its warnings and errors, and the operator's own info lines.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    log.info("Started kubetitan operator", extra={"version": __version__,
                                                  "policy": policy.from_flags(a).describe()})
    try:
        run(options_from_args(a))
    except KeyboardInterrupt:
        return 0
    return 0
