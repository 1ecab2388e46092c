"""The kopf edge of the operator: registration only (indexes, wake-ups, one daemon per run) and the CLI.

The reconcile itself is ``kubetitan.reconcile``: one *cycle* of one LlamaPretrain observes it into an immutable
snapshot, calls the pure policy (``decide``) and status builder, writes the status once, applies the decision's
creates and deletes idempotently (with expectations), and sends each Event once (``reconcile.cycle``). This module
gives it the watches' indexes (pods by run uid, nodes by name, the runs' ConfigMaps and Services), wakes a run's
daemon when the run's spec or one of its children changes, and runs the daemons.

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
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from kubetitan_core import GROUP, PLURAL, VERSION
from kubetitan import __version__, plan, policy
from kubetitan import webhook as webhook_mod  # registers the admission handler (kopf.on.validate)
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan.kube import Client, ClientClosed, FencedWrite, load_config, message_of, transient
from kubetitan.leader import LeaderElector, LeaseConfig, NotLeader
from kubetitan import logs
from kubetitan.observe import (
    DEFAULT_SCRAPE_CONCURRENCY, DEFAULT_SCRAPE_MAX_BYTES, DEFAULT_SCRAPE_TIMEOUT_SECONDS, Scraper, ScrapeLimits,
    node_obs, pod_obs,
)
from kubetitan.operator_metrics import OperatorMetrics
from kubetitan.reconcile.context import Context, Options
from kubetitan.reconcile.cycle import cycle
from kubetitan.reconcile.memory import RunMemory
from kubetitan.reconcile.observe import rebuild

__all__ = ["FINALIZER", "Context", "Options", "build_parser", "main", "options_from_args", "run"]

log = logging.getLogger("kubetitan.operator")
FINALIZER = "kubetitan.io/finalizer"


def _ctx(memo: Any) -> Context:
    return memo["ctx"] if isinstance(memo, Mapping) else memo.ctx


_RUNNING: contextvars.ContextVar[Context] = contextvars.ContextVar("kubetitan_operator")
"""The running operator's Context (set by ``run`` before kopf starts; every kopf task inherits it)."""


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
    from the API, not from memory (``reconcile.observe.rebuild``). A cycle whose write the fence refuses is abandoned. The daemon
    ends once the run is finished and nothing is left to clean up or to time (TTL).
    """
    ctx = _ctx(memo)
    meta = body["metadata"]
    ns, name = meta.get("namespace"), meta["name"]
    job = ctx.job(meta["uid"])
    job.generation = meta.get("generation")
    term = -1  # a (re)started daemon reads its run from the API first (after a peering pause, too)
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
