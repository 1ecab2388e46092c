"""Selectors and thresholds of kubetitan's alerts and dashboards, in one place.

Like kubernetes-mixin's ``config.libsonnet``: every query in ``queries``, every alert in
``alerts`` and every panel in ``dashboards`` is a function of this object, and nothing
else holds a selector or a threshold. The chart's PodMonitor and ServiceMonitor set the
``job`` label of the scraped series to ``trainer_job`` / ``operator_job`` so that these
selectors match whatever the Prometheus Operator's own ``job`` label would have been.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MonitoringConfig:
    trainer_job: str = "kubetitan-trainer"
    """``job`` label of the trainer pods' series (set by the chart's PodMonitor)."""
    operator_job: str = "kubetitan-operator"
    """``job`` label of the operator's series (set by the chart's ServiceMonitor)."""
    job_labels: tuple[str, ...] = ("namespace", "name")
    """Labels that identify one LlamaPretrain (``name`` is its metadata.name)."""
    pod_label: str = "pod"
    """Label that identifies one trainer pod (one node of the gang)."""

    # ---- thresholds
    stalled_seconds: int = 1800
    """No step for this long (twice the default ``runPolicy.hangTimeoutSeconds``: the
    operator's own hang restart should have acted first) -> KubeTitanTrainingStalled."""
    stalled_for: str = "5m"
    loss_not_finite_window: str = "10m"
    loss_not_finite_for: str = "0m"
    loss_divergence_factor: float = 1.5
    """Loss averaged over ``loss_short_window`` above this factor times its lowest value over
    ``loss_long_window`` -> KubeTitanLossDiverging."""
    loss_short_window: str = "15m"
    loss_long_window: str = "2h"
    loss_diverging_for: str = "15m"
    restart_rate_window: str = "1h"
    restart_rate_threshold: int = 3
    """More gang restarts than this within ``restart_rate_window`` -> KubeTitanRestartRateHigh."""
    restart_rate_for: str = "5m"
    mfu_drop_factor: float = 0.7
    """MFU over ``mfu_short_window`` below this fraction of the job's own median over
    ``mfu_baseline_window`` -> KubeTitanMFUDropped."""
    mfu_short_window: str = "15m"
    mfu_baseline_window: str = "6h"
    mfu_dropped_for: str = "30m"
    checkpoint_stale_intervals: int = 3
    """Steps since the last complete checkpoint above this many checkpoint intervals ->
    KubeTitanCheckpointStale."""
    checkpoint_interval_steps_default: int = 500
    """``spec.checkpoint.intervalSteps`` assumed for a run whose trainer does not export
    ``kubetitan_trainer_checkpoint_interval_steps`` (the API default)."""
    checkpoint_stale_for: str = "10m"
    checkpoint_saves_failing_for: str = "1m"
    """``kubetitan_trainer_checkpoint_saves_failed_in_a_row`` above 0 this long -> KubeTitanCheckpointSavesFailing
    (the gauge stays up from a failed save until the next one completes, one checkpoint interval or more)."""
    operator_down_for: str = "10m"
    reconcile_errors_window: str = "15m"
    reconcile_errors_threshold: int = 5
    """More failed reconciliations than this within ``reconcile_errors_window``."""
    reconcile_errors_for: str = "15m"
    run_failed_for: str = "1m"
    """A run Failed (for any reason but those with their own alert below) -> KubeTitanRunFailed."""
    run_unschedulable_for: str = "1m"
    """The operator reports the run Unschedulable (its pods waited longer than the run's own
    ``runPolicy.unschedulableTimeoutSeconds``, so the wait is already long) -> KubeTitanRunUnschedulable."""
    storage_full_for: str = "0m"
    network_not_efa_for: str = "0m"
    cause_alert_window: str = "1h"
    """A restart with a cause whose row names an alert (``kubetitan_core.causes``: GPUXidError) within this window
    -> that alert."""
    cause_alert_for: str = "0m"

    # ---- annotations
    runbook_url_base: str = "https://github.com/kubetitan/kubetitan/blob/main/docs/runbook.md"
    """Every alert's ``runbook_url`` is this plus ``#<lowercased alert name>``; the chart
    swaps it for ``monitoring.rules.runbookBaseURL``."""

    # ---- dashboards
    dashboard_refresh: str = "30s"
    dashboard_time_from: str = "now-6h"

    @property
    def trainer(self) -> str:
        return f'job="{self.trainer_job}"'

    @property
    def operator(self) -> str:
        return f'job="{self.operator_job}"'

    @property
    def by_job(self) -> str:
        return ", ".join(self.job_labels)


DEFAULT = MonitoringConfig()
