"""The operator's settings and shared state, as the reconcile cycle and the kopf edge see them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kubetitan import policy
from kubetitan import webhook as webhook_mod
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan.observation import DEFAULT_RESIZE_MIN_INTERVAL_SECONDS
from kubetitan.discovery import PodGroupApi
from kubetitan.events import Recorder
from kubetitan.kube import Client
from kubetitan.leader import AlwaysLeader, LeaseConfig
from kubetitan.observation.scrape import (
    DEFAULT_SCRAPE_CONCURRENCY, DEFAULT_SCRAPE_MAX_BYTES, DEFAULT_SCRAPE_MAX_SERIES, DEFAULT_SCRAPE_TIMEOUT_SECONDS,
    Scraper,
)
from kubetitan.operator_metrics import OperatorMetrics
from kubetitan.reconcile.memory import RunMemory

APPLIED_SPEC_KEY = "applied-spec.json"
"""Key of the run's ConfigMap holding the spec (JSON) the current attempt was created from. In ``data``, not in an
annotation: a ConfigMap's data may hold 1 MiB, its annotations only 256 KiB together, and a spec of a few hundred
KiB (a long ``env``) is valid. The pods mount only the trainer config key of the ConfigMap (``plan``)."""
LEGACY_ANNOTATION_APPLIED_SPEC = "kubetitan.io/applied-spec"
"""Where an older operator kept it (read for an attempt it created; removed at the next attempt's write)."""


@dataclass
class Options:
    namespaces: list[str] = field(default_factory=list)
    all_namespaces: bool = False
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
    scrape_max_series: int = DEFAULT_SCRAPE_MAX_SERIES
    """The most series of one /metrics body the operator parses (``--scrape-max-series``)."""
    hang_floor_seconds: float = float(AUTO_HANG_FLOOR_SECONDS)
    """The floor of ``runPolicy.hangTimeoutPolicy: Auto`` (``--hang-floor-seconds``)."""
    resize_min_interval_seconds: float = DEFAULT_RESIZE_MIN_INTERVAL_SECONDS
    """The least time between two resizes of an elastic run (``--resize-min-interval-seconds``)."""
    pod_groups: Literal["auto", "disabled"] = "auto"
    """``--pod-groups``: ``disabled`` gives no attempt a PodGroup whatever the server serves and the specs say (the
    cluster admin's switch; ``discovery`` is then never asked)."""
    clock: Callable[[], float] = time.time
    """Source of 'now' for every decision; tests pass a faster clock instead of lowering API minimums."""
    policy: policy.Policy = field(default_factory=policy.Policy)
    """The cluster admin's policy (``--policy-*`` flags): a valid spec outside it is refused like an invalid one."""
    leader: LeaseConfig | None = None
    """Leader election (``--leader-elect``): only the holder of this Lease writes. None: this replica always writes
    (it runs alone)."""
    webhook: webhook_mod.WebhookOptions | None = None
    """The validating admission webhook (``--webhook-*``, ``--requester-checks``; kubetitan.webhook); None: none."""


@dataclass
class Context:
    options: Options
    cfg: Any
    metrics: OperatorMetrics
    client: Client | None = None
    session: Any = None
    scraper: Scraper | None = None
    jobs: dict[str, RunMemory] = field(default_factory=dict)
    """Each run's in-memory state by uid (``reconcile.memory``)."""
    leader: Any = field(default_factory=AlwaysLeader)
    """The write fence: ``LeaderElector`` with ``--leader-elect``, else ``AlwaysLeader``."""
    leader_task: asyncio.Task[None] | None = None
    kopf_sessions: list[Any] = field(default_factory=list)
    """aiohttp sessions handed to kopf (``_login``): closed when the operator has stopped."""
    cert_task: asyncio.Task[None] | None = None
    """Keeps the webhook's own certificates (``--webhook-certificates operator``; kubetitan.certsync)."""
    pod_group_api: PodGroupApi = field(default_factory=PodGroupApi)
    """Whether the API server serves Kubernetes PodGroups (API discovery, re-read now and then)."""
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

    def job(self, uid: str) -> RunMemory:
        if uid not in self.jobs:
            self.jobs[uid] = RunMemory()
        return self.jobs[uid]

    def clock_rate(self) -> float:
        """How many clock seconds pass per real second (1 in production; tests run faster clocks)."""
        return getattr(self.options.clock, "rate", 1.0)
