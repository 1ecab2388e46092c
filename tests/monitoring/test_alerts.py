"""kubetitan's alerts: shape, `promtool check rules`, and a `promtool test rules` case for every
alert, firing and not firing (evaluated just before and after `for`, labels and annotations)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kubetitan.monitoring import alerts as al
from kubetitan.monitoring.config import DEFAULT
from support import yamlio

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "charts" / "kubetitan" / "files" / "kubetitan-rules.yaml"
RUNBOOK = REPO / "docs" / "runbook.md"
ALERTS = {a.name: a for a in al.alerts()}
T = 'job="kubetitan-trainer",namespace="ml",name="run",pod="run-a0-0"'
O = 'job="kubetitan-operator",namespace="kubetitan-system",pod="kt-kubetitan-0"'
J = 'job="kubetitan-operator",namespace="ml",name="run",pod="kt-kubetitan-0"'  # per-run operator series
P = "kubetitan_operator_job_phase_info"


def _run(phase: str, reason: str) -> dict[str, str]:
    """The labels of an alert on a run's phase: the run, and the phase and reason it is in."""
    return {"namespace": "ml", "name": "run", "phase": phase, "reason": reason}


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool not found: run `make tools` (Debian's prometheus package)")
    return found


@dataclass
class Case:
    id: str
    alert: str
    series: dict[str, str]
    eval_time: str
    firing: bool
    value_text: str = ""
    labels: dict[str, str] = field(default_factory=lambda: {"namespace": "ml", "name": "run"})


CASES = [
    # -- stalled: heartbeat frozen at t=0; condition from 31m, `for` 5m
    Case("stalled-fires", "KubeTitanTrainingStalled",
         {f"kubetitan_trainer_last_step_timestamp_seconds{{{T}}}": "0x60", f"kubetitan_trainer_step{{{T}}}": "10x60",
          f"kubetitan_trainer_total_steps{{{T}}}": "100x60"}, "40m", True, "40m 0s"),
    Case("stalled-pending", "KubeTitanTrainingStalled",
         {f"kubetitan_trainer_last_step_timestamp_seconds{{{T}}}": "0x60", f"kubetitan_trainer_step{{{T}}}": "10x60",
          f"kubetitan_trainer_total_steps{{{T}}}": "100x60"}, "35m", False),
    Case("stalled-finished-run", "KubeTitanTrainingStalled",
         {f"kubetitan_trainer_last_step_timestamp_seconds{{{T}}}": "0x60", f"kubetitan_trainer_step{{{T}}}": "100x60",
          f"kubetitan_trainer_total_steps{{{T}}}": "100x60"}, "40m", False),
    Case("stalled-healthy", "KubeTitanTrainingStalled",
         {f"kubetitan_trainer_last_step_timestamp_seconds{{{T}}}": "0+60x60", f"kubetitan_trainer_step{{{T}}}": "0+1x60",
          f"kubetitan_trainer_total_steps{{{T}}}": "100x60"}, "40m", False),
    # -- loss not finite
    Case("loss-nan-fires", "KubeTitanLossNotFinite", {f"kubetitan_trainer_loss{{{T}}}": "3 NaN NaN"}, "1m", True),
    Case("loss-inf-fires", "KubeTitanLossNotFinite", {f"kubetitan_trainer_loss{{{T}}}": "3 Inf Inf"}, "1m", True),
    Case("loss-nan-once-then-gone-fires", "KubeTitanLossNotFinite", {f"kubetitan_trainer_loss{{{T}}}": "3 3 NaN _ _ _"},
         "5m", True),
    Case("loss-nan-long-ago", "KubeTitanLossNotFinite", {f"kubetitan_trainer_loss{{{T}}}": "3 NaN 3x20"}, "20m", False),
    Case("loss-finite", "KubeTitanLossNotFinite", {f"kubetitan_trainer_loss{{{T}}}": "3-0.1x5"}, "4m", False),
    # -- loss diverging: 2.0 for 2h, then 4.0; condition from ~128m, `for` 15m
    Case("diverging-fires", "KubeTitanLossDiverging", {f"kubetitan_trainer_loss{{{T}}}": "2x120 4x40"}, "150m", True, "4"),
    Case("diverging-pending", "KubeTitanLossDiverging", {f"kubetitan_trainer_loss{{{T}}}": "2x120 4x40"}, "135m", False),
    Case("diverging-falling-loss", "KubeTitanLossDiverging", {f"kubetitan_trainer_loss{{{T}}}": "8-0.02x200"}, "190m", False),
    # -- restart rate: 5 restarts in minutes 61-65
    Case("restarts-fire", "KubeTitanRestartRateHigh",
         {f'kubetitan_operator_job_restarts{{{J}}}': "0x60 1 2 3 4 5 5x60"}, "70m", True, "5"),
    Case("restarts-pending", "KubeTitanRestartRateHigh",
         {f'kubetitan_operator_job_restarts{{{J}}}': "0x60 1 2 3 4 5 5x60"}, "66m", False),
    Case("restarts-few", "KubeTitanRestartRateHigh",
         {f'kubetitan_operator_job_restarts{{{J}}}': "0x60 1 2 2x60"}, "70m", False),
    Case("restarts-long-ago", "KubeTitanRestartRateHigh",
         {f'kubetitan_operator_job_restarts{{{J}}}': "0 1 2 3 4 5 5x130"}, "130m", False),
    # -- MFU: 0.5 for 400m, then 0.2; condition from ~408m, `for` 30m
    Case("mfu-fires", "KubeTitanMFUDropped", {f"kubetitan_trainer_mfu_ratio{{{T}}}": "0.5x400 0.2x60"}, "445m", True, "20%"),
    Case("mfu-pending", "KubeTitanMFUDropped", {f"kubetitan_trainer_mfu_ratio{{{T}}}": "0.5x400 0.2x60"}, "420m", False),
    Case("mfu-steady", "KubeTitanMFUDropped", {f"kubetitan_trainer_mfu_ratio{{{T}}}": "0.5x460"}, "445m", False),
    # -- checkpoint stale: 10 steps/min, interval 20 steps, never saved; condition from 7m, `for` 10m
    Case("checkpoint-stale-fires", "KubeTitanCheckpointStale",
         {f"kubetitan_trainer_step{{{T}}}": "0+10x30", f"kubetitan_trainer_last_checkpoint_step{{{T}}}": "0x30",
          f"kubetitan_trainer_checkpoint_interval_steps{{{T}}}": "20x30"}, "20m", True, "200"),
    Case("checkpoint-stale-pending", "KubeTitanCheckpointStale",
         {f"kubetitan_trainer_step{{{T}}}": "0+10x30", f"kubetitan_trainer_last_checkpoint_step{{{T}}}": "0x30",
          f"kubetitan_trainer_checkpoint_interval_steps{{{T}}}": "20x30"}, "15m", False),
    Case("checkpoint-stale-default-interval-fires", "KubeTitanCheckpointStale",
         {f"kubetitan_trainer_step{{{T}}}": "0+100x40", f"kubetitan_trainer_last_checkpoint_step{{{T}}}": "0x40"},
         "30m", True, "3k"),
    Case("checkpoint-fresh", "KubeTitanCheckpointStale",
         {f"kubetitan_trainer_step{{{T}}}": "0+10x30", f"kubetitan_trainer_last_checkpoint_step{{{T}}}": "0+10x30",
          f"kubetitan_trainer_checkpoint_interval_steps{{{T}}}": "20x30"}, "20m", False),
    # -- failed saves in a row: one at minute 5, a save completed at minute 20; `for` 1m
    Case("saves-failing-fires", "KubeTitanCheckpointSavesFailing",
         {f"kubetitan_trainer_checkpoint_saves_failed_in_a_row{{{T}}}": "0x4 1x10 2x5 0x10"}, "7m", True, "1"),
    Case("saves-failing-pending", "KubeTitanCheckpointSavesFailing",
         {f"kubetitan_trainer_checkpoint_saves_failed_in_a_row{{{T}}}": "0x4 1x10 2x5 0x10"}, "5m", False),
    Case("saves-recovered", "KubeTitanCheckpointSavesFailing",
         {f"kubetitan_trainer_checkpoint_saves_failed_in_a_row{{{T}}}": "0x4 1x10 2x5 0x10"}, "25m", False),
    # -- a run's phase and reason (kubetitan_operator_job_phase_info): the series moves with the status
    Case("run-failed-fires", "KubeTitanRunFailed",
         {f'{P}{{{J},phase="Running",reason="Training"}}': "1x5 _x10",
          f'{P}{{{J},phase="Failed",reason="MaxRestartsExceeded"}}': "_x5 1x10"}, "8m", True,
         labels=_run("Failed", "MaxRestartsExceeded")),
    Case("run-failed-pending", "KubeTitanRunFailed",
         {f'{P}{{{J},phase="Running",reason="Training"}}': "1x5 _x10",
          f'{P}{{{J},phase="Failed",reason="MaxRestartsExceeded"}}': "_x5 1x10"}, "5m", False),
    Case("run-running", "KubeTitanRunFailed", {f'{P}{{{J},phase="Running",reason="Training"}}': "1x15"}, "10m", False),
    Case("run-succeeded", "KubeTitanRunFailed", {f'{P}{{{J},phase="Succeeded",reason="Completed"}}': "1x15"}, "10m",
         False),
    Case("run-failed-storage-full-has-its-own", "KubeTitanRunFailed",
         {f'{P}{{{J},phase="Failed",reason="StorageFull"}}': "1x15"}, "10m", False),
    Case("unschedulable-waiting-fires", "KubeTitanRunUnschedulable",
         {f'{P}{{{J},phase="Starting",reason="PodsUnschedulable"}}': "1x15"}, "5m", True,
         labels=_run("Starting", "PodsUnschedulable")),
    Case("unschedulable-failed-fires", "KubeTitanRunUnschedulable",
         {f'{P}{{{J},phase="Failed",reason="UnschedulableTimeout"}}': "1x15"}, "5m", True,
         labels=_run("Failed", "UnschedulableTimeout")),
    Case("unschedulable-pending", "KubeTitanRunUnschedulable",
         {f'{P}{{{J},phase="Starting",reason="WaitingForPods"}}': "1x2 _x2",
          f'{P}{{{J},phase="Starting",reason="PodsUnschedulable"}}': "_x2 1x2"}, "2m", False),
    Case("unschedulable-waiting-for-pods", "KubeTitanRunUnschedulable",
         {f'{P}{{{J},phase="Starting",reason="WaitingForPods"}}': "1x15"}, "10m", False),
    Case("storage-full-fires", "KubeTitanStorageFull", {f'{P}{{{J},phase="Failed",reason="StorageFull"}}': "1x5"},
         "1m", True, labels=_run("Failed", "StorageFull")),
    Case("storage-other-failure", "KubeTitanStorageFull", {f'{P}{{{J},phase="Failed",reason="ConfigError"}}': "1x5"},
         "1m", False),
    Case("network-not-efa-fires", "KubeTitanNetworkNotEFA",
         {f'{P}{{{J},phase="Failed",reason="NetworkNotEFA"}}': "1x5"}, "1m", True,
         labels=_run("Failed", "NetworkNotEFA")),
    Case("network-efa-ok", "KubeTitanNetworkNotEFA", {f'{P}{{{J},phase="Running",reason="Training"}}': "1x5"}, "1m",
         False),
    # -- a restart with a cause whose row names an alert (kubetitan_core.causes: GPUXidError); the counter series
    # appears with the first such restart, which must count although increase() has no earlier sample
    Case("gpu-xid-first-restart-fires", "KubeTitanGPUXidError",
         {f'kubetitan_operator_restarts_total{{{J},cause="GPUXidError",mode="Recreate"}}': "_x5 1x60"}, "10m", True,
         "1"),
    Case("gpu-xid-another-within-the-window-fires", "KubeTitanGPUXidError",
         {f'kubetitan_operator_restarts_total{{{J},cause="GPUXidError",mode="Recreate"}}': "1x100 2x30"}, "110m", True,
         "1"),
    Case("gpu-xid-long-ago", "KubeTitanGPUXidError",
         {f'kubetitan_operator_restarts_total{{{J},cause="GPUXidError",mode="Recreate"}}': "_x5 1x130"}, "130m", False),
    Case("gpu-xid-other-causes", "KubeTitanGPUXidError",
         {f'kubetitan_operator_restarts_total{{{J},cause="ContainerFailed",mode="InPlace"}}': "_x5 1x60"}, "10m",
         False),
    # -- operator down
    Case("operator-down-fires", "KubeTitanOperatorDown", {f"up{{{O}}}": "0x20"}, "15m", True, labels={}),
    Case("operator-down-no-target-fires", "KubeTitanOperatorDown", {f"up{{{T}}}": "1x20"}, "15m", True, labels={}),
    Case("operator-down-pending", "KubeTitanOperatorDown", {f"up{{{O}}}": "0x20"}, "9m", False),
    Case("operator-up", "KubeTitanOperatorDown", {f"up{{{O}}}": "1x20"}, "15m", False),
    # -- reconcile errors: one a minute; condition from 6m, `for` 15m
    Case("reconcile-errors-fire", "KubeTitanReconcileErrors",
         {f"kubetitan_operator_reconcile_errors_total{{{O}}}": "0+1x60"}, "40m", True, "15",
         labels={"namespace": "kubetitan-system"}),
    Case("reconcile-errors-pending", "KubeTitanReconcileErrors",
         {f"kubetitan_operator_reconcile_errors_total{{{O}}}": "0+1x60"}, "20m", False),
    Case("reconcile-no-errors", "KubeTitanReconcileErrors",
         {f"kubetitan_operator_reconcile_errors_total{{{O}}}": "0x60"}, "40m", False),
]


def expected_annotations(case: Case) -> dict[str, str]:
    """The alert's annotations with its templates filled in by hand for this case."""
    rule = next(r for g in al.rule_groups()["groups"] for r in g["rules"] if r["alert"] == case.alert)
    desc = rule["annotations"]["description"]
    for key, val in case.labels.items():
        desc = desc.replace(f"{{{{ $labels.{key} }}}}", val)
    desc = re.sub(r"\{\{ \$value \| \w+ \}\}", case.value_text, desc)
    assert "{{" not in desc, f"{case.id}: description still has a template: {desc}"
    return {**rule["annotations"], "description": desc}


def promtool_test_file(case: Case, tmp: Path) -> Path:
    alert_test = {"eval_time": case.eval_time, "alertname": case.alert, "exp_alerts": []}
    if case.firing:
        alert_test["exp_alerts"] = [{
            "exp_labels": {"severity": ALERTS[case.alert].severity, **case.labels},
            "exp_annotations": expected_annotations(case),
        }]
    doc = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m",
                   "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                   "alert_rule_test": [alert_test]}],
    }
    path = tmp / f"{case.id}.test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_promtool_rule_unit_test(case, tmp_path):
    proc = subprocess.run([promtool(), "test", "rules", str(promtool_test_file(case, tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_non_firing_case():
    for name in ALERTS:
        assert {c.firing for c in CASES if c.alert == name} == {True, False}, name


def test_a_wrong_expectation_fails(tmp_path):
    """The harness can fail: a firing case turned into 'expect nothing' must not pass."""
    case = next(c for c in CASES if c.id == "stalled-fires")
    case = Case(**{**case.__dict__, "firing": False})
    proc = subprocess.run([promtool(), "test", "rules", str(promtool_test_file(case, tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "KubeTitanTrainingStalled" in proc.stdout + proc.stderr


def test_promtool_check_rules():
    proc = subprocess.run([promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_rules_file_is_generated_from_code():
    assert yamlio.load(RULES_FILE.read_text()) == al.rule_groups()


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_shape_and_runbook(name):
    a = ALERTS[name]
    rule = next(r for r in al.rule_groups()["groups"][0]["rules"] if r["alert"] == name)
    assert re.fullmatch(r"KubeTitan[A-Z][A-Za-z]+", name)
    assert a.severity in {"critical", "warning", "info"}
    assert "{{" not in a.summary and a.summary.endswith(".")
    assert "Check" in a.description
    if name not in {"KubeTitanOperatorDown", "KubeTitanReconcileErrors"}:  # operator-level alerts
        assert "{{ $labels.namespace }}/{{ $labels.name }}" in a.description
    assert rule["annotations"]["runbook_url"] == f"{DEFAULT.runbook_url_base}#{name.lower()}"
    # docs/runbook.md has the entry the anchor points at (GitHub anchors: lowercased headings).
    headings = [h.strip().lower() for h in re.findall(r"^## (.+)$", RUNBOOK.read_text(), re.M)]
    assert name.lower() in headings
