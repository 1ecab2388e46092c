"""status.training.evalLoss/evalPerplexity/evalStep: rank 0's held-out evaluation metrics reach the status
(scraped like the training loss), and stay until the next evaluation."""

from __future__ import annotations

import math

import pytest

from kubetitan import status as S
from kubetitan.observation.scrape import parse_metrics
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


def test_a_mixtures_per_source_losses_reach_status_training_one_per_mixture_source():
    """status.training.sources: each source's training loss and held-out loss (the latter kept between evaluations);
    at most one entry per spec.data.mixture source, whatever names the pod exports."""
    spec = LlamaPretrainSpec.model_validate({"data": {"source": "mixture", "mixture": [
        {"name": "web", "shards": {"path": "/d/web"}, "weight": 3}, {"name": "code", "shards": {"path": "/d/code"},
                                                                     "weight": 1}]}})

    def scrape(train: dict[str, float], held_out: dict[str, float]) -> dict[str, float]:
        lines = [f"# TYPE {contract.M_STEP} gauge", f"{contract.M_STEP} 7", f"# TYPE {contract.M_SOURCE_LOSS} gauge"]
        lines += [f'{contract.M_SOURCE_LOSS}{{source="{k}"}} {v}' for k, v in train.items()]
        lines += [f"# TYPE {contract.M_SOURCE_EVAL_LOSS} gauge"]
        lines += [f'{contract.M_SOURCE_EVAL_LOSS}{{source="{k}"}} {v}' for k, v in held_out.items()]
        return parse_metrics("\n".join(lines) + "\n")

    t = S.training_status(spec, scrape({"web": 2.5, "code": 1.25}, {"web": 2.75, "code": 1.5}), NOW, None)
    assert [s.dump() for s in t.sources] == [{"name": "code", "loss": 1.25, "evalLoss": 1.5},
                                             {"name": "web", "loss": 2.5, "evalLoss": 2.75}]
    later = S.training_status(spec, scrape({"web": 2.0, "code": 1.0, "x1": 9.0, "x2": 9.0}, {}), NOW + 5, t)
    assert [s.dump() for s in later.sources] == [{"name": "code", "loss": 1.0, "evalLoss": 1.5},
                                                 {"name": "web", "loss": 2.0, "evalLoss": 2.75}]
    assert S.training_status(LlamaPretrainSpec(), scrape({"a": 1.0}, {}), NOW, None).sources == []  # no mixture
