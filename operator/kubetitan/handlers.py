"""The kopf edge of the operator: registration only (start-up, indexes, wake-ups, one daemon per run).

The reconcile itself is ``kubetitan.reconcile``: one *cycle* of one LlamaPretrain observes it into an immutable
snapshot, calls the pure policy (``decide``) and status builder, writes the status once, applies the decision's
creates and deletes idempotently (with expectations), and sends each Event once (``reconcile.cycle``). This module
gives it the watches' indexes (pods by run uid, nodes by name, the runs' ConfigMaps and Services), wakes a run's
daemon when the run's spec or one of its children changes (and, when its last create was refused, when a
ResourceQuota of its namespace changes), and runs the daemons. Running the operator (its flags, options and kopf's main loop) is ``kubetitan.runner``.

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

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from kubetitan_core import GROUP, PLURAL, VERSION
from kubetitan import __version__, plan
from kubetitan import webhook as webhook_mod  # registers the admission handler (kopf.on.validate)
from kubetitan.kube import Client, ClientClosed, FencedWrite, message_of, transient
from kubetitan.leader import LeaderElector, NotLeader
from kubetitan.observation.pods import node_obs, pod_obs
from kubetitan.observation.scrape import Scraper, ScrapeLimits
from kubetitan.reconcile.context import Context
from kubetitan.reconcile.cycle import cycle
from kubetitan.reconcile.memory import RunMemory
from kubetitan.observation.read import rebuild

__all__ = ["FINALIZER", "RUNNING", "NoEssence", "client_of", "leadership_changed"]

log = logging.getLogger("kubetitan.operator")
FINALIZER = "kubetitan.io/finalizer"


def _ctx(memo: Any) -> Context:
    return memo["ctx"] if isinstance(memo, Mapping) else memo.ctx


RUNNING: contextvars.ContextVar[Context] = contextvars.ContextVar("kubetitan_operator")
"""The running operator's Context (set by ``run`` before kopf starts; every kopf task inherits it)."""


def client_of(ctx: Context) -> Client:
    """The operator's API client, created once (``_login`` may run before ``_startup``)."""
    if ctx.client is None:
        ident = ctx.options.leader.identity if ctx.options.leader is not None else os.environ.get("POD_NAME", "")
        ctx.client = Client(ctx.cfg, user_agent=f"kubetitan-operator/{__version__}" + (f" ({ident})" if ident else ""),
                            fence=ctx.leader)
    return ctx.client


def leadership_changed(ctx: Context, leading: bool) -> None:
    """Wake every run's daemon on a new term (they re-read their run); drop the per-run metric series on losing it
    (only the leader exports them, so Prometheus never sums two replicas' views)."""
    ctx.metrics.leader.set(1 if leading else 0)
    if leading:
        for job in ctx.jobs.values():
            job.wake.set()
    else:
        ctx.metrics.forget_all()


# ------------------------------------------------------------------ kopf wiring
class NoEssence(kopf.StatusDiffBaseStorage):
    """kopf's diff-base storage, less the per-event essence nobody reads.

    On every watch event of every watched object (each pod of a 1,024-pod gang, each ConfigMap, Service and run)
    kopf deep-copies the object into its "essence" and deep-copies that again, to diff it against the last handled
    one for change handlers (``on.create``/``on.update``/``on.field``). The operator registers none
    (``tests/operator/test_kopf_storage.py`` checks it), so the diff is only read as "anything changed" for
    daemons' and timers' idle countdowns, which the operator does not use either: the essence is empty, and the two
    deep copies (a third of the operator's CPU per pod create, cProfile of ``bench/operator_bench.py``) are gone."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    import aiohttp

    ctx = _ctx(memo)
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping in status.kopf (preserved by the CRD's schema), never in annotations: a run whose own
    # annotations fill the API's 256 KiB limit is still reconciled and deleted. The diff-base (only used if a
    # change handler is ever added) leaves annotations out.
    settings.persistence.progress_storage = kopf.StatusProgressStorage(name="kopf")
    settings.persistence.diffbase_storage = NoEssence(name="kopf", ignored_fields=["metadata.annotations"])
    # Only the operator's explicit Events (``_event``, fenced) are posted; kopf does not turn log lines into Events.
    settings.posting.loggers = False
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Namespaced mode with exact names: no cluster-wide namespace listing (it is 403 under a namespaced Role
    # and kopf then waits for it); only glob patterns ("team-*") need it.
    settings.scanning.disabled = not ctx.options.all_namespaces and not any(
        ch in ns for ns in ctx.options.namespaces for ch in "*?[!")
    client_of(ctx)
    ctx.session = aiohttp.ClientSession()
    ctx.scraper = Scraper(ScrapeLimits(max_bytes=ctx.options.scrape_max_bytes, timeout=ctx.options.scrape_timeout,
                                       max_series=ctx.options.scrape_max_series,
                                       concurrency=ctx.options.scrape_concurrency))
    if isinstance(ctx.leader, LeaderElector):
        ctx.leader_task = asyncio.create_task(ctx.leader.run(), name="leader election")
    ctx.cert_task = webhook_mod.configure(settings, ctx.options.webhook, ctx.client)
    if ctx.options.pod_groups == "auto":
        await ctx.pod_group_api.check(ctx.client)  # logs whether attempts get PodGroups (read again now and then)
    else:
        log.info("PodGroups are disabled (--pod-groups=disabled): attempts get none")


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
    session = client_of(ctx).kopf_session()
    ctx.kopf_sessions.append(session)
    return kopf.AiohttpSession(aiohttp_session=session, server=ctx.cfg.host.rstrip("/"))


# The indexers and event handlers below are ``async def`` although they never await: kopf runs a plain ``def`` handler
# in its thread pool (one hop per handler per watch event, with a task and a context copy each), which cost CPU and
# kept 6 threads, each with its own malloc arena; on the loop they are direct calls (bench/results/RECORDS.md, where the operator's memory goes).
@kopf.index("pods", labels={plan.LABEL_UID: kopf.PRESENT})
async def lpt_pods(body: kopf.Body, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """Pods by their run's uid (only the fields the decision reads)."""
    obs = pod_obs(body)
    return {labels[plan.LABEL_UID]: obs} if obs is not None else {}


@kopf.index("nodes")
async def lpt_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    """Health of every node by name (a watch, not one GET per node per cycle; kopf fills the index before any
    handler runs, so a node absent from it does not exist)."""
    return {name: node_obs(name, body)}


@kopf.index("configmaps", labels={plan.LABEL_UID: kopf.PRESENT})
async def lpt_configmaps(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """The runs' ConfigMaps by run uid (a watch: one deleted by hand is seen gone at once)."""
    return {labels[plan.LABEL_UID]: name}


@kopf.index("services", labels={plan.LABEL_UID: kopf.PRESENT})
async def lpt_services(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
    """The runs' headless Services by run uid (like ``lpt_configmaps``)."""
    return {labels[plan.LABEL_UID]: name}


@kopf.on.event("pods", labels={plan.LABEL_UID: kopf.PRESENT})
@kopf.on.event("configmaps", labels={plan.LABEL_UID: kopf.PRESENT})
@kopf.on.event("services", labels={plan.LABEL_UID: kopf.PRESENT})
async def _pod_changed(labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """Wake the run's daemon at once when one of its children changes (a pod's phase, a ConfigMap deleted by
    hand): observation stays level-based, this only cuts the latency."""
    job = _ctx(memo).jobs.get(labels[plan.LABEL_UID])
    if job is not None:
        job.wake.set()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def _run_changed(type: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:  # noqa: A002 - kopf's kwarg
    """Wake the run's daemon when its spec changes (a new ``metadata.generation``); forget a deleted run's metric
    series and memory. Writes nothing (kopf keeps no record of event handlers)."""
    ctx = _ctx(memo)
    meta = body.get("metadata") or {}
    if type == "DELETED":
        ctx.metrics.forget(meta.get("namespace", ""), meta.get("name", ""))
        ctx.jobs.pop(meta.get("uid", ""), None)
        if ctx.scraper is not None:
            ctx.scraper.forget(meta.get("uid", ""))
        return
    job = ctx.jobs.get(meta.get("uid", ""))
    if job is not None and job.generation != meta.get("generation"):
        job.generation = meta.get("generation")
        job.refusals.retry_now()  # an edited spec is a new create round, not a wait for the last one's backoff
        job.wake.set()


@kopf.on.event("resourcequotas")
async def _quota_changed(namespace: str | None, memo: Any, **_: Any) -> None:
    """A ResourceQuota of a namespace changed (raised, removed, or its usage went down as pods ended): every run
    there whose last create round the API refused tries again at once, not after its backoff (up to 60 s)."""
    for job in _ctx(memo).jobs.values():
        if job.refusals.namespace == namespace and job.refusals.retry_now():
            job.wake.set()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=1.0, cancellation_timeout=2.0)
async def observe_run(body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, lpt_pods: kopf.Index,
                      lpt_nodes: kopf.Index, lpt_configmaps: kopf.Index, lpt_services: kopf.Index, **_: Any) -> None:
    """Reconcile the run: a cycle at once, then every scan interval, or as soon as its spec or a child changes.

    kopf starts this daemon for each run when it first sees it (created, or found at operator start). With
    ``--leader-elect`` the daemon of a standby waits for the Lease. Whenever this replica starts a new term (and at the first cycle), the run is read
    from the API, not from memory (``observation.read.rebuild``). A cycle whose write the fence refuses is abandoned. The daemon
    ends once the run is finished and nothing is left to clean up or to time (TTL).
    """
    ctx = _ctx(memo)
    meta = body["metadata"]
    ns, name = meta.get("namespace"), meta["name"]
    job = ctx.job(meta["uid"])
    job.generation = meta.get("generation")
    term = -1  # a (re)started daemon reads its run from the API first
    pods: tuple[Any, ...] | None = None
    while not stopped:
        job.wake.clear()
        wait = ctx.options.scan_interval
        if not ctx.leader.leading and not await _until_leading(ctx, stopped):
            return  # stopped while standing by
        try:
            if term != ctx.leader.term:
                term = ctx.leader.term
                try:
                    pods = await rebuild(ctx, job, body)
                except (NotLeader, ClientClosed):
                    raise
                except Exception as e:  # noqa: BLE001 - then the cycle uses the watched status and the index
                    log.warning("Reading LlamaPretrain %s/%s from the API failed (the cycle uses the watched "
                                "state): %s", ns, name, message_of(e))
            result = await cycle(ctx, body, lpt_pods, pods_override=pods, nodes_index=lpt_nodes,
                                 children_index=(lpt_configmaps, lpt_services))
            pods = None
            if result.errors is not None:
                _log_spec_errors(job, ns, name, result.errors)
            if result.done:
                log.debug("LlamaPretrain %s/%s is finished; its daemon ends", ns, name)
                return
            if isinstance(result.requeue, float):
                wait = max(0.05, min(wait, result.requeue))
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


def _log_spec_errors(job: RunMemory, ns: str | None, name: str, errors: list[Any]) -> None:
    """A tenant's spec mistake: one warning naming the run when the errors change (the status and an Event say it
    too); not an operator error."""
    text = "; ".join(map(str, errors)) or None
    if text != job.reported.spec_errors and text is not None:
        log.warning("LlamaPretrain %s/%s has a spec the operator refuses: %s", ns, name, text,
                    extra={"object": {"namespace": ns, "name": name, "kind": "LlamaPretrain"}})
    job.reported.spec_errors = text
