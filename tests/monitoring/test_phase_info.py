"""``kubetitan_operator_job_phase_info``: one series per run whose phase/reason labels follow the status (the
alerts on failed and unschedulable runs read it), and ``conditions.phase_reason`` that fills the reason."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetitan import conditions as C
from kubetitan.operator_metrics import OperatorMetrics
from kubetitan_core.api import Condition

INFO = "kubetitan_operator_job_phase_info"


def _series(m: OperatorMetrics) -> dict[tuple[str, str, str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name == INFO:
                lb = s.labels
                out[(lb["namespace"], lb["name"], lb["phase"], lb["reason"])] = s.value
    return out


def test_the_series_moves_with_the_status_and_goes_with_the_run():
    m = OperatorMetrics()
    m.set_phase("ml", "a", "Starting", "WaitingForPods")
    m.set_phase("ml", "b", "Running", "Training")
    assert _series(m) == {("ml", "a", "Starting", "WaitingForPods"): 1, ("ml", "b", "Running", "Training"): 1}
    m.set_phase("ml", "a", "Starting", "PodsUnschedulable")  # same phase, new reason: still one series
    m.set_phase("ml", "b", "Failed", "StorageFull")
    assert _series(m) == {("ml", "a", "Starting", "PodsUnschedulable"): 1, ("ml", "b", "Failed", "StorageFull"): 1}
    m.forget("ml", "b")
    assert _series(m) == {("ml", "a", "Starting", "PodsUnschedulable"): 1}
    # the phase counts stay consistent with the info series
    counts = {s.labels["phase"]: s.value for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
              for s in fam.samples if s.name == "kubetitan_operator_llamapretrains"}
    assert counts["Starting"] == 1 and counts["Failed"] == 0 and counts["Running"] == 0


def _cond(type_: str, status: str, reason: str) -> Condition:
    return Condition(type=type_, status=status, reason=reason, message="m", last_transition_time="t")


@pytest.mark.parametrize("conds, phase, want", [
    ([_cond(C.READY, "True", C.TRAINING)], "Running", C.TRAINING),
    ([_cond(C.READY, "False", C.PODS_UNSCHEDULABLE), _cond(C.UNSCHEDULABLE, "True", C.PODS_UNSCHEDULABLE)],
     "Starting", C.PODS_UNSCHEDULABLE),
    ([_cond(C.READY, "False", C.BACKOFF), _cond(C.RESTARTING, "True", C.BACKOFF)], "Restarting", C.BACKOFF),
    ([_cond(C.READY, "False", "MaxRestartsExceeded"), _cond(C.FAILED, "True", C.STORAGE_FULL)], "Failed",
     C.STORAGE_FULL),
    ([_cond(C.READY, "False", C.COMPLETED), _cond(C.SUCCEEDED, "True", C.COMPLETED)], "Succeeded", C.COMPLETED),
    ([_cond(C.READY, "False", C.POLICY_VIOLATION)], "Pending", C.POLICY_VIOLATION),
    ([], "Pending", ""),
], ids=["running", "unschedulable", "restarting", "failed-uses-failed", "succeeded", "refused", "none-yet"])
def test_phase_reason(conds, phase, want):
    assert C.phase_reason(conds, phase) == want
