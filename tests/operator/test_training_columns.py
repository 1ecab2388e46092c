"""``status.training`` (the Progress, Loss, Tok/s and MFU columns, the ETA) says what trains now: a restart or
workers that have not trained yet show no pace and no ETA (never the old attempt's), the step shown is one that was
reached (never a fresh exporter's 0 while a checkpoint loads), and a finished run has no ETA. Table tests of the one
place that builds the status (``kubetitan.status``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan import status as S
from kubetitan_core import contract
from kubetitan_core.api import Condition, LlamaPretrainSpec, LlamaPretrainStatus, TrainingStatus
from kubetitan.decide import Action, decide
from kubetitan.observation import NodeObs, PodObs
from kubetitan.observation import tracking as T
from kubetitan.timestamps import iso

NOW = 1_000_000.0
SPEC = LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "training": {"steps": 100}})
LIVE = {"tokens_per_second": None, "tokens_per_second_per_gpu": None, "tflops_per_gpu": None, "mfu": None,
        "eta": None}
TRAINED_AT_40 = TrainingStatus(step=40, total_steps=100, progress="40/100", loss=2.5, tokens_per_second=8192.0,
                               tokens_per_second_per_gpu=1024.0, tflops_per_gpu=400.0, mfu=0.4,
                               eta=iso(NOW + 60), last_checkpoint_step=30)
"""What the status shows of attempt 0 training at step 40 (checkpoint 30), 60 steps of 1 s left."""


def _metrics(**kw: float) -> dict[str, float]:
    return {getattr(contract, k): v for k, v in kw.items()}


TRAINING = _metrics(M_STEP=41, M_LOSS=2.4, M_TOKENS_PER_SECOND=9000.0, M_TOKENS_PER_SECOND_PER_GPU=1125.0,
                    M_FLOPS_PER_GPU=4.5e14, M_MFU=0.45, M_STEP_DURATION=1.0, M_LAST_STEP_TIMESTAMP=NOW - 1,
                    M_FIRST_STEP_TIMESTAMP=NOW - 30, M_RESUMED_FROM_STEP=0)
FRESH = _metrics(M_STEP=0, M_TOKENS_PER_SECOND=0.0, M_TOKENS_PER_SECOND_PER_GPU=0.0, M_FLOPS_PER_GPU=0.0,
                 M_LAST_STEP_TIMESTAMP=0.0, M_FIRST_STEP_TIMESTAMP=0.0)
"""A new attempt's exporter before its workers trained: every gauge at its initial 0."""

SCRAPES = [
    # (id, rank 0's metrics, the status's training before, what the new training must hold)
    ("training", TRAINING, TRAINED_AT_40,
     {"step": 41, "progress": "41/100", "loss": 2.4, "tokens_per_second": 9000.0, "mfu": 0.45, "tflops_per_gpu": 450.0,
      "eta": iso(NOW + 59)}),
    ("new-workers-loading-a-checkpoint", {**FRESH, contract.M_RESUMED_FROM_STEP: -1}, TRAINED_AT_40,
     {"step": 40, "progress": "40/100", "loss": 2.5, **LIVE}),
    ("new-workers-resumed-from-checkpoint-30", {**FRESH, contract.M_STEP: 30, contract.M_RESUMED_FROM_STEP: 30},
     TRAINED_AT_40, {"step": 30, "progress": "30/100", "loss": None, **LIVE}),
    ("new-workers-start-from-scratch", {**FRESH, contract.M_RESUMED_FROM_STEP: 0}, TRAINED_AT_40,
     {"step": 0, "progress": "0/100", "loss": None, **LIVE}),
    ("exporter-without-heartbeat-counts-every-step", _metrics(M_STEP=41, M_TOKENS_PER_SECOND=9000.0,
                                                              M_STEP_DURATION=1.0), None,
     {"step": 41, "progress": "41/100", "tokens_per_second": 9000.0, "eta": iso(NOW + 59)}),
]


@pytest.mark.parametrize(("metrics", "old", "want"), [c[1:] for c in SCRAPES], ids=[c[0] for c in SCRAPES])
def test_training_numbers_from_a_scrape_are_only_the_workers_that_train(
        metrics: dict[str, float], old: TrainingStatus | None, want: dict[str, Any]) -> None:
    t = S.training_status(SPEC, metrics, NOW, old)
    assert {k: getattr(t, k) for k in want} == want


def _pods(attempt: int = 0, **over: dict[str, Any]) -> tuple[PodObs, ...]:
    return tuple(replace(PodObs(name=f"j-a{attempt}-{r}", attempt=attempt, rank=r, phase="Running", node_name=f"n{r}",
                                created=NOW - 50, running_since=NOW - 40), **over.get(f"r{r}", {})) for r in range(2))


AT_40 = _metrics(M_STEP=40, M_LAST_CHECKPOINT_STEP=30, M_LAST_STEP_TIMESTAMP=NOW - 1, M_FIRST_STEP_TIMESTAMP=NOW - 30,
                 M_RESUMED_FROM_STEP=0)
"""Rank 0's last scrape of attempt 0: step 40, checkpoint 30 (what the observation holds when the decision comes)."""
FAILED_1 = {"r1": {"phase": "Failed", "exit_code": 1}}
DONE = {"r0": {"phase": "Succeeded", "exit_code": 0}, "r1": {"phase": "Succeeded", "exit_code": 0}}
FINISHED = [Condition(type=C.SUCCEEDED, status="True", reason=C.COMPLETED)]

TRANSITIONS = [
    # (id, runPolicy, pods, rank 0's last scrape, status fields, the action, what status.training must hold after it)
    ("still-training-keeps-its-pace", {}, {}, AT_40, {}, Action.KEEP,
     {"progress": "40/100", "loss": 2.5, "tokens_per_second": 8192.0, "eta": iso(NOW + 60)}),
    ("restart-shows-the-checkpoint-it-resumes-from-and-no-pace", {}, FAILED_1, AT_40, {}, Action.RESTART,
     {"step": 30, "progress": "30/100", "loss": None, "last_checkpoint_step": 30, **LIVE}),
    ("restart-without-a-checkpoint-starts-over", {}, FAILED_1,
     {k: v for k, v in AT_40.items() if k != contract.M_LAST_CHECKPOINT_STEP}, {}, Action.RESTART,
     {"step": 0, "progress": "0/100", "loss": None, **LIVE}),
    ("succeeded-has-no-eta", {}, DONE, AT_40, {}, Action.SUCCEED,
     {"progress": "100/100", "eta": None, "tokens_per_second": 8192.0}),
    ("failed-has-no-eta", {"maxRestarts": 0}, FAILED_1, AT_40, {}, Action.FAIL,
     {"progress": "40/100", "eta": None, "tokens_per_second": 8192.0}),
    ("finished-earlier-drops-an-eta-in-the-past", {}, DONE, None,
     {"conditions": FINISHED, "completion_time": iso(NOW - 3600)}, Action.FINISHED,
     {"progress": "40/100", "eta": None}),
]


@pytest.mark.parametrize(("policy", "pods", "scrape", "fields", "action", "want"), [c[1:] for c in TRANSITIONS],
                         ids=[c[0] for c in TRANSITIONS])
def test_the_training_columns_across_a_restart_and_the_end_of_the_run(
        policy: dict[str, Any], pods: dict[str, Any], scrape: dict[str, float] | None, fields: dict[str, Any],
        action: Action, want: dict[str, Any]) -> None:
    spec = LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "training": {"steps": 100}, "runPolicy": policy})
    st = LlamaPretrainStatus(attempt=0, start_time=iso(NOW - 100), training=TRAINED_AT_40.model_copy(), **fields)
    gang = _pods(**pods)
    o = T.track(None, 0, NOW, metrics=scrape, pods=gang)
    obs = T.observed(o, pods=gang, nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1")}, now=NOW, attempt_steps=100)
    d = decide(spec, st, obs)
    assert d.action == action, d
    t = S.next_status(spec, st, d, obs).training
    assert t is not None and {k: getattr(t, k) for k in want} == want


def test_the_operators_gauges_follow_the_columns_across_a_restart() -> None:
    """``kubetitan_operator_job_tokens_per_second`` and ``_mfu_ratio`` are cleared while no worker trains, as the
    status columns are (they kept the old attempt's pace through a restart); the step stays."""
    from kubetitan.operator_metrics import OperatorMetrics

    m = OperatorMetrics()

    def sample(name: str) -> float | None:
        return m.registry.get_sample_value(name, {"namespace": "ml", "name": "r"})

    m.set_training("ml", "r", TRAINED_AT_40, restart_count=0)
    assert sample("kubetitan_operator_job_tokens_per_second") == 8192.0 and sample("kubetitan_operator_job_mfu_ratio")
    restarting = TRAINED_AT_40.model_copy(update={**LIVE, "step": 30, "loss": None})  # what next_status writes
    m.set_training("ml", "r", restarting, restart_count=1)
    assert sample("kubetitan_operator_job_tokens_per_second") is None
    assert sample("kubetitan_operator_job_mfu_ratio") is None
    assert sample("kubetitan_operator_job_step") == 30 and sample("kubetitan_operator_job_restarts") == 1
    m.set_training("ml", "r", TRAINED_AT_40, restart_count=1)  # training again: back
    assert sample("kubetitan_operator_job_tokens_per_second") == 8192.0
