"""kubetitan's Grafana dashboards, generated from code.

One panel constructor (``panel``) and one row-flow layout; every query comes from
``queries``. ``charts/generate.py`` writes the JSON into ``charts/kubetitan/files/dashboards/``
and a drift test regenerates and compares it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubetitan.monitoring import queries as q
from kubetitan.monitoring.config import DEFAULT, MonitoringConfig

DS = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 12
    height: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


def panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    """The one panel constructor: every panel of every dashboard is built here."""
    out: dict[str, Any] = {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "targets": [
            {
                "datasource": DS,
                "expr": t.expr,
                "legendFormat": t.legend or "__auto",
                "refId": chr(ord("A") + i),
                "range": p.kind == "timeseries",
                "instant": p.kind != "timeseries",
            }
            for i, t in enumerate(p.targets)
        ],
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}}
        if p.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }
    out.update(p.extra)
    return out


def _layout(panels: list[Panel]) -> list[dict[str, Any]]:
    out, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append(panel(p, i, x, y))
        x, row_h = x + p.width, max(row_h, p.height)
    return out


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": False,
        "multi": False,
        "current": {},
        "options": [],
        "hide": 0,
    }


@dataclass(frozen=True)
class Annotation:
    """A Prometheus annotation query of a dashboard: every series the query returns marks a point in time."""

    name: str
    expr: str
    title: str
    text: str
    tag_keys: str = ""
    color: str = "red"


def annotation(a: Annotation) -> dict[str, Any]:
    """The one annotation constructor (Grafana's Prometheus annotation: ``expr``, ``step``, title/text/tag formats)."""
    return {
        "name": a.name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": a.color,
        "expr": a.expr,
        "step": "15s",
        "titleFormat": a.title,
        "textFormat": a.text,
        "tagKeys": a.tag_keys,
        "useValueForTime": False,
    }


def _dashboard(uid: str, title: str, panels: list[Panel], variables: list[dict[str, Any]],
               cfg: MonitoringConfig, annotations: list[Annotation] = ()) -> dict[str, Any]:
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "options": [],
        "hide": 0,
        "refresh": 1,
    }
    return {
        "uid": uid,
        "title": title,
        "tags": ["kubetitan"],
        "editable": False,
        "schemaVersion": SCHEMA_VERSION,
        "timezone": "utc",
        "refresh": cfg.dashboard_refresh,
        "time": {"from": cfg.dashboard_time_from, "to": "now"},
        "templating": {"list": [datasource, *variables]},
        "annotations": {"list": [annotation(a) for a in annotations]},
        "links": [],
        "panels": _layout(panels),
    }


def run_panels(cfg: MonitoringConfig = DEFAULT) -> list[Panel]:
    """The run dashboard's panels, in their order: progress and loss, throughput, memory, checkpoints and restarts."""
    return [*_progress_panels(cfg), *_throughput_panels(cfg), *_checkpoint_and_restart_panels(cfg)]


def _progress_panels(cfg: MonitoringConfig) -> list[Panel]:
    return [
        Panel("Step", "Newest optimizer step of the run (rank 0 of every pod reports it).",
              [Target(q.step(cfg), "step"), Target(q.total_steps(cfg), "total")], width=6, kind="stat"),
        Panel("Progress", "Completed steps over `spec.training.steps`.",
              [Target(q.progress(cfg), "progress")], unit="percentunit", width=6, kind="stat"),
        Panel("Attempt", "Gang attempt number (0 is the first; each restart adds one).",
              [Target(q.attempt(cfg), "attempt")], width=6, kind="stat"),
        Panel("Time since last step", "Heartbeat age: seconds since the last completed step. "
              "A growing value means a hang (the operator restarts after `runPolicy.hangTimeoutSeconds`).",
              [Target(q.heartbeat_age(cfg), "seconds")], unit="s", width=6, kind="stat"),
        Panel("ETA", "Time left to `spec.training.steps` at the current pace: steps left x the slowest pod's mean "
              "step time over the last few minutes. Checkpoint stalls and restarts are not counted, so the run "
              "finishes later than this when it restarts.",
              [Target(q.eta_seconds(cfg), "time left")], unit="s", width=6, kind="stat"),
        Panel("Finishes at", "When the run reaches `spec.training.steps` at the current pace (the ETA added to "
              "now).", [Target(q.finish_time_ms(cfg), "finish")], unit="dateTimeAsIso", width=6, kind="stat"),
        Panel("Loss", "Training loss (torchtitan's global average over data-parallel ranks).",
              [Target(q.loss(cfg), "loss")]),
        Panel("Eval loss", "Loss on the held-out samples (`spec.data.eval`: the same samples at step 1 and every "
              "`intervalSteps`), next to the training loss. A gap that widens is overfitting.",
              [Target(q.eval_loss(cfg), "eval loss"), Target(q.loss(cfg), "training loss")]),
        Panel("Tokens by data source", "Tokens/s each data source feeds the run (`spec.data.mixture` weights; "
              "one series for a single source).", [Target(q.data_tokens_rate_by_source(cfg), "{{source}}")],
              width=6),
        Panel("Loss by data source", "A mixture's training loss by data source at the last logged step, and its "
              "held-out loss by source at the newest evaluation (with `spec.data.eval` on the training sources' "
              "held-out split).", [Target(q.source_loss(cfg), "train {{source}}"),
                                   Target(q.source_eval_loss(cfg), "eval {{source}}")]),
        Panel("Epochs by data source", "Passes over each data source's training sequences so far; above 1 the source "
              "repeats (a small source of a mixture first).", [Target(q.data_epochs(cfg), "{{source}}")],
              unit="none", width=6),
        Panel("Eval perplexity", "Perplexity on the held-out samples at the newest evaluation (exp of the eval "
              "loss).", [Target(q.eval_perplexity(cfg), "perplexity")], width=6, kind="stat"),
        Panel("Gradient norm", "Total gradient norm before clipping (`training.maxNorm`).",
              [Target(q.grad_norm(cfg), "grad norm")]),
    ]


def _throughput_panels(cfg: MonitoringConfig) -> list[Panel]:
    return [
        Panel("Tokens/s per GPU", "Training throughput per GPU, averaged over pods and per pod "
              "(the reference: Llama 3 8B on H100 with compile + FP8 reaches about 8,950).",
              [Target(q.tokens_per_second_per_gpu(cfg), "average"),
               Target(q.tokens_per_second_per_gpu_by_pod(cfg), "{{pod}}")]),
        Panel("Tokens/s total", "Whole-run throughput: the gauge summed over pods, and the rate of the "
              "token counter (which also covers missed scrapes).",
              [Target(q.tokens_per_second_total(cfg), "gauge"), Target(q.tokens_rate_counter(cfg), "counter rate")]),
        Panel("TFLOP/s per GPU", "Achieved model TFLOP/s per GPU (6·N·tokens + attention, from torchtitan's "
              "FLOPs-per-token).", [Target(q.tflops_per_gpu(cfg), "TFLOP/s")]),
        Panel("MFU", "Model FLOPs utilisation: achieved FLOP/s over the GPU's dense BF16 peak (0-1).",
              [Target(q.mfu(cfg), "MFU")], unit="percentunit"),
        Panel("Step time per pod", "Mean step time of each pod over the rate window, and its 90th "
              "percentile: one pod above the rest is a straggler (slow node, throttled GPU, EFA errors).",
              [Target(q.step_time_by_pod(cfg), "mean {{pod}}"), Target(q.step_time_p90_by_pod(cfg), "p90 {{pod}}")],
              unit="s"),
        Panel("Straggler ratio", "Slowest pod's mean step time over the median pod's (1.0 = balanced).",
              [Target(q.step_time_spread(cfg), "max / median")], unit="none"),
        Panel("Step time distribution", "Step-time histogram buckets over all pods (per-second rate).",
              [Target(q.step_time_heatmap(cfg), "{{le}}")], unit="s"),
        Panel("Data-loading share", "Fraction of step time spent waiting for the next batch, per pod. "
              "Above a few percent the data pipeline limits training.",
              [Target(q.data_loading_share(cfg), "{{pod}}")], unit="percentunit"),
        Panel("Memory", "Peak device memory per pod since the last report: active (tensors) and reserved "
              "(the caching allocator's pool).",
              [Target(q.memory_max_active(cfg), "active {{pod}}"), Target(q.memory_max_reserved(cfg), "reserved {{pod}}")],
              unit="bytes"),
    ]


def _checkpoint_and_restart_panels(cfg: MonitoringConfig) -> list[Panel]:
    return [
        Panel("Checkpoint age", "Seconds since the newest complete checkpoint was saved; a restart loses "
              "the steps trained since then.",
              [Target(q.checkpoint_age(cfg), "age"), ], unit="s", width=6),
        Panel("Last checkpoint step", "Step of the newest complete checkpoint (what a restart resumes from).",
              [Target(q.checkpoint_last_step(cfg), "step")], width=6, kind="stat"),
        Panel("Checkpoint save time", "Mean time training was blocked per checkpoint save in this attempt (only the staging copy with async saves).",
              [Target(q.checkpoint_save_time(cfg), "mean {{pod}}")], unit="s", width=6),
        Panel("Checkpoint saves", "Checkpoints this attempt has saved.",
              [Target(q.checkpoint_saves(cfg), "saves")], width=6, kind="stat"),
        Panel("Restarts", "Gang restarts of this run so far (the operator's status.restartCount).",
              [Target(q.job_restarts(cfg), "restarts")], width=6, kind="stat"),
        Panel("Restart causes", "Gang restarts of this run by cause; the details of each (node, downtime, "
              "lost steps) are in `kubectl get lpt -o yaml` (status.restarts).",
              [Target(q.restarts_by_cause(cfg), "{{cause}}")], width=6, kind="bargauge"),
        Panel("Start-up anatomy", "Where the running workers' start-up went, from the launcher's start (or its "
              "detection of the failure an in-place restart answers) to the end of their first step: process start, "
              "imports, process-group init, model init, checkpoint load, first-step compile, first step (slowest pod "
              "per phase); the first thing to read when recovery is slow. Also per restart in status.restarts.",
              [Target(q.startup_phases(cfg), "{{phase}}"), Target(q.startup_total(cfg), "total"),
               Target(q.worker_generation(cfg), "in-place generation")], unit="s", kind="bargauge"),
        Panel("Goodput", "Productive step time over wall time since the run started: the operator's "
              "figure (all attempts) and the trainer's own.",
              [Target(q.goodput(cfg), "operator"), Target(q.trainer_goodput(cfg), "trainer")], unit="percentunit"),
    ]


def operator_panels(cfg: MonitoringConfig = DEFAULT) -> list[Panel]:
    return [
        Panel("Operator replicas up", "Operator pods Prometheus can scrape (with leader election one holds the "
              "Lease and writes, the others stand by).", [Target(q.operator_up(cfg), "up")], width=6, kind="stat"),
        Panel("Operator version", "`kubetitan_build_info` of the running operators.",
              [Target(q.build_info(cfg), "{{version}}")], width=6, kind="stat"),
        Panel("LlamaPretrains by phase", "Number of LlamaPretrain resources in each phase.",
              [Target(q.jobs_by_phase(cfg), "{{phase}}")], width=12),
        Panel("Reconcile latency", "Latency of reconciliation passes: median and 99th percentile.",
              [Target(q.reconcile_latency(cfg, 0.5), "p50"), Target(q.reconcile_latency(cfg, 0.99), "p99")],
              unit="s"),
        Panel("Reconciles and errors", "Reconciliation passes and failed passes per second.",
              [Target(q.reconcile_rate(cfg), "reconciles"), Target(q.reconcile_errors(cfg), "errors")],
              unit="ops"),
        Panel("Time to recover", "Failure detected -> the next attempt's pods created: p50/p90 and the mean "
              "since the operator started.",
              [Target(q.recovery_time(cfg, 0.5), "p50"), Target(q.recovery_time(cfg, 0.9), "p90"),
               Target(q.recovery_time_mean(cfg), "mean")], unit="s"),
        Panel("Restarts by cause", "Gang restarts of all runs, by cause.",
              [Target(q.restarts_by_cause_all(cfg), "{{cause}}")], kind="bargauge"),
        Panel("Step per run", "Current step of every LlamaPretrain the operator manages.",
              [Target(q.jobs_table(cfg, q.OP_JOB_STEP), "{{namespace}}/{{name}}")]),
        Panel("Tokens/s per run", "Whole-run throughput of every LlamaPretrain.",
              [Target(q.jobs_table(cfg, q.OP_JOB_TOKENS_PER_SECOND), "{{namespace}}/{{name}}")]),
        Panel("MFU per run", "MFU of every LlamaPretrain.",
              [Target(q.jobs_table(cfg, q.OP_JOB_MFU), "{{namespace}}/{{name}}")], unit="percentunit"),
        Panel("Goodput per run", "Goodput of every LlamaPretrain.",
              [Target(q.jobs_table(cfg, q.OP_JOB_GOODPUT), "{{namespace}}/{{name}}")], unit="percentunit"),
    ]


def run_dashboard(cfg: MonitoringConfig = DEFAULT) -> dict[str, Any]:
    variables = [
        _variable("namespace", "Namespace", f'label_values({q.c.M_STEP}{{{cfg.trainer}}}, namespace)'),
        _variable("job", "LlamaPretrain", f'label_values({q.c.M_STEP}{{{cfg.trainer}, namespace="$namespace"}}, name)'),
    ]
    return _dashboard("kubetitan-run", "kubetitan / Training run", run_panels(cfg), variables, cfg, run_annotations(cfg))


def run_annotations(cfg: MonitoringConfig = DEFAULT) -> list[Annotation]:
    """Restarts marked on every time series panel of the run dashboard."""
    return [
        Annotation("Restarts", q.restart_annotations(cfg), "Restart",
                   "The run's restart count changed (status.restarts has the cause, node and lost steps)."),
        Annotation("Restart causes", q.restart_cause_annotations(cfg), "Restart: {{cause}} ({{mode}})",
                   "Gang restart by cause {{cause}}, mode {{mode}} (InPlace: the same pods; Recreate: a new gang).",
                   tag_keys="cause,mode", color="orange"),
    ]


def operator_dashboard(cfg: MonitoringConfig = DEFAULT) -> dict[str, Any]:
    return _dashboard("kubetitan-operator", "kubetitan / Operator", operator_panels(cfg), [], cfg)


DASHBOARDS = {"kubetitan-run.json": run_dashboard, "kubetitan-operator.json": operator_dashboard}
