"""The kopf edge of the operator: read, call the pure core, write status once, apply, send events.

One reconcile *cycle* of one LlamaPretrain (``cycle``):

1. parse + validate the object (invalid: ``Ready=False/InvalidSpec``, no children);
2. observe: its pods from the ``lpt_pods`` index, the nodes they run on, rank 0's ``/metrics``, folded into
   ``status.observation`` by ``status.track`` (timers survive an operator restart);
3. ``decide.decide`` -> a Decision, ``status.next_status`` -> the new status (the one status builder);
4. write the status through the status subresource (only when it changed);
5. delete / force-delete / create what the decision lists (``AlreadyExists`` is success);
6. send the Events the status change carries (``status.pendingEvents``: written with the change, sent after it,
   cleared once sent, so an operator killed in between sends them when it resumes) and update the metrics.

Events are aggregated like client-go's recorder (``kubetitan.events``): one Event per (run, type, reason,
message), counted. A live attempt's pods are rendered only from the spec the attempt was created from (the
ConfigMap's applied-spec annotation): an edit never changes or adds to a running gang.

Cycles run from one daemon per LlamaPretrain, which kopf starts when it first sees the run (created, or
found at operator start) and which loops every ``--scan-interval`` seconds or as soon as the run's spec
or one of its children changes (level-triggered, edge-woken). A per-run lock keeps one cycle at a time.
There are no kopf change handlers (``on.create``/``on.update``/``on.resume``/``on.delete``): kopf keeps no
progress or diff-base record on the object, only the daemons' finalizer (its bookkeeping storage is
``status.kopf``, used at most for a deletion's "touch"). The operator deletes no child when a
LlamaPretrain is deleted: every child has an owner reference, and Kubernetes' garbage collector
removes them (the kmock test server emulates that collector).

One writer (``--leader-elect``, ``kubetitan.leader``): every replica watches; only the holder of the leader
Lease writes. Each daemon waits for the Lease, re-reads its run from the API whenever a new term starts,
and abandons a cycle as soon as a write is refused by the fence (``leader.NotLeader``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import copy
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kubetitan_core import GROUP, PLURAL, VERSION, validation, warning_rules
from kubetitan import __version__, fanout, plan, policy, scraped
from kubetitan import webhook as webhook_mod  # registers the admission handler (kopf.on.validate)
from kubetitan import conditions as C
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan import status as status_mod
from kubetitan.decide import Action, ChildError, decide, parse_time
from kubetitan.events import Recorder
from kubetitan.kube import Client, ClientClosed, FencedWrite, classify, load_config, message_of, transient
from kubetitan.leader import AlwaysLeader, LeaderElector, LeaseConfig, NotLeader
from kubetitan import logs
from kubetitan.observe import (
    DEFAULT_SCRAPE_CONCURRENCY, DEFAULT_SCRAPE_MAX_BYTES, DEFAULT_SCRAPE_TIMEOUT_SECONDS, Scraper, ScrapeLimits,
    node_obs, pod_obs, spec_changes,
)
from kubetitan.operator_metrics import OperatorMetrics

log = logging.getLogger("kubetitan.operator")
ANNOTATION_APPLIED_SPEC = "kubetitan.io/applied-spec"
"""On the run's ConfigMap: the spec (JSON) the current attempt was created from."""
FINALIZER = "kubetitan.io/finalizer"
ENSURED_SECONDS = 10.0
"""How long a child we created counts as existing while the pod index has not shown it yet (and a pod we deleted
as deleted: the same DELETE is not sent again while the index still shows the pod)."""


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
    scrape_timeout: float = DEFAULT_SCRAPE_TIMEOUT_SECONDS
    """The most one scrape of rank 0's /metrics may take (``--scrape-timeout``)."""
    scrape_max_bytes: int = DEFAULT_SCRAPE_MAX_BYTES
    """The most bytes of one /metrics body the operator reads (``--scrape-max-bytes``)."""
    scrape_concurrency: int = DEFAULT_SCRAPE_CONCURRENCY
    """Scrapes in flight at once across all runs (``--scrape-concurrency``)."""
    hang_floor_seconds: float = float(AUTO_HANG_FLOOR_SECONDS)
    """The floor of ``runPolicy.hangTimeoutPolicy: Auto`` (``--hang-floor-seconds``)."""
    clock: Callable[[], float] = time.time
    """Source of 'now' for every decision; tests pass a faster clock instead of lowering API minimums."""
    policy: policy.Policy = field(default_factory=policy.Policy)
    """The cluster admin's policy (``--policy-*`` flags): a valid spec outside it is refused like an invalid one."""
    leader: LeaseConfig | None = None
    """Leader election (``--leader-elect``): only the holder of this Lease writes. None: this replica always writes
    (alone, or under kopf peering)."""
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
    gate: tuple[str | None, str | None, str | None] = (None, None, None)
    """``status.spec_gate`` (block, its reason, deferred) for the same pair."""
    child_errors: tuple[ChildError, ...] = ()
    """Children the API refused on the last create of ``child_errors_attempt`` (fed to the next decision)."""
    child_errors_attempt: int = -1
    refused_values: frozenset[tuple[str, str]] = frozenset()
    """The scraped values last refused (``scraped.signature``): a Warning Event only when this changes."""
    done: bool = False
    """The run is finished and nothing is left to delete or to time: its daemon may end."""
    create_failures: int = 0
    """Creates in a row that the API refused (the retry backoff doubles with each)."""
    create_retry_at: float = float("-inf")
    """Monotonic time before which no create is sent again after a refusal (the backoff)."""
    deleted: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    """Pods this replica sent a DELETE for: name -> (monotonic time, grace seconds or None). Within
    ``ENSURED_SECONDS`` the same delete is not sent again (the pod index lags behind our own deletes); a force
    delete (grace 0) of a pod deleted gracefully still goes."""
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

    term: int = 0
    """The leader term this replica last read the run in (``leader.term``): a new term re-reads it from the API."""
    generation: Any = None
    """The run's ``metadata.generation`` last seen by ``_run_changed`` (a new one wakes the daemon)."""
    spec_errors: str | None = None
    """The spec errors last logged for the run (logged again only when they change)."""

    def forget_children(self) -> None:
        """Drop what this replica believes about children (after a fail-over, re-read from the API)."""
        self.ensured_attempt, self.ensured, self.children_seen, self.deleted = -1, {}, set(), {}
        self.applied_spec, self.applied_loaded = None, False


@dataclass
class Context:
    options: Options
    cfg: Any
    metrics: OperatorMetrics
    client: Client | None = None
    session: Any = None
    scraper: Scraper | None = None
    jobs: dict[str, JobState] = field(default_factory=dict)
    leader: Any = field(default_factory=AlwaysLeader)
    """The write fence: ``LeaderElector`` with ``--leader-elect``, else ``AlwaysLeader``."""
    leader_task: asyncio.Task[None] | None = None
    kopf_sessions: list[Any] = field(default_factory=list)
    """aiohttp sessions handed to kopf (``_login``): closed when the operator has stopped."""
    cert_task: asyncio.Task[None] | None = None
    """Keeps the webhook's own certificates (``--webhook-certificates operator``; kubetitan.certsync)."""
    access_cache: Any = None
    """The admission webhook's SubjectAccessReview answers (``kubetitan.access_cache.AccessCache``, made on first
    use)."""
    _recorder: Recorder | None = None

    @property
    def recorder(self) -> Recorder:
        """The Event recorder (aggregating, exactly-once for status changes) on this operator's client."""
        if self._recorder is None or self._recorder.client is not self.client:
            self._recorder = Recorder(self.client)
        return self._recorder

    def job(self, uid: str) -> JobState:
        if uid not in self.jobs:
            self.jobs[uid] = JobState()
        return self.jobs[uid]


def _ctx(memo: Any) -> Context:
    return memo["ctx"] if isinstance(memo, Mapping) else memo.ctx


_RUNNING: contextvars.ContextVar[Context] = contextvars.ContextVar("kubetitan_operator")
"""The running operator's Context (set by ``run`` before kopf starts; every kopf task inherits it): ``_event``
reads its fence."""


def _client(ctx: Context) -> Client:
    """The operator's API client, created once (``_login`` may run before ``_startup``)."""
    if ctx.client is None:
        ident = ctx.options.leader.identity if ctx.options.leader is not None else os.environ.get("POD_NAME", "")
        ctx.client = Client(ctx.cfg, user_agent=f"kubetitan-operator/{__version__}" + (f" ({ident})" if ident else ""),
                            fence=ctx.leader)
    return ctx.client


def _leadership_changed(ctx: Context, leading: bool) -> None:
    """Wake every run's daemon on a new term (they re-read their run); drop the per-run metric series on losing it
    (only the leader exports them, so Prometheus never sums two replicas' views)."""
    ctx.metrics.leader.set(1 if leading else 0)
    if leading:
        for job in ctx.jobs.values():
            job.wake.set()
    else:
        ctx.metrics.forget_all()


# ------------------------------------------------------------------ kopf wiring
@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    import aiohttp

    ctx = _ctx(memo)
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping in status.kopf (preserved by the CRD's schema), never in annotations: a run whose own
    # annotations fill the API's 256 KiB limit is still reconciled and deleted. The diff-base (only used if a
    # change handler is ever added) leaves annotations out.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(name="kopf")
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        name="kopf", ignored_fields=["metadata.annotations"])
    # Only the operator's explicit Events (``_event``, fenced) are posted; kopf does not turn log lines into Events.
    settings.posting.loggers = False
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Namespaced mode with exact names: no cluster-wide namespace listing (it is 403 under a namespaced Role
    # and kopf then waits for it); only glob patterns ("team-*") need it.
    settings.scanning.disabled = not ctx.options.all_namespaces and not any(
        ch in ns for ns in ctx.options.namespaces for ch in "*?[!")
    settings.peering.name = ctx.options.peering or settings.peering.name
    settings.peering.priority = ctx.options.priority
    _client(ctx)
    ctx.session = aiohttp.ClientSession()
    ctx.scraper = Scraper(ScrapeLimits(max_bytes=ctx.options.scrape_max_bytes, timeout=ctx.options.scrape_timeout,
                                       concurrency=ctx.options.scrape_concurrency))
    if isinstance(ctx.leader, LeaderElector):
        ctx.leader_task = asyncio.create_task(ctx.leader.run(), name="leader election")
    ctx.cert_task = webhook_mod.configure(settings, ctx.options.webhook, ctx.client)


@kopf.on.cleanup()
async def _cleanup(memo: Any, **_: Any) -> None:
    ctx = _ctx(memo)
    for task in (ctx.leader_task, ctx.cert_task):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await ctx.leader.release()  # stops writing first, then hands the Lease over: a standby takes over at once
    if ctx.session is not None:
        await ctx.session.close()
    if ctx.scraper is not None:
        ctx.scraper.close()
    if ctx.client is not None:
        await ctx.client.aclose()


@kopf.on.login()
async def _login(memo: Any, **_: Any) -> Any:
    """kopf's own requests go through a session of the operator's client: its credentials, User-Agent and fence."""
    ctx = _ctx(memo)
    session = _client(ctx).kopf_session()
    ctx.kopf_sessions.append(session)
    return kopf.AiohttpSession(aiohttp_session=session, server=ctx.cfg.host.rstrip("/"))


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


@kopf.on.event(GROUP, VERSION, PLURAL)
def _run_changed(type: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:  # noqa: A002 - kopf's kwarg
    """Wake the run's daemon when its spec changes (a new ``metadata.generation``); forget a deleted run's metric
    series and memory. Writes nothing (kopf keeps no record of event handlers)."""
    ctx = _ctx(memo)
    meta = body.get("metadata") or {}
    if type == "DELETED":
        ctx.metrics.forget(meta.get("namespace", ""), meta.get("name", ""))
        ctx.jobs.pop(meta.get("uid", ""), None)
        return
    job = ctx.jobs.get(meta.get("uid", ""))
    if job is not None and job.generation != meta.get("generation"):
        job.generation = meta.get("generation")
        job.wake.set()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=1.0, cancellation_timeout=2.0)
async def observe_run(body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, lpt_pods: kopf.Index,
                      lpt_nodes: kopf.Index, lpt_configmaps: kopf.Index, lpt_services: kopf.Index, **_: Any) -> None:
    """Reconcile the run: a cycle at once, then every scan interval, or as soon as its spec or a child changes.

    kopf starts this daemon for each run when it first sees it (created, or found at operator start), and again
    when a peering replica resumes (kopf stops daemons while paused). With ``--leader-elect`` the daemon of a
    standby waits for the Lease. Whenever this replica starts a new term (and at the first cycle), the run is read
    from the API, not from memory (``_rebuild``). A cycle whose write the fence refuses is abandoned. The daemon
    ends once the run is finished and nothing is left to clean up or to time (TTL).
    """
    ctx = _ctx(memo)
    meta = body["metadata"]
    ns, name = meta.get("namespace"), meta["name"]
    job = ctx.job(meta["uid"])
    job.generation = meta.get("generation")
    job.term = -1  # a (re)started daemon reads its run from the API first (after a peering pause, too)
    pods: tuple[Any, ...] | None = None
    while not stopped:
        job.wake.clear()
        wait = ctx.options.scan_interval
        if not ctx.leader.leading and not await _until_leading(ctx, stopped):
            return  # stopped while standing by
        try:
            if job.term != ctx.leader.term:
                job.term = ctx.leader.term
                try:
                    pods = await _rebuild(ctx, job, body)
                except (NotLeader, ClientClosed):
                    raise
                except Exception as e:  # noqa: BLE001 - then the cycle uses the watched status and the index
                    log.warning("Reading LlamaPretrain %s/%s from the API failed (the cycle uses the watched "
                                "state): %s", ns, name, message_of(e))
            result = await cycle(ctx, body, lpt_pods, from_daemon=True, pods_override=pods, nodes_index=lpt_nodes,
                                 children_index=(lpt_configmaps, lpt_services))
            pods = None
            if isinstance(result, list):
                _log_spec_errors(job, ns, name, result)
            if job.done:
                log.debug("LlamaPretrain %s/%s is finished; its daemon ends", ns, name)
                return
            if isinstance(result, float):
                wait = max(0.05, min(wait, result))
        except (NotLeader, FencedWrite) as e:
            log.info("Abandoned a cycle of LlamaPretrain %s/%s: %s", ns, name, e)
            continue
        except ClientClosed:  # the operator is stopping: its clean-up closed the client under this cycle
            log.debug("LlamaPretrain %s/%s: the operator is stopping; its daemon ends", ns, name)
            return
        except Exception as e:  # noqa: BLE001 - the daemon must survive one bad cycle; it is counted and logged
            if transient(e):
                ctx.metrics.api_unavailable.inc()
                log.warning("The Kubernetes API was unavailable during a cycle of LlamaPretrain %s/%s (the next "
                            "cycle retries in %g s): %s", ns, name, wait, message_of(e))
            else:
                ctx.metrics.errors.labels(type(e).__name__).inc()
                log.exception("Reconcile of LlamaPretrain %s/%s failed", ns, name)
        await _first(wait, job.wake.wait(), _stopping(stopped))


async def _stopping(stopped: Any) -> None:
    await stopped.wait()


async def _first(timeout: float | None, *aws: Any) -> bool:
    """Wait until the first of ``aws`` is done (True) or ``timeout`` passes (False); cancel the others.

    A daemon that waits this way for its wake-up *or* its stop flag exits within kopf's graceful window
    (``cancellation_backoff``) when the operator stops: kopf never has to cancel it (which it logs as a warning per
    run)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
    return bool(done)


async def _until_leading(ctx: Context, stopped: Any) -> bool:
    """Wait until this replica leads (True) or the daemon is asked to stop (False)."""
    await _first(None, ctx.leader.wait(), _stopping(stopped))
    return bool(ctx.leader.leading) and not stopped


def _log_spec_errors(job: JobState, ns: str | None, name: str, errors: list[Any]) -> None:
    """A tenant's spec mistake: one warning naming the run when the errors change (the status and an Event say it
    too); not an operator error."""
    text = "; ".join(map(str, errors)) or None
    if text != job.spec_errors and text is not None:
        log.warning("LlamaPretrain %s/%s has a spec the operator refuses: %s", ns, name, text,
                    extra={"object": {"namespace": ns, "name": name, "kind": "LlamaPretrain"}})
    job.spec_errors = text


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
                await _event(ctx, body, "Warning", warning_rules.RULE_BY_ID[rule].reason, message)
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
            metrics = scrape_error = scrape_reason = None
            if rank0 is not None and rank0.phase == "Running" and rank0.pod_ip and ctx.scraper is not None and \
                    now - job.last_scrape >= ctx.options.scrape_interval * _clock_rate(ctx):
                got = await ctx.scraper.scrape(ctx.session, rank0.pod_ip, spec.monitoring.metrics_port)
                job.last_scrape = now
                metrics, scrape_error, scrape_reason = got.metrics, got.error, got.reason
                if got.reason is not None:
                    ctx.metrics.scrape_failures.labels(got.reason).inc()
                if metrics is not None:  # every value checked before it can enter the status
                    metrics, refused = scraped.check(metrics, attempt=attempt, prev=old.observation, now=now)
                    await _report_refused(ctx, body, job, refused)
            seen = status_mod.track(old.observation, attempt, now, metrics=metrics, scrape_error=scrape_error,
                                    scrape_reason=scrape_reason, pods=pods, nodes=nodes)
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
            block_reason = None
            if job.applied_spec is not None and old.attempt is not None:
                if job.changes_for is None or job.changes_for[0] is not job.applied_spec \
                        or job.changes_for[1] is not desired:
                    job.changes_for, job.changes = (job.applied_spec, desired), spec_changes(job.applied_spec, desired)
                    job.gate = status_mod.spec_gate(job.applied_spec, spec, job.changes)
                block, block_reason, deferred = job.gate
            if refused_live:  # (its Warning Event comes with the SpecAccepted=False transition, in the status)
                block_reason = C.POLICY_VIOLATION if all(isinstance(e, policy.Violation) for e in errors) \
                    else C.INVALID_SPEC
                block = (f"{'refused by the admin policy' if block_reason == C.POLICY_VIOLATION else 'invalid spec'}: "
                         f"{'; '.join(map(str, errors))}; a running attempt goes on as it was created (and is still "
                         "observed), but no new attempt starts until the spec complies")
            child_errors = job.child_errors if job.child_errors_attempt == attempt else ()
            missing = _missing_children(job, uid, name, attempt, children_index) if current else ()
            steps_then = ((job.applied_spec or {}).get("training") or {}).get("steps") if current else None
            nodes_then = ((job.applied_spec or {}).get("resources") or {}).get("nodes") if current else None
            obs = status_mod.observed(seen, pods=pods, nodes=nodes, now=now, generation=meta.get("generation"),
                                      spec_block=block, spec_block_reason=block_reason,
                                      spec_deferred=deferred, training=training,
                                      child_errors=child_errors, missing_children=missing,
                                      attempt_steps=steps_then if isinstance(steps_then, int) else None,
                                      attempt_nodes=nodes_then if isinstance(nodes_then, int) else None,
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
            old_raw = old.dump() if job.status is not None else \
                {k: v for k, v in (raw_status or {}).items() if k != "kopf"}  # kopf's bookkeeping is not ours
            new_raw = new.dump()
            if old_raw != new_raw:
                await client.patch_status(ns, name, merge_patch(old_raw, new_raw))
            job.status, job.api_status = new, None
            # the metrics follow the status written, before anything else is awaited: whoever sees the
            # status (or any effect after it: pods, Events) sees the same phase, restarts and training gauges
            if d.action in (Action.RESTART, Action.RESTARTED_IN_PLACE) and d.cause:
                ctx.metrics.restarted(ns, name, d.cause, "InPlace" if d.action == Action.RESTARTED_IN_PLACE
                                      else "Recreate")
            ctx.metrics.set_phase(ns, name, new.phase, C.phase_reason(new.conditions, new.phase))
            ctx.metrics.set_training(ns, name, new.training, new.restart_count)

            # 5. apply (a DELETE already sent is not sent again while the index still shows the pod)
            deletes = [client.delete_pod(ns, n) for n in _to_delete(job, d.delete, d.force_delete, None)]
            deletes += [client.delete_pod(ns, n, grace_seconds=0) for n in _to_delete(job, d.force_delete, (), 0)]
            if deletes:
                await asyncio.gather(*deletes)
            requeue = d.requeue_after
            if d.action == Action.CREATE or d.recreate:
                # a refused create is retried after its backoff, however often the run is woken meanwhile
                retry = job.create_retry_at - time.monotonic()
                if retry <= 0:
                    retry = await _create_attempt(ctx, lpt, new, d.avoid_nodes, job, desired,
                                                  {p.name for p in current} | _shown_children(uid, name, children_index),
                                                  body, started=bool(current)) if d.action == Action.CREATE \
                        else await _create_attempt(ctx, lpt, new, (), job, desired, set(), body, only=d.recreate)
                if retry is not None:
                    requeue = retry if requeue is None else min(requeue, retry)
            elif job.child_errors and job.child_errors_attempt != new.attempt:
                job.child_errors = ()
            if d.delete_self:
                await client.delete_run(ns, name)

            # 6. events (those of the status change: exactly once, even across a crash)
            if new.pending_events:
                await _send_pending(ctx, job, ns, name, body)
            job.done = d.action == Action.FINISHED and not d.delete and not d.force_delete \
                and d.requeue_after is None and not d.delete_self
            if d.action in (Action.RESTART, Action.CONTINUE):
                return 0.0  # the next attempt (or its backoff) is decided at once, not on the next pod event
            return requeue
    finally:
        ctx.metrics.reconcile.observe(time.perf_counter() - started)


async def _report_refused(ctx: Context, body: Mapping[str, Any], job: JobState, refused: list[scraped.Refusal]) -> None:
    """Count refused scraped values; a Warning Event and a log line when what is refused changes."""
    for r in refused:
        ctx.metrics.values_refused.labels(r.metric, r.check).inc()
    sig = scraped.signature(refused)
    if sig != job.refused_values and refused:
        meta = body["metadata"]
        log.warning("Refused scraped values of LlamaPretrain %s/%s: %s", meta.get("namespace"), meta["name"],
                    "; ".join(map(str, refused)))
        await _event(ctx, body, "Warning", C.METRICS_VALUE_REFUSED, scraped.summary(refused))
    job.refused_values = sig


async def _event(ctx: Context, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the run, aggregated: a repeat counts on the same Event (``kubetitan.events``)."""
    await ctx.recorder.record(body, type_, reason, message)


async def _send_pending(ctx: Context, job: JobState, ns: str, name: str, body: Mapping[str, Any]) -> None:
    """Send the Events of the status change just written (``status.pendingEvents``), then clear them from the
    status. Each one's name derives from the change, so one sent before a crash is found (409), never doubled; one
    the API refused stays pending for the next cycle."""
    assert job.status is not None and ctx.client is not None
    left = [e for e in job.status.pending_events
            if not await ctx.recorder.send_once(body, e.type, e.reason, e.message, e.time)]
    if len(left) != len(job.status.pending_events):
        await ctx.client.patch_status(ns, name, {"pendingEvents": [e.dump() for e in left]})
        job.status.pending_events = left


def _to_delete(job: JobState, names: tuple[str, ...], skip: tuple[str, ...], grace: int | None) -> list[str]:
    """``names`` less ``skip`` and those this replica deleted moments ago with the same (or a shorter) grace;
    records the rest as deleted now (expectations: the index lags behind our own deletes)."""
    mono, out = time.monotonic(), []
    for n in names:
        if n in skip:
            continue
        at, g = job.deleted.get(n, (float("-inf"), None))
        if mono - at < ENSURED_SECONDS and (g == grace or g == 0):
            continue
        job.deleted[n] = (mono, grace)
        out.append(n)
    for n, (at, _g) in list(job.deleted.items()):
        if mono - at >= ENSURED_SECONDS:
            del job.deleted[n]
    return out


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
    job.status = new
    ctx.metrics.set_phase(ns, name, new.phase, C.phase_reason(new.conditions, new.phase))  # before the Event
    if new.dump() != old_raw and new.message != old.message:  # one Warning Event per new refusal
        await _event(ctx, body, "Warning", C.POLICY_VIOLATION if refused else C.INVALID_SPEC, new.message or "")


CREATE_RETRY_BASE_SECONDS = 0.5
CREATE_RETRY_CAP_SECONDS = 60.0


async def _create_attempt(ctx: Context, lpt: Any, status: LlamaPretrainStatus, avoid: tuple[str, ...],
                          job: JobState, desired: dict[str, Any], present: set[str], body: Mapping[str, Any],
                          only: tuple[str, ...] | None = None, started: bool = False) -> float | None:
    """Create every child of the current attempt that is not known to exist; existing ones (ours) count as created.

    ``present``: the attempt's pods the index shows and the ConfigMap/Service their indexes show (the ConfigMap is
    still written once per attempt: it carries the attempt's spec). Children this operator created moments ago
    count as existing too (``JobState.ensured``), so the cycles woken by their own watch events send nothing,
    and a create the API refused is not sent again before its backoff (``JobState.create_retry_at``).

    ``started``: some pod of the attempt exists already. Then every child is rendered from the spec the attempt
    was created from (the ConfigMap's applied-spec annotation), never from a newer spec: a missing rank of a live
    gang gets the gang's own ``--nnodes`` and config hash, and an edit waits for the next attempt. ``only``:
    create just these ConfigMap/Service names (deleted by hand while the attempt goes on), the same way.

    Pods go in slow start (``fanout.slow_start``: 1, 2, 4, ... as Kubernetes' ReplicaSet controller does, each
    accepted create admitting two more, with no barrier between rounds): a refused create stops the round, so a
    quota that refuses the whole gang costs one refused create per round, not one per pod. A refused round
    becomes ``ChildrenCreated=False`` on the next cycle and one aggregated Warning Event ``FailedCreate`` naming
    how many pods are not created and the API's message; it is retried after a capped, jittered backoff (the
    returned delay). Never a restart: a child that was never seen is simply created again.
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
    if (only is not None or started) and job.applied_spec is not None and job.applied_spec != desired:
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
    # The Service, then the pods; the client's semaphore bounds the requests in flight. Pods wait for a
    # ConfigMap/Service the API refused: without them the gang cannot start.
    ok = await asyncio.gather(*(one(o) for o in others))
    for o, _ in zip(others, ok, strict=True):
        if not any(e.name == o["metadata"]["name"] for e in errors):
            job.ensured[o["metadata"]["name"]] = time.monotonic()
    made: list[dict[str, Any]] = []
    unsent = 0
    if not errors:
        async def accepted(o: dict[str, Any]) -> bool:
            await one(o)
            return not any(e.name == o["metadata"]["name"] for e in errors)

        unsent = await fanout.slow_start(pods, accepted)
        refused = {e.name for e in errors}
        made = [o for o in pods[:len(pods) - unsent] if o["metadata"]["name"] not in refused]
        done = time.monotonic()  # the index lags behind these creates from now on, not from the round's start
        for o in made:
            job.ensured[o["metadata"]["name"]] = done
    job.child_errors, job.child_errors_attempt = tuple(errors), attempt
    if errors:
        job.create_failures += 1
        await _event(ctx, body, "Warning", "FailedCreate", _refusal_summary(errors, len(pods) - len(made), unsent,
                                                                           attempt))
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
        await _event(ctx, body, "Normal", "RecreatedChildren", f"Created {', '.join(only)} again (deleted while "
                     f"attempt {attempt} runs); the pods go on")
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


def _refusal_summary(errors: list[ChildError], not_created: int, unsent: int, attempt: int) -> str:
    """One message for a refused create round: how many pods are not created, and the API's answer (the first
    refusal's; refusals of other kinds/reasons are counted). Stable across rounds that fail alike, so the
    aggregated ``FailedCreate`` Event counts them instead of piling up."""
    e = errors[0]
    kinds = sorted({f"{x.kind} {x.reason}" for x in errors[1:]} - {f"{e.kind} {e.reason}"})
    also = f" (also refused: {', '.join(kinds)})" if kinds else ""
    if e.kind == "Pod":
        held = f"; {unsent} more not sent this round (slow start stops at a refused create)" if unsent else ""
        return (f"{not_created} pod(s) of attempt {attempt} are not created: the API refused {e.name}: {e.reason}: "
                f"{e.message}{also}{held}; retrying with backoff")
    return (f"the pods of attempt {attempt} wait: the API refused {e.kind} {e.name}: {e.reason}: {e.message}"
            f"{also}; retrying with backoff")


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
    p.add_argument("--scrape-timeout", type=_positive_seconds, default=DEFAULT_SCRAPE_TIMEOUT_SECONDS, metavar="S",
                   help=f"the most one scrape of rank 0's /metrics may take, connect to last byte; slower: "
                   f"MetricsAvailable=False/MetricsTimeout (default {DEFAULT_SCRAPE_TIMEOUT_SECONDS:g})")
    p.add_argument("--scrape-max-bytes", type=_positive_int, default=DEFAULT_SCRAPE_MAX_BYTES, metavar="N",
                   help=f"the most bytes of one /metrics body the operator reads; larger: "
                   f"MetricsAvailable=False/MetricsTooLarge (default {DEFAULT_SCRAPE_MAX_BYTES}, 4 MiB)")
    p.add_argument("--scrape-concurrency", type=_positive_int, default=DEFAULT_SCRAPE_CONCURRENCY, metavar="N",
                   help=f"scrapes in flight at once across all runs (default {DEFAULT_SCRAPE_CONCURRENCY})")
    p.add_argument("--hang-floor-seconds", type=_positive_seconds, default=float(AUTO_HANG_FLOOR_SECONDS),
                   metavar="S", help=f"the least the Auto hang timeout waits for a step, whatever the step time "
                   f"(default {AUTO_HANG_FLOOR_SECONDS}; runPolicy.hangTimeoutPolicy)")
    le = p.add_argument_group("leader election", "one writing replica: a coordination.k8s.io/v1 Lease with fencing "
                              "(docs/operator.md, HA)")
    le.add_argument("--leader-elect", action="store_true",
                    help="elect one replica through a Lease; the others watch and take over when it stops or cannot "
                    "renew (exclusive with --peering)")
    le.add_argument("--leader-elect-resource-name", default="kubetitan", metavar="NAME",
                    help="name of the Lease (default kubetitan)")
    le.add_argument("--leader-elect-resource-namespace", default=None, metavar="NS",
                    help="namespace of the Lease (default: $POD_NAMESPACE, else the service account's namespace)")
    le.add_argument("--leader-elect-identity", default=None, metavar="ID",
                    help="this candidate's identity in the Lease (default: $POD_NAME or the host name, plus a "
                    "random suffix)")
    le.add_argument("--leader-elect-lease-duration", type=_positive_seconds, default=15.0, metavar="S",
                    help="seconds a standby waits after the Lease last changed before taking it over (default 15)")
    le.add_argument("--leader-elect-renew-deadline", type=_positive_seconds, default=10.0, metavar="S",
                    help="seconds the leader goes on without a successful renewal before it stops writing "
                    "(default 10; shorter than the lease duration)")
    le.add_argument("--leader-elect-retry-period", type=_positive_seconds, default=2.0, metavar="S",
                    help="seconds between renewals and between a standby's tries (default 2)")
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
                   scrape_timeout=a.scrape_timeout, scrape_max_bytes=a.scrape_max_bytes,
                   scrape_concurrency=a.scrape_concurrency,
                   hang_floor_seconds=a.hang_floor_seconds, policy=policy.from_flags(a), leader=lease_from_args(a),
                   webhook=webhook_mod.from_args(a))



SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def lease_from_args(a: argparse.Namespace) -> LeaseConfig | None:
    """The Lease of ``--leader-elect`` (None without it); ``problems()`` says what is wrong with it."""
    if not getattr(a, "leader_elect", False):
        return None
    ns = a.leader_elect_resource_namespace or os.environ.get("POD_NAMESPACE")
    if not ns and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            ns = f.read().strip()
    kw: dict[str, Any] = {"identity": a.leader_elect_identity} if a.leader_elect_identity else {}
    return LeaseConfig(namespace=ns or "", name=a.leader_elect_resource_name,
                       lease_duration=a.leader_elect_lease_duration, renew_deadline=a.leader_elect_renew_deadline,
                       retry_period=a.leader_elect_retry_period, **kw)


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (e.g. 30)")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above 0 (e.g. 4194304)")
    return v


def run(options: Options, stop_flag: Any = None, ready_flag: Any = None,
        registry: Any = None) -> OperatorMetrics:
    """Run the operator until ``stop_flag`` is set (blocking); returns its metrics (for tests)."""
    if not options.namespaces and not options.all_namespaces:
        raise SystemExit("error: say which namespaces to watch: --namespace NS (repeatable) or --all-namespaces")
    if options.leader is not None and options.peering is not None:
        raise SystemExit("error: --leader-elect and --peering are exclusive: the leader Lease (with fencing) replaces "
                         "kopf peering; drop --peering")
    if options.leader is not None and (problems := options.leader.problems()):
        raise SystemExit("error: leader election: " + "; ".join(problems))
    cfg = load_config(options.kubeconfig)
    metrics = OperatorMetrics(registry)
    ctx = Context(options=options, cfg=cfg, metrics=metrics)
    if options.leader is not None:
        ctx.leader = LeaderElector(options.leader, None, on_change=lambda leading: _leadership_changed(ctx, leading))
        ctx.leader.client = _client(ctx)
    else:
        metrics.leader.set(1)
    server = None
    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(options.metrics_port, options.metrics_addr, registry=metrics.registry)

    async def operate() -> None:
        _RUNNING.set(ctx)
        try:
            await kopf.operator(
                clusterwide=options.all_namespaces, namespaces=options.namespaces,
                standalone=options.peering is None, peering_name=options.peering, priority=options.priority,
                liveness_endpoint=options.liveness, stop_flag=stop_flag, ready_flag=ready_flag,
                memo=kopf.Memo(ctx=ctx),
            )
        finally:
            for session in ctx.kopf_sessions:
                await session.close()

    try:
        asyncio.run(operate())
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
    if a.leader_elect and a.peering:
        p.error("--leader-elect and --peering are exclusive: the leader Lease (with fencing) replaces kopf peering")
    lease = lease_from_args(a)
    if lease is not None and (problems := lease.problems()):
        p.error("leader election: " + "; ".join(problems))
    fmt = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}[a.log_format]
    kopf.configure(verbose=a.verbose, log_format=fmt, log_refkey="object")
    logs.configure(verbose=a.verbose)
    log.info("Started kubetitan operator", extra={"version": __version__,
                                                  "policy": policy.from_flags(a).describe()})
    try:
        run(options_from_args(a))
    except KeyboardInterrupt:
        return 0
    return 0
