"""kubetitan's Prometheus alerts, generated from code (kubernetes-mixin shape).

Every alert has one shape: a ``KubeTitan<Symptom>`` name, ``expr``, ``for``,
``labels.severity`` (critical pages someone now, warning goes to the work queue), a fixed
``summary`` and a templated ``description`` that names the LlamaPretrain and says what to
check. ``runbook_url`` is added in exactly one place (``with_runbook_urls``) from the
config's base URL and the lowercased alert name; ``docs/runbook.md`` has one entry per alert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubetitan_core import causes
from kubetitan_core import contract as c
from kubetitan.monitoring import queries as q
from kubetitan.monitoring.config import DEFAULT, MonitoringConfig

GROUP_NAME = "kubetitan"
LPT = "LlamaPretrain {{ $labels.namespace }}/{{ $labels.name }}"
OWN_ALERT_REASONS = (*(x.id for x in causes.CAUSES if not x.retried and x.alert), "UnschedulableTimeout")
"""Failed reasons with an alert of their own (the causes table's rows that end a run and name an alert, and
UnschedulableTimeout): KubeTitanRunFailed leaves them to it."""
UNSCHEDULABLE_REASONS = ("PodsUnschedulable", "UnschedulableTimeout")
"""Ready's reason while the Unschedulable condition is True (waiting), and Failed's when it failed the run."""


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def alerts(cfg: MonitoringConfig = DEFAULT) -> list[Alert]:
    """Every alert, in the rules file's order."""
    return [*training_alerts(cfg), *efficiency_alerts(cfg), *run_alerts(cfg), *cause_alerts(cfg),
            *operator_alerts(cfg)]


def training_alerts(cfg: MonitoringConfig = DEFAULT) -> list[Alert]:
    """Alerts on the trainer's progress and loss."""
    t, by = cfg.trainer, cfg.by_job
    return [
        Alert(
            "KubeTitanTrainingStalled",
            f"(time() - max by ({by}) ({c.M_LAST_STEP_TIMESTAMP}{{{t}}}) > {cfg.stalled_seconds})"
            f" and on ({by}) (max by ({by}) ({c.M_STEP}{{{t}}}) < max by ({by}) ({c.M_TOTAL_STEPS}{{{t}}}))",
            cfg.stalled_for,
            "critical",
            "Training has made no step progress.",
            f"{LPT} has not completed a training step for {{{{ $value | humanizeDuration }}}} while its "
            "pods still serve metrics. Check `kubectl describe lpt` (the Ready and Restarting conditions, a `Hang` in "
            "`status.restarts`), the trainer logs of "
            "every pod for a collective timeout or a stuck data loader, and NCCL/EFA health of the nodes.",
        ),
        Alert(
            "KubeTitanLossNotFinite",
            # A non-finite loss makes the trainer exit (code 3) right away, so its series may be seen
            # in one scrape only: look back over a window instead of at the latest sample.
            f"max by ({by}) (count_over_time((({c.M_LOSS}{{{t}}} != {c.M_LOSS}{{{t}}})"
            f" or (abs({c.M_LOSS}{{{t}}}) == +Inf))[{cfg.loss_not_finite_window}:1m])) > 0",
            cfg.loss_not_finite_for,
            "warning",
            "Training loss is NaN or infinite.",
            f"{LPT} reported a NaN or infinite loss in the last {cfg.loss_not_finite_window}. The trainer exits "
            "(code 3), the operator restarts from the last checkpoint and fails the run if it repeats. Check the "
            "learning rate and warm-up, gradient clipping (`training.maxNorm`), FP8 settings, and the data "
            "around the failing step.",
        ),
        Alert(
            "KubeTitanLossDiverging",
            f"max by ({by}) (avg_over_time({c.M_LOSS}{{{t}}}[{cfg.loss_short_window}]))"
            f" > {cfg.loss_divergence_factor} * max by ({by}) (min_over_time({c.M_LOSS}{{{t}}}[{cfg.loss_long_window}]))",
            cfg.loss_diverging_for,
            "warning",
            "Training loss is diverging.",
            f"{LPT}: loss averaged over {cfg.loss_short_window} is {{{{ $value | humanize }}}}, more than "
            f"{cfg.loss_divergence_factor}x its lowest value over {cfg.loss_long_window}. Check the learning "
            "rate schedule, recent spec changes, a resume from an unexpected checkpoint, and the data mix.",
        ),
    ]


def efficiency_alerts(cfg: MonitoringConfig = DEFAULT) -> list[Alert]:
    """Alerts on what a run loses: restarts, MFU, work since the last checkpoint."""
    t, by = cfg.trainer, cfg.by_job
    return [
        Alert(
            "KubeTitanRestartRateHigh",
            # kubetitan_operator_job_restarts is the run's restart count (status.restartCount): a gauge
            # that only grows during a run, so its spread over the window is the restarts in it.
            f"max by ({by}) (max_over_time({q.OP_JOB_RESTARTS}{{{cfg.operator}}}[{cfg.restart_rate_window}])"
            f" - min_over_time({q.OP_JOB_RESTARTS}{{{cfg.operator}}}[{cfg.restart_rate_window}]))"
            f" > {cfg.restart_rate_threshold}",
            cfg.restart_rate_for,
            "warning",
            "A training run restarts too often.",
            f"{LPT} was gang-restarted {{{{ $value | humanize }}}} times in the last {cfg.restart_rate_window}. "
            "Check the restart causes in `kubectl get lpt -o yaml` (status.restarts) and the "
            "kubetitan_operator_restarts_total series by cause: each of "
            f"{', '.join(x.id for x in causes.CAUSES if x.retried and not x.resize)} points at a different fix (the "
            "runbook's Restart causes section).",
        ),
        Alert(
            "KubeTitanMFUDropped",
            f"avg by ({by}) (avg_over_time({c.M_MFU}{{{t}}}[{cfg.mfu_short_window}]))"
            f" < {cfg.mfu_drop_factor} * avg by ({by}) "
            f"(quantile_over_time(0.5, {c.M_MFU}{{{t}}}[{cfg.mfu_baseline_window}]))",
            cfg.mfu_dropped_for,
            "warning",
            "Model FLOPs utilisation dropped far below the run's own recent level.",
            f"{LPT} runs at {{{{ $value | humanizePercentage }}}} MFU, below {cfg.mfu_drop_factor:.0%} of its "
            f"median over the last {cfg.mfu_baseline_window}. Check the step-time-per-pod panel for a "
            "straggler node, the data-loading share, GPU clocks and thermal throttling, and EFA errors.",
        ),
        Alert(
            "KubeTitanCheckpointStale",
            f"max by ({by}) ({c.M_STEP}{{{t}}}) - max by ({by}) ({c.M_LAST_CHECKPOINT_STEP}{{{t}}})"
            f" > {cfg.checkpoint_stale_intervals} * (max by ({by}) ({q.M_CHECKPOINT_INTERVAL_STEPS}{{{t}}})"
            f" or 0 * max by ({by}) ({c.M_STEP}{{{t}}}) + {cfg.checkpoint_interval_steps_default})",
            cfg.checkpoint_stale_for,
            "warning",
            "The newest complete checkpoint is too old.",
            f"{LPT} has trained {{{{ $value | humanize }}}} steps since its last complete checkpoint, more than "
            f"{cfg.checkpoint_stale_intervals} checkpoint intervals: a restart now loses that work. Check for "
            f"failed saves ({c.M_CHECKPOINT_SAVES_FAILED}, the run's CheckpointSaveFailing condition), the "
            "checkpoint storage (capacity, credentials, throughput) and the checkpoint save time panel.",
        ),
        Alert(
            "KubeTitanCheckpointSavesFailing",
            f"max by ({by}) ({c.M_CHECKPOINT_SAVES_FAILED_IN_A_ROW}{{{t}}}) > 0",
            cfg.checkpoint_saves_failing_for,
            "warning",
            "Checkpoint saves of a training run fail.",
            f"{LPT} has {{{{ $value | humanize }}}} checkpoint save(s) in a row that failed with a storage error; "
            "training goes on, and spec.checkpoint.maxFailedSaves of them in a row end the attempt (exit code 6). "
            "Read the run's CheckpointSaveFailing condition (the step and error of the last failure) and check "
            "that the checkpoint storage is reachable from the pods and accepts writes (free space, credentials).",
        ),
    ]


def _phase(cfg: MonitoringConfig, selector: str) -> str:
    """A run in a phase/reason (``kubetitan_operator_job_phase_info``)."""
    return f"max by ({cfg.by_job}, phase, reason) ({q.OP_JOB_PHASE_INFO}{{{cfg.operator}, {selector}}}) > 0"


def run_alerts(cfg: MonitoringConfig = DEFAULT) -> list[Alert]:
    """Alerts on a run's phase and reason: failed, unschedulable, and the failures with an alert of their own."""

    def phase(selector: str) -> str:
        return _phase(cfg, selector)

    return [
        Alert(
            "KubeTitanRunFailed",
            phase(f'phase="Failed", reason!~"{"|".join(OWN_ALERT_REASONS)}"'),
            cfg.run_failed_for,
            "warning",
            "A training run failed.",
            f"{LPT} failed with reason {{{{ $labels.reason }}}} and will not restart by itself. Check "
            "`kubectl describe lpt` (the Failed condition's message names the pod, its exit code and the fix), "
            "`status.restarts` for what came before, and the logs of the failed pod; fix the spec or the cause, "
            "then re-create the run (it resumes from its newest checkpoint).",
        ),
        Alert(
            "KubeTitanRunUnschedulable",
            phase(f'reason=~"{"|".join(UNSCHEDULABLE_REASONS)}"'),
            cfg.run_unschedulable_for,
            "warning",
            "A training run's pods cannot all be scheduled.",
            f"{LPT} is {{{{ $labels.phase }}}} ({{{{ $labels.reason }}}}): its pods have waited longer than "
            "runPolicy.unschedulableTimeoutSeconds for nodes. Check the Unschedulable condition's message (the "
            "scheduler's reason), free GPUs in the node pool (`kubectl describe nodes`), the namespace's "
            "ResourceQuota, Kueue admission, taints and the run's nodeSelector/affinity.",
        ),
        Alert(
            "KubeTitanStorageFull",
            phase('phase="Failed", reason="StorageFull"'),
            cfg.storage_full_for,
            "warning",
            "A training run failed: its checkpoint volume is full.",
            f"{LPT} failed because its checkpoint volume had too little free space for a save (the trainer "
            "exits 4 rather than write a partial checkpoint). Check the volume's usage, free space or enlarge "
            "the claim (FSx for Lustre: raise its storage capacity), lower checkpoint.keepLatestK, then re-create "
            "the run: it resumes from the newest complete checkpoint.",
        ),
        Alert(
            "KubeTitanNetworkNotEFA",
            phase('phase="Failed", reason="NetworkNotEFA"'),
            cfg.network_not_efa_for,
            "warning",
            "A training run failed: NCCL is not using EFA.",
            f"{LPT} asked for EFA but NCCL was not on it after the first step (exit 5 with "
            "networkFallback: Fail), so training would have run over TCP sockets at a fraction of the bandwidth. "
            "Check the trainer image for libfabric and aws-ofi-nccl, the pods' vpc.amazonaws.com/efa requests, "
            "the EFA device plugin on the nodes and the NCCL lines of the rank 0 log.",
        ),
    ]


def cause_alerts(cfg: MonitoringConfig = DEFAULT, table: tuple[causes.Cause, ...] = causes.CAUSES) -> list[Alert]:
    """One alert per retried cause whose row names one (``kubetitan_core.causes``: ``GPUXidError``): a restart of
    the run with that cause within ``cause_alert_window``. A counter series that first appears inside the window
    has no earlier sample for ``increase`` to start from, so it counts with its value."""
    by, w = cfg.by_job, cfg.cause_alert_window
    out = []
    for row in table:
        if not (row.retried and row.alert):
            continue
        sel = f'{q.OP_RESTARTS}{{{cfg.operator}, cause="{row.id}"}}'
        out.append(Alert(
            row.alert,
            f"sum by ({by}) (({sel} unless {sel} offset {w}) or increase({sel}[{w}])) > 0",
            cfg.cause_alert_for,
            row.severity,
            f"A training run restarted with cause {row.id}.",
            f"{LPT} restarted {{{{ $value | humanize }}}} time(s) in the last {w} with cause {row.id}: {row.summary} "
            f"Check `status.restarts` (each record's message and nodeName) and the cause's runbook section; "
            f"{row.fix}.",
        ))
    return out


def operator_alerts(cfg: MonitoringConfig = DEFAULT) -> list[Alert]:
    """Alerts on the operator itself."""
    return [
        Alert(
            "KubeTitanOperatorDown",
            f"absent(up{{{cfg.operator}}} == 1)",
            cfg.operator_down_for,
            "critical",
            "The kubetitan operator is not running.",
            f"No kubetitan operator target ({cfg.operator}) has been up for {cfg.operator_down_for}: "
            "LlamaPretrains are neither restarted nor updated. Check the operator Deployment "
            "(`kubectl -n <release namespace> get deploy,pods -l app.kubernetes.io/name=kubetitan`), "
            "its logs, and the ServiceMonitor.",
        ),
        Alert(
            "KubeTitanReconcileErrors",
            f"sum by (namespace) (increase({q.OP_RECONCILE_ERRORS}{{{cfg.operator}}}[{cfg.reconcile_errors_window}]))"
            f" > {cfg.reconcile_errors_threshold}",
            cfg.reconcile_errors_for,
            "warning",
            "The kubetitan operator keeps failing to reconcile.",
            "The kubetitan operator in {{ $labels.namespace }} failed {{ $value | humanize }} reconciliations "
            f"in {cfg.reconcile_errors_window}. Check its logs for API errors (RBAC Forbidden, conflicts, "
            "webhook failures) and the events of the LlamaPretrains it manages.",
        ),
    ]


def with_runbook_urls(rules: list[dict[str, Any]], cfg: MonitoringConfig = DEFAULT) -> list[dict[str, Any]]:
    """The one place that adds ``runbook_url`` (kubernetes-mixin's add-runbook-links)."""
    for rule in rules:
        rule["annotations"]["runbook_url"] = f"{cfg.runbook_url_base}#{rule['alert'].lower()}"
    return rules


def rule_groups(cfg: MonitoringConfig = DEFAULT) -> dict[str, Any]:
    """The rules file (also the ``spec`` of the chart's PrometheusRule)."""
    return {"groups": [{"name": GROUP_NAME, "rules": with_runbook_urls([a.rule() for a in alerts(cfg)], cfg)}]}
