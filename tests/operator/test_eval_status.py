"""status.training.evalLoss/evalPerplexity/evalStep: rank 0's held-out evaluation metrics reach the status
(scraped like the training loss), and stay until the next evaluation."""

from __future__ import annotations

import math

import pytest

from kubetitan import status as S
from kubetitan.observe import parse_metrics
from kubetitan_core import contract
from kubetitan_core.api import LlamaPretrainSpec

NOW = 1_800_000_000.0


def exposition(step: int, eval_step: int | None, eval_loss: float | None) -> str:
    lines = [f"# TYPE {contract.M_STEP} gauge", f"{contract.M_STEP} {step}",
             f"# TYPE {contract.M_LOSS} gauge", f"{contract.M_LOSS} 3.5"]
    if eval_loss is not None:
        lines += [f"# TYPE {contract.M_EVAL_LOSS} gauge", f"{contract.M_EVAL_LOSS} {eval_loss}",
                  f"# TYPE {contract.M_EVAL_PERPLEXITY} gauge", f"{contract.M_EVAL_PERPLEXITY} {math.exp(eval_loss)}",
                  f"# TYPE {contract.M_EVAL_STEP} gauge", f"{contract.M_EVAL_STEP} {eval_step}"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("step,eval_step,eval_loss,want", [
    (1, None, None, (None, None, None)),  # no evaluation yet (or none configured): absent, not 0
    (1, 1, 3.25, (3.25, round(math.exp(3.25), 6), 1)),
    (40, 40, 2.5, (2.5, round(math.exp(2.5), 6), 40)),
], ids=["before-the-first", "step-1", "step-40"])
def test_eval_metrics_reach_status_training(step, eval_step, eval_loss, want):
    t = S.training_status(LlamaPretrainSpec(), parse_metrics(exposition(step, eval_step, eval_loss)), NOW, None)
    assert (t.eval_loss, t.eval_perplexity, t.eval_step) == want
    assert t.loss == 3.5


def test_the_last_evaluation_stays_between_evaluations_and_an_overflowing_perplexity_is_unknown():
    t = S.training_status(LlamaPretrainSpec(), parse_metrics(exposition(40, 40, 2.5)), NOW, None)
    later = S.training_status(LlamaPretrainSpec(), parse_metrics(exposition(45, None, None)), NOW + 10, t)
    assert (later.eval_loss, later.eval_step, later.step) == (2.5, 40, 45)
    m = parse_metrics(exposition(50, 50, 2.0).replace(f"{contract.M_EVAL_LOSS} 2.0", f"{contract.M_EVAL_LOSS} 800.0")
                      .replace(f"{contract.M_EVAL_PERPLEXITY} {math.exp(2.0)}", f"{contract.M_EVAL_PERPLEXITY} +Inf"))
    assert m[contract.M_EVAL_PERPLEXITY] == math.inf  # what the trainer exports when exp(loss) overflows
    t = S.training_status(LlamaPretrainSpec(), m, NOW, None)
    assert t.eval_loss == 800.0 and t.eval_perplexity is None
    t.model_dump_json()  # the status stays serialisable (no inf)
