"""PromQL of every dashboard panel, as functions of the monitoring config.

Kept apart from the panel layout (kubernetes-mixin's ``queries/*.libsonnet`` habit) so that
the live test can run each query against a real Prometheus. Dashboard variables appear as
``$namespace`` and ``$job`` (the LlamaPretrain's name) and Grafana's ``$__rate_interval``.
"""

from __future__ import annotations

from kubetitan_core import contract as c
# The operator's own metrics, named in the contract (operator_metrics.py exports them by the same names); the alerts
# and dashboards read them as q.OP_*.
from kubetitan_core.contract import (OP_BUILD_INFO, OP_JOB_GOODPUT, OP_JOB_MFU, OP_JOB_PHASE_INFO,  # noqa: F401
                                     OP_JOB_RESTARTS, OP_JOB_STEP, OP_JOB_TOKENS_PER_SECOND, OP_LLAMAPRETRAINS,
                                     OP_RECONCILE_DURATION, OP_RECONCILE_ERRORS, OP_RECOVERY_DURATION, OP_RESTARTS)
from kubetitan.monitoring.config import MonitoringConfig

# Trainer metric the alerts need beyond contract.M_* (the trainer exports it; see docs/monitoring.md).
# The alert falls back to config.checkpoint_interval_steps_default while the trainer does not export it.
M_CHECKPOINT_INTERVAL_STEPS = c.M_CHECKPOINT_INTERVAL

RATE = "$__rate_interval"


def run_selector(cfg: MonitoringConfig) -> str:
    """Trainer series of the LlamaPretrain picked in the dashboard."""
    return f'{cfg.trainer}, namespace="$namespace", name="$job"'


def op_job_selector(cfg: MonitoringConfig) -> str:
    """Operator per-job series of the LlamaPretrain picked in the dashboard."""
    return f'{cfg.operator}, namespace="$namespace", name="$job"'


# ------------------------------------------------------------------ run dashboard
def step(cfg: MonitoringConfig) -> str:
    return f"max({c.M_STEP}{{{run_selector(cfg)}}})"


def total_steps(cfg: MonitoringConfig) -> str:
    return f"max({c.M_TOTAL_STEPS}{{{run_selector(cfg)}}})"


def progress(cfg: MonitoringConfig) -> str:
    return f"{step(cfg)} / {total_steps(cfg)}"


def attempt(cfg: MonitoringConfig) -> str:
    return f"max({c.M_ATTEMPT}{{{run_selector(cfg)}}})"


def loss(cfg: MonitoringConfig) -> str:
    return f"max({c.M_LOSS}{{{run_selector(cfg)}}})"


def eval_loss(cfg: MonitoringConfig) -> str:
    """Held-out loss of the newest evaluation (spec.data.eval); absent before the first one."""
    return f"max({c.M_EVAL_LOSS}{{{run_selector(cfg)}}})"


def eval_perplexity(cfg: MonitoringConfig) -> str:
    return f"max({c.M_EVAL_PERPLEXITY}{{{run_selector(cfg)}}})"


def data_tokens_rate_by_source(cfg: MonitoringConfig) -> str:
    """Tokens/s each data source feeds the job (every pod counts the whole global stream: max, not sum)."""
    return f"max by (source) (rate({c.M_DATA_TOKENS}{{{run_selector(cfg)}}}[{RATE}]))"


def source_loss(cfg: MonitoringConfig) -> str:
    """A mixture's training loss by data source at the last logged step."""
    return f"max by (source) ({c.M_SOURCE_LOSS}{{{run_selector(cfg)}}})"


def source_eval_loss(cfg: MonitoringConfig) -> str:
    """A mixture's held-out loss by data source at the newest evaluation."""
    return f"max by (source) ({c.M_SOURCE_EVAL_LOSS}{{{run_selector(cfg)}}})"


def data_epochs(cfg: MonitoringConfig) -> str:
    """Passes over each data source so far (above 1: it repeats)."""
    return f"max by (source) ({c.M_DATA_EPOCHS}{{{run_selector(cfg)}}})"


def grad_norm(cfg: MonitoringConfig) -> str:
    return f"max({c.M_GRAD_NORM}{{{run_selector(cfg)}}})"


def tokens_per_second_total(cfg: MonitoringConfig) -> str:
    return f"sum({c.M_TOKENS_PER_SECOND}{{{run_selector(cfg)}}})"


def tokens_per_second_per_gpu(cfg: MonitoringConfig) -> str:
    return f"avg({c.M_TOKENS_PER_SECOND_PER_GPU}{{{run_selector(cfg)}}})"


def tokens_per_second_per_gpu_by_pod(cfg: MonitoringConfig) -> str:
    return f"avg by ({cfg.pod_label}) ({c.M_TOKENS_PER_SECOND_PER_GPU}{{{run_selector(cfg)}}})"


def tokens_rate_counter(cfg: MonitoringConfig) -> str:
    """Tokens/s from the token counter (survives missed scrapes, unlike the gauge)."""
    return f"sum(rate({c.M_TOKENS}{{{run_selector(cfg)}}}[{RATE}]))"


def tflops_per_gpu(cfg: MonitoringConfig) -> str:
    return f"avg({c.M_FLOPS_PER_GPU}{{{run_selector(cfg)}}}) / 1e12"


def mfu(cfg: MonitoringConfig) -> str:
    return f"avg({c.M_MFU}{{{run_selector(cfg)}}})"


def _hist_mean_by(cfg: MonitoringConfig, metric: str, by: str) -> str:
    sel = run_selector(cfg)
    return (
        f"sum by ({by}) (rate({metric}_sum{{{sel}}}[{RATE}]))"
        f" / sum by ({by}) (rate({metric}_count{{{sel}}}[{RATE}]))"
    )


def step_time_by_pod(cfg: MonitoringConfig) -> str:
    """Mean step time of each pod: one line above the others is a straggler."""
    return _hist_mean_by(cfg, c.M_STEP_DURATION, cfg.pod_label)


def step_time_p90_by_pod(cfg: MonitoringConfig) -> str:
    return (
        f"histogram_quantile(0.9, sum by ({cfg.pod_label}, le) "
        f"(rate({c.M_STEP_DURATION}_bucket{{{run_selector(cfg)}}}[{RATE}])))"
    )


def step_time_spread(cfg: MonitoringConfig) -> str:
    """Slowest pod's mean step time over the median pod's: 1 means no straggler."""
    per_pod = step_time_by_pod(cfg)
    return f"max({per_pod}) / quantile(0.5, {per_pod})"


def step_time_heatmap(cfg: MonitoringConfig) -> str:
    return f"sum by (le) (rate({c.M_STEP_DURATION}_bucket{{{run_selector(cfg)}}}[{RATE}]))"


def data_loading_share(cfg: MonitoringConfig) -> str:
    """Fraction of step time spent waiting for the data loader, per pod."""
    by, sel = cfg.pod_label, run_selector(cfg)
    return (
        f"sum by ({by}) (rate({c.M_DATA_LOADING_DURATION}_sum{{{sel}}}[{RATE}]))"
        f" / sum by ({by}) (rate({c.M_STEP_DURATION}_sum{{{sel}}}[{RATE}]))"
    )


def memory_max_active(cfg: MonitoringConfig) -> str:
    return f"max by ({cfg.pod_label}) ({c.M_MEMORY_MAX_ACTIVE}{{{run_selector(cfg)}}})"


def memory_max_reserved(cfg: MonitoringConfig) -> str:
    return f"max by ({cfg.pod_label}) ({c.M_MEMORY_MAX_RESERVED}{{{run_selector(cfg)}}})"


def checkpoint_age(cfg: MonitoringConfig) -> str:
    return f"time() - max({c.M_LAST_CHECKPOINT_TIMESTAMP}{{{run_selector(cfg)}}} > 0)"


def checkpoint_last_step(cfg: MonitoringConfig) -> str:
    return f"max({c.M_LAST_CHECKPOINT_STEP}{{{run_selector(cfg)}}})"


def checkpoint_save_time(cfg: MonitoringConfig) -> str:
    """Mean blocking time of this attempt's checkpoint saves, per pod (saves are rare: a rate
    window would mostly be empty)."""
    m, sel, by = c.M_CHECKPOINT_SAVE_DURATION, run_selector(cfg), cfg.pod_label
    return f"max by ({by}) ({m}_sum{{{sel}}} / {m}_count{{{sel}}})"


def checkpoint_saves(cfg: MonitoringConfig) -> str:
    return f"max({c.M_CHECKPOINT_SAVE_DURATION}_count{{{run_selector(cfg)}}})"


def heartbeat_age(cfg: MonitoringConfig) -> str:
    return f"time() - max({c.M_LAST_STEP_TIMESTAMP}{{{run_selector(cfg)}}})"


def eta_seconds(cfg: MonitoringConfig) -> str:
    """Seconds left to ``spec.training.steps`` at the current pace: steps left x the slowest pod's mean step time
    over the rate window (the gang moves at its slowest pod's pace; checkpoint stalls and restarts not counted)."""
    return f"({total_steps(cfg)} - {step(cfg)}) * max({step_time_by_pod(cfg)})"


def finish_time_ms(cfg: MonitoringConfig) -> str:
    """When the run reaches ``spec.training.steps`` at the current pace (Unix time in ms, for Grafana's date units)."""
    return f"(time() + {eta_seconds(cfg)}) * 1000"


def restart_annotations(cfg: MonitoringConfig) -> str:
    """A restart of the run (its restart count, ``status.restartCount``, changed): the dashboard's annotation.
    The count exists from the run's first cycle, so even the first restart of a cause is caught."""
    return f"changes({OP_JOB_RESTARTS}{{{op_job_selector(cfg)}}}[{RATE}]) > 0"


def restart_cause_annotations(cfg: MonitoringConfig) -> str:
    """Restarts of the run by cause and mode (InPlace / Recreate) within the window: the annotation's tags."""
    return f"sum by (cause, mode) (increase({OP_RESTARTS}{{{op_job_selector(cfg)}}}[{RATE}])) > 0"


def job_restarts(cfg: MonitoringConfig) -> str:
    return f"max({OP_JOB_RESTARTS}{{{op_job_selector(cfg)}}})"


def goodput(cfg: MonitoringConfig) -> str:
    return f"max({OP_JOB_GOODPUT}{{{op_job_selector(cfg)}}})"


def trainer_goodput(cfg: MonitoringConfig) -> str:
    """Productive step time of the current attempt over wall time since the job started."""
    sel = run_selector(cfg)
    return f"max({c.M_PRODUCTIVE_SECONDS}{{{sel}}}) / (time() - max({c.M_JOB_START_TIMESTAMP}{{{sel}}}))"


# ------------------------------------------------------------- operator dashboard
def jobs_by_phase(cfg: MonitoringConfig) -> str:
    return f"sum by (phase) ({OP_LLAMAPRETRAINS}{{{cfg.operator}}})"


def operator_up(cfg: MonitoringConfig) -> str:
    return f"sum(up{{{cfg.operator}}})"


def reconcile_latency(cfg: MonitoringConfig, q: float) -> str:
    return (
        f"histogram_quantile({q}, sum by (le) "
        f"(rate({OP_RECONCILE_DURATION}_bucket{{{cfg.operator}}}[{RATE}])))"
    )


def reconcile_rate(cfg: MonitoringConfig) -> str:
    return f"sum(rate({OP_RECONCILE_DURATION}_count{{{cfg.operator}}}[{RATE}]))"


def reconcile_errors(cfg: MonitoringConfig) -> str:
    return f"sum(rate({OP_RECONCILE_ERRORS}{{{cfg.operator}}}[{RATE}]))"


def recovery_time(cfg: MonitoringConfig, q: float) -> str:
    return (
        f"histogram_quantile({q}, sum by (le) "
        f"(rate({OP_RECOVERY_DURATION}_bucket{{{cfg.operator}}}[{RATE}])))"
    )


def recovery_time_mean(cfg: MonitoringConfig) -> str:
    sel = cfg.operator
    return f"sum({OP_RECOVERY_DURATION}_sum{{{sel}}}) / sum({OP_RECOVERY_DURATION}_count{{{sel}}})"


def startup_phases(cfg: MonitoringConfig) -> str:
    """Seconds of each start-up phase of the running workers (the slowest pod's), from the trainer's anatomy."""
    return f"max by (phase) ({c.M_STARTUP_PHASE_SECONDS}{{{run_selector(cfg)}}})"


def startup_total(cfg: MonitoringConfig) -> str:
    return f"max({c.M_STARTUP_SECONDS}{{{run_selector(cfg)}}})"


def worker_generation(cfg: MonitoringConfig) -> str:
    return f"max({c.M_RESTART_GENERATION}{{{run_selector(cfg)}}})"


def restarts_by_cause(cfg: MonitoringConfig) -> str:
    return f"sum by (cause) ({OP_RESTARTS}{{{op_job_selector(cfg)}}})"


def restarts_by_cause_all(cfg: MonitoringConfig) -> str:
    return f"sum by (cause) ({OP_RESTARTS}{{{cfg.operator}}})"


def jobs_table(cfg: MonitoringConfig, metric: str) -> str:
    return f"max by ({cfg.by_job}) ({metric}{{{cfg.operator}}})"


def build_info(cfg: MonitoringConfig) -> str:
    return f"max by (version) ({OP_BUILD_INFO}{{{cfg.operator}}})"
