"""Running the operator: its command-line flags, its options, and kopf's main loop (``kubetitan operator ...``).

Importing this module imports ``kubetitan.handlers``, whose decorators register the kopf handlers that ``run``
starts; the reconcile itself is ``kubetitan.reconcile``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

import kopf

from kubetitan import __version__, compat, logs, policy
from kubetitan import webhook as webhook_mod
from kubetitan.handlers import RUNNING, client_of, leadership_changed
from kubetitan.kube import load_config
from kubetitan.leader import LeaderElector, LeaseConfig
from kubetitan.observation.scrape import (
    DEFAULT_SCRAPE_CONCURRENCY, DEFAULT_SCRAPE_MAX_BYTES, DEFAULT_SCRAPE_MAX_SERIES, DEFAULT_SCRAPE_TIMEOUT_SECONDS,
)
from kubetitan.operator_metrics import OperatorMetrics
from kubetitan.reconcile.context import Context, Options
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan.observation import DEFAULT_RESIZE_MIN_INTERVAL_SECONDS

log = logging.getLogger("kubetitan.operator")

__all__ = ["Options", "build_parser", "lease_from_args", "main", "options_from_args", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubetitan operator", description="Run the kubetitan operator (kopf).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (cluster-wide)")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of the operator's /metrics (0: off)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--scan-interval", type=float, default=10.0, help="seconds between cycles of a run (default 10)")
    _add_scrape_flags(p)
    p.add_argument("--hang-floor-seconds", type=_positive_seconds, default=float(AUTO_HANG_FLOOR_SECONDS),
                   metavar="S", help=f"the least the Auto hang timeout waits for a step, whatever the step time "
                   f"(default {AUTO_HANG_FLOOR_SECONDS}; runPolicy.hangTimeoutPolicy)")
    p.add_argument("--resize-min-interval-seconds", type=_positive_seconds,
                   default=DEFAULT_RESIZE_MIN_INTERVAL_SECONDS, metavar="S",
                   help=f"the least time between two resizes (Shrink/Grow) of a run with runPolicy.elastic: the "
                   f"cluster admin's cap on how often a gang is re-created for its size "
                   f"(default {DEFAULT_RESIZE_MIN_INTERVAL_SECONDS:g})")
    _add_pod_group_flag(p)
    le = p.add_argument_group("leader election", "one writing replica: a coordination.k8s.io/v1 Lease with fencing "
                              "(docs/operator.md, HA)")
    le.add_argument("--leader-elect", action="store_true",
                    help="elect one replica through a Lease; the others watch and take over when it stops or cannot "
                    "renew (the one HA mode: needed for more than one replica)")
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


def _add_pod_group_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pod-groups", choices=["auto", "disabled"], default="auto",
                   help="auto: where the API server serves Kubernetes PodGroups (scheduling.k8s.io/v1beta1), give "
                   "each attempt of a run that allows it (spec.scheduling.podGroup) a gang PodGroup; disabled: never "
                   "(the cluster admin's switch; default auto)")


def _add_scrape_flags(p: argparse.ArgumentParser) -> None:
    """How often and how much of rank 0's /metrics the operator reads (docs/monitoring.md)."""
    p.add_argument("--scrape-interval", type=float, default=15.0,
                   help="seconds between scrapes of rank 0's /metrics (default 15)")
    p.add_argument("--scrape-timeout", type=_positive_seconds, default=DEFAULT_SCRAPE_TIMEOUT_SECONDS, metavar="S",
                   help=f"the most one scrape of rank 0's /metrics may take, connect to last byte; slower: "
                   f"MetricsAvailable=False/MetricsTimeout (default {DEFAULT_SCRAPE_TIMEOUT_SECONDS:g})")
    p.add_argument("--scrape-max-bytes", type=_positive_int, default=DEFAULT_SCRAPE_MAX_BYTES, metavar="N",
                   help=f"the most bytes of one /metrics body the operator reads; larger: "
                   f"MetricsAvailable=False/MetricsTooLarge (default {DEFAULT_SCRAPE_MAX_BYTES}, 4 MiB)")
    p.add_argument("--scrape-max-series", type=_positive_int, default=DEFAULT_SCRAPE_MAX_SERIES, metavar="N",
                   help=f"the most series (sample lines) of one /metrics body the operator parses, counted before "
                   f"parsing; more: MetricsAvailable=False/MetricsTooLarge (default {DEFAULT_SCRAPE_MAX_SERIES}; the "
                   f"trainer's own has about 75)")
    p.add_argument("--scrape-concurrency", type=_positive_int, default=DEFAULT_SCRAPE_CONCURRENCY, metavar="N",
                   help=f"scrapes in flight at once across all runs (default {DEFAULT_SCRAPE_CONCURRENCY})")


def options_from_args(a: argparse.Namespace) -> Options:
    return Options(namespaces=list(a.namespace), all_namespaces=a.all_namespaces,
                   metrics_port=a.metrics_port or None, liveness=a.liveness,
                   kubeconfig=a.kubeconfig, scan_interval=a.scan_interval, scrape_interval=a.scrape_interval,
                   scrape_timeout=a.scrape_timeout, scrape_max_bytes=a.scrape_max_bytes,
                   scrape_concurrency=a.scrape_concurrency, scrape_max_series=a.scrape_max_series,
                   hang_floor_seconds=a.hang_floor_seconds, policy=policy.from_flags(a), leader=lease_from_args(a),
                   resize_min_interval_seconds=a.resize_min_interval_seconds, pod_groups=a.pod_groups,
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
    if options.leader is not None and (problems := options.leader.problems()):
        raise SystemExit("error: leader election: " + "; ".join(problems))
    cfg = load_config(options.kubeconfig)
    metrics = OperatorMetrics(registry)
    ctx = Context(options=options, cfg=cfg, metrics=metrics)
    if options.leader is not None:
        ctx.leader = LeaderElector(options.leader, None, on_change=lambda leading: leadership_changed(ctx, leading))
        ctx.leader.client = client_of(ctx)
    else:
        metrics.leader.set(1)
    server = None
    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(options.metrics_port, options.metrics_addr, registry=metrics.registry)

    compat.install()  # every watched object loses what the operator never reads (managedFields) before kopf keeps it

    async def operate() -> None:
        RUNNING.set(ctx)
        try:
            await kopf.operator(
                clusterwide=options.all_namespaces, namespaces=options.namespaces,
                standalone=True,  # one writer is the leader Lease's job (--leader-elect), never kopf peering
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
