"""The operator's own Prometheus metrics (prefix ``kubetitan_operator_``), on its own registry; their names are the
contract's ``OP_*`` constants, which the dashboards and alerts query (kubetitan.monitoring.queries)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kubetitan import __version__
from kubetitan_core import contract as c
from kubetitan_core.api import Phase, TrainingStatus

PHASES: tuple[Phase, ...] = ("Pending", "Starting", "Running", "Restarting", "Blocked", "Suspended", "Succeeded",
                             "Failed")


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.build = Info(c.OP_BUILD_INFO.removesuffix("_info"), "Version of the kubetitan operator.", registry=r)
        self.build.info({"version": __version__, "component": "operator"})
        self.phase = Gauge(c.OP_LLAMAPRETRAINS, "LlamaPretrains by phase (count).",
                           ["phase"], registry=r)
        # Per run and cause: bounded (causes are a closed set) and dropped when the run is deleted.
        self.restarts = Counter(c.OP_RESTARTS,
                                "Restarts of a LlamaPretrain by cause and mode: InPlace (the launchers restarted "
                                "every rank's workers in the same pods) or Recreate (a new gang) (count).",
                                ["namespace", "name", "cause", "mode"], registry=r)
        self.reconcile = Histogram(c.OP_RECONCILE_DURATION,
                                   "Duration of one reconcile cycle of one LlamaPretrain (seconds).", registry=r,
                                   buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.cycles = Counter(c.OP_RUN_CYCLES,
                              "Reconcile cycles of a LlamaPretrain (count); a finished run's stops growing once its "
                              "clean-up is done.", ["namespace", "name"], registry=r)
        self.errors = Counter(c.OP_RECONCILE_ERRORS,
                              "Reconcile cycles that raised an error (count).", ["kind"], registry=r)
        self.api_unavailable = Counter(
            c.OP_API_UNAVAILABLE_CYCLES,
            "Reconcile cycles cut short because the Kubernetes API was unavailable (429/5xx, timeouts or dropped "
            "connections after the client's retries); the next cycle retries (count).", registry=r)
        self.leader = Gauge(c.OP_LEADER,
                            "1 while this replica may write (it holds the leader Lease, or runs without leader "
                            "election), else 0 (boolean).", registry=r)
        self.recovery = Histogram(c.OP_RECOVERY_DURATION,
                                  "Time from a gang failure being detected to the next attempt's pods being "
                                  "created (seconds).", registry=r,
                                  buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.scrape_failures = Counter(c.OP_SCRAPE_FAILURES,
                                       "Scrapes of rank 0's /metrics that failed, by MetricsAvailable reason: "
                                       "ScrapeFailed, MetricsTooLarge, MetricsTimeout, MetricsMalformed (count).",
                                       ["reason"], registry=r)
        self.values_refused = Counter(c.OP_SCRAPED_VALUES_REFUSED,
                                      "Values scraped from rank 0 that broke a rule of kubetitan.scraped.RULES and "
                                      "were not stored, by metric and check: finite, integer, range, future, "
                                      "regression, spec (above what the run's spec makes possible) (count).",
                                      ["metric", "check"], registry=r)
        self._run_series(r)
        self._phases: dict[tuple[str, str], str] = {}
        self._infos: dict[tuple[str, str], tuple[str, str]] = {}
        self._causes: dict[tuple[str, str], set[tuple[str, str]]] = {}
        for p in PHASES:
            self.phase.labels(p).set(0)

    def _run_series(self, r: CollectorRegistry) -> None:
        """The per-run series: the training gauges and the phase info."""
        labels = ["namespace", "name"]
        self.step = Gauge(c.OP_JOB_STEP, "Last step of a LlamaPretrain (steps).", labels, registry=r)
        self.tokens = Gauge(c.OP_JOB_TOKENS_PER_SECOND,
                            "Training throughput of a LlamaPretrain (tokens per second).", labels, registry=r)
        self.mfu = Gauge(c.OP_JOB_MFU, "Model FLOPs utilisation of a LlamaPretrain (ratio 0-1).",
                         labels, registry=r)
        self.goodput = Gauge(c.OP_JOB_GOODPUT,
                             "Productive step time over wall time since the run started (ratio 0-1).", labels,
                             registry=r)
        self.job_restarts = Gauge(c.OP_JOB_RESTARTS, "Gang restarts of a LlamaPretrain (count).",
                                  labels, registry=r)
        # One series per run: its labels move with the status (the old series is removed), so the cardinality
        # is the number of runs; the alerts on failed and unschedulable runs read it.
        self.phase_info = Gauge(c.OP_JOB_PHASE_INFO,
                                "Phase of a LlamaPretrain and the reason that goes with it (the terminal "
                                "condition's for Succeeded/Failed, Ready's otherwise); always 1 (info).",
                                ["namespace", "name", "phase", "reason"], registry=r)

    def set_phase(self, ns: str, name: str, phase: str | None, reason: str = "") -> None:
        key = (ns, name)
        info = (phase, reason) if phase is not None else None
        if self._infos.get(key) != info:
            if key in self._infos:
                self.phase_info.remove(ns, name, *self._infos.pop(key))
            if info is not None:
                self._infos[key] = info
                self.phase_info.labels(ns, name, *info).set(1)
        old = self._phases.get(key)
        if old == phase:
            return
        if old is not None:
            self.phase.labels(old).dec()
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
            self.phase.labels(phase).inc()

    def restarted(self, ns: str, name: str, cause: str, mode: str = "Recreate") -> None:
        self.restarts.labels(ns, name, cause, mode).inc()
        self._causes.setdefault((ns, name), set()).add((cause, mode))

    def set_training(self, ns: str, name: str, t: TrainingStatus | None, restart_count: int) -> None:
        """The run's training gauges as its status shows them: a number the status no longer has (the pace while no
        worker trains: a restart, a new attempt's start) is removed, never left at the old attempt's value."""
        self.job_restarts.labels(ns, name).set(restart_count)
        for gauge, value in ((self.step, t and t.step), (self.tokens, t and t.tokens_per_second),
                             (self.mfu, t and t.mfu), (self.goodput, t and t.goodput)):
            if value is not None:
                gauge.labels(ns, name).set(value)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(ns, name)

    def forget_all(self) -> None:
        """Drop every run's series (this replica stopped leading: the new leader exports them)."""
        for ns, name in {*self._phases, *self._causes}:
            self.forget(ns, name)
        for gauge in (self.step, self.tokens, self.mfu, self.goodput, self.job_restarts):
            gauge.clear()
        self.cycles.clear()

    def forget(self, ns: str, name: str) -> None:
        """Drop a deleted run's series."""
        self.set_phase(ns, name, None)
        for gauge in (self.step, self.tokens, self.mfu, self.goodput, self.job_restarts):
            try:
                gauge.remove(ns, name)
            except KeyError:
                pass
        try:
            self.cycles.remove(ns, name)
        except KeyError:
            pass
        for cause, mode in self._causes.pop((ns, name), ()):
            self.restarts.remove(ns, name, cause, mode)
