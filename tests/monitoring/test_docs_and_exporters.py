"""docs/monitoring.md explains every exported metric, alert and panel; the trainer's exporter
passes `promtool check metrics` without a training run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kubetitan.monitoring import alerts, dashboards

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "monitoring.md").read_text()
# One worker imports the trainer's exporter (torch + torchtitan) once for the whole module.
pytestmark = pytest.mark.xdist_group("trainer-exporter")


def metric_names(registry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else "_info" if family.type == "info" else ""))
    return names


@pytest.fixture(scope="module")
def trainer_registry():
    from kubetitan_trainer.metrics import Exporter

    e = Exporter(peak_flops=989e12, total_steps=100, attempt=1, job_start=1.7e9)
    e.set_loss(2.5)  # the loss metric is registered at the first logged step
    return e.registry


@pytest.fixture(scope="module")
def operator_registry():
    from kubetitan.operator_metrics import OperatorMetrics

    return OperatorMetrics().registry


@pytest.mark.parametrize("which", ["trainer", "operator"])
def test_every_exported_metric_is_documented(which, request):
    registry = request.getfixturevalue(f"{which}_registry")
    names = metric_names(registry)
    assert names, which
    missing = sorted(n for n in names if f"`{n}`" not in DOC)
    assert not missing, f"docs/monitoring.md does not explain: {missing}"


def test_trainer_exporter_passes_promtool_check_metrics(trainer_registry):
    promtool = shutil.which("promtool") or pytest.fail("promtool not found: run `make tools`")
    proc = subprocess.run([promtool, "check", "metrics"], input=generate_latest(trainer_registry).decode(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


def test_every_alert_is_documented_with_its_severity():
    for a in alerts.alerts():
        row = next((l for l in DOC.splitlines() if l.startswith(f"| {a.name} |")), None)
        assert row, a.name
        assert f"| {a.severity} |" in row and f"| {a.for_} |" in row, row


@pytest.mark.parametrize("build", [dashboards.run_dashboard, dashboards.operator_dashboard], ids=["run", "operator"])
def test_every_panel_is_documented(build):
    dash = build()
    section = DOC.split(f"### {dash['title']}", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \|", section, re.M)
    documented = [r for r in rows[1:] if not set(r) <= {"-", " "}]  # skip the header and the rule
    assert documented == [p["title"] for p in dash["panels"]]


def test_the_operator_exports_exactly_the_contracts_metric_names(operator_registry):
    """One list of the operator's metric names (``kubetitan_core.contract.OP_*``): operator_metrics.py registers
    each of them and nothing else, and the queries of the dashboards and alerts take theirs from it."""
    from kubetitan_core import contract
    from kubetitan.monitoring import queries

    names = {v for k, v in vars(contract).items() if k.startswith("OP_")}
    assert metric_names(operator_registry) == names
    used = {v for k, v in vars(queries).items() if k.startswith("OP_")}
    assert used and used <= names and all(getattr(queries, k) is getattr(contract, k) for k in vars(queries)
                                          if k.startswith("OP_"))
