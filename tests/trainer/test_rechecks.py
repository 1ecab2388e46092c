"""The trainer's re-checks are driven by the rule table: every ``kubetitan_core.validation.RULES`` entry with a
``trainer`` key has exactly one re-check in ``kubetitan_trainer.checks.RECHECKS``, ``checks.check`` runs them
from the table, and each refuses a trainer.toml that breaks its rule (exit code 2's ConfigError names the rule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubetitan_core.validation import RULES, Rule
from support.specs import tiny_lpt, write_config

FLAGGED = [r.id for r in RULES if r.trainer]

F8 = {"model": {"converters": ["quantize.linear.float8"]}}
# rule id -> (trainer.toml sections to overwrite, world size, cuda); the tiny test run is valid as rendered.
CASES: dict[str, tuple[dict[str, dict[str, Any]], int, bool]] = {
    "parallelism.product": ({"parallelism": {"tensor_parallel_degree": 3}}, 2, False),
    "tokenizer.vocab": ({"model": {"flavor": "custom"}}, 2, False),  # + kubetitan.model vocab_size 600 below
    "training.global-batch": ({"training": {"global_batch_size": 12}}, 2, False),  # local 4 x dp 2 = 8
    "float8.hardware": ({**F8, "quantize": {"linear": {"float8": {"emulate": False}}}}, 2, False),
    "float8.emulate-compile": ({**F8, "quantize": {"linear": {"float8": {"emulate": True}}},
                                "compile": {"enable": True, "components": ["model", "loss"]}}, 2, False),
    "float8.all-gather-recipe": ({**F8, "quantize": {"linear": {"float8": {
        "emulate": True, "recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True}}}}, 2, False),
    "data.shards-required": ({"kubetitan": {"data": {"source": "shards", "shards_path": ""}}}, 2, False),
    "tokenizer.path-required": ({"kubetitan": {"tokenizer": {"source": "path", "path": "{tmp}/no-tokenizer"}}}, 2, False),
    "data.s3-uri": ({"kubetitan": {"data": {"source": "mixture", "mixture_paths": ["s3://ok-bucket/a", "s3://b//x"],
                                            "mixture_weights": [1, 1]}}}, 2, False),
    "data.mixture-schedule": ({"kubetitan": {"data": {
        "source": "mixture", "mixture_paths": ["/data/a", "/data/b"], "mixture_weights": [1, 1],
        "mixture_schedule_interpolations": ["", "step"], "mixture_schedule_sources": [1, 1],
        "mixture_schedule_steps": [5, 3], "mixture_schedule_weights": [2, 3]}}}, 2, False),  # steps out of order
    "checkpoint.s3-uri": ({"kubetitan": {"checkpoint_storage": {"s3_uri": "s3://Bad_Bucket/x"}}}, 2, False),
}


def _config(tmp_path: Path, patch: dict[str, dict[str, Any]]):
    from kubetitan_trainer.main import load_config

    obj = tiny_lpt({"model": {"flavor": "custom", "custom": {"dim": 64, "nLayers": 2, "nHeads": 4, "vocabSize": 2048}}})
    path = write_config(tmp_path / "trainer.toml", obj, tmp_path)
    import tomllib

    import tomli_w

    cfg = tomllib.loads(path.read_text())
    for section, values in patch.items():
        _merge(cfg.setdefault(section, {}), values, tmp_path)
    path.write_text(tomli_w.dumps(cfg))
    return load_config(["--job.config_file", str(path)])


def _merge(into: dict[str, Any], values: dict[str, Any], tmp_path: Path) -> None:
    for k, v in values.items():
        if isinstance(v, dict):
            _merge(into.setdefault(k, {}), v, tmp_path)
        else:
            into[k] = v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v


def test_every_flagged_rule_has_one_recheck_and_every_recheck_a_flagged_rule():
    from kubetitan_trainer.checks import RECHECKS

    assert FLAGGED, "the table flags no rule for the trainer"
    assert set(RECHECKS) == set(FLAGGED)
    assert set(CASES) == set(FLAGGED), "each flagged rule needs a case here"


def test_a_recheck_for_a_rule_the_table_does_not_flag_is_refused():
    from kubetitan_trainer.checks import recheck

    unflagged = next(r.id for r in RULES if not r.trainer)
    with pytest.raises(LookupError, match=unflagged):
        recheck(unflagged)(lambda *a: None)


def test_the_rendered_tiny_run_passes_every_recheck(tmp_path):
    from kubetitan_trainer.checks import check

    check(_config(tmp_path, {}), 2, cuda=False)


@pytest.mark.parametrize("rule", FLAGGED)
def test_each_recheck_refuses_a_config_that_breaks_its_rule(rule, tmp_path):
    from kubetitan_trainer.checks import check
    from kubetitan_trainer.errors import ConfigError

    patch, world, cuda = CASES[rule]
    if rule == "tokenizer.vocab":
        patch = {**patch, "kubetitan": {"model": {"vocab_size": 600}}}  # the builtin tokenizer has 644 tokens
    cfg = _config(tmp_path, patch)
    with pytest.raises(ConfigError) as e:
        check(cfg, world, cuda)
    assert e.value.rule == rule, e.value
    assert "Fix:" in str(e.value)


def test_check_follows_the_table(tmp_path, monkeypatch):
    """Un-flag a rule in the table and the trainer stops re-checking it: the table, not checks.py, decides."""
    from kubetitan_trainer import checks

    patch, world, cuda = CASES["training.global-batch"]
    cfg = _config(tmp_path, patch)
    table = tuple(Rule(r.id, r.field, r.checks, "", r.cel) if r.id == "training.global-batch" else r for r in RULES)
    monkeypatch.setattr(checks, "RULES", table)
    checks.check(cfg, world, cuda)  # no longer refused
