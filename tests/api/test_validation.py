"""The semantic validator: every invalid spec is rejected with its field path and a fix."""

from __future__ import annotations

from pathlib import Path

import re

import pytest

from support.paths import EXAMPLES, load_example
from support.specs import make_lpt
from support import yamlio
from kubetitan_core.validation import CEL_RULES, parse

CORPUS = yamlio.load((Path(__file__).parent / "invalid_specs.yaml").read_text())
# Every message says how to fix the problem, not only what it is.
FIX = re.compile(r"\b(use|set|remove|lower|raise|pick|change|give|leave|keep|turn|request|fix|enable|add|move|rename)\b")


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 30
    assert len({c["name"] for c in CORPUS}) == len(CORPUS), "corpus names must be unique"


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_invalid_spec_is_rejected_with_path_and_rule(case):
    _, errors = parse(make_lpt(case["spec"]))
    got = sorted((e.path, e.rule) for e in errors)
    want = sorted((e["path"], e["rule"]) for e in case["errors"])
    assert got == want, "\n".join(str(e) for e in errors)
    for e in errors:
        # A message says what is wrong in words, not just a repeat of the path.
        assert len(e.message) > 10 and e.path not in e.message
        assert FIX.search(e.message), f"no fix in: {e}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_valid(path):
    lpt, errors = parse(load_example(path))
    assert errors == [] and lpt is not None


def test_empty_spec_is_valid_and_defaulted():
    lpt, errors = parse(make_lpt({}))
    assert errors == []
    s = lpt.spec
    assert (s.model.flavor, s.training.seq_len, s.resources.gpus_per_node) == ("8B", 8192, 8)
    assert s.parallelism.data_parallel_shard_degree == -1
    assert s.checkpoint.async_mode == "async"


@pytest.mark.parametrize(
    "obj, path, fragment",
    [
        ({"apiVersion": "kubetitan.io/v1", "kind": "LlamaPretrain"}, "apiVersion", "kubetitan.io/v1alpha1"),
        ({"apiVersion": "kubetitan.io/v1alpha1", "kind": "PyTorchJob"}, "kind", "not LlamaPretrain"),
        ([1, 2], "<document>", "expected a YAML mapping"),
        ({**make_lpt({}), "metadata": {}}, "metadata.name", "required"),
        (make_lpt({}, name="x" * 60), "metadata.name", "at most 54"),
        ({**make_lpt({}), "extra": 1}, "extra", "unknown field"),
        ({"apiversion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain"}, "apiversion", "did you mean 'apiVersion'"),
        ({**make_lpt({}), "metadata": {"nmae": "x"}}, "metadata.nmae", "unknown field"),
        (make_lpt({}, namespace="ML_team"), "metadata.namespace", "DNS-1123 label"),
        ({**make_lpt({}), "metadata": {"name": "r", "labels": {"team": "ml research"}}}, "metadata.labels[team]",
         "not a valid label value"),
        ({**make_lpt({}), "metadata": {"name": "r", "annotations": {"my note": "x"}}}, "metadata.annotations[my note]",
         "not a valid annotation key"),
        ({**make_lpt({}), "metadata": {"name": "r", "annotations": {"a": "x" * 300_000}}}, "metadata.annotations",
         "at most 262144"),
    ],
    ids=["wrong-version", "wrong-kind", "not-a-mapping", "no-name", "long-name", "unknown-top-level",
         "top-level-case", "metadata-unknown", "namespace", "label-value", "annotation-key", "annotations-size"],
)
def test_object_level_errors(obj, path, fragment):
    _, errors = parse(obj)
    assert any(e.path == path and fragment in e.message for e in errors), errors
    assert all(FIX.search(e.message) for e in errors), errors


def test_every_cel_rule_has_a_python_twin_in_the_corpus():
    exercised = {e["rule"] for c in CORPUS for e in c["errors"]}
    missing = {r.id for r in CEL_RULES} - exercised
    assert not missing, f"CEL rules without a corpus case: {missing}"


def test_the_corpus_names_only_the_tables_rules():
    """Every rule id the corpus expects is a ``RULES`` entry (each entry's own corpus case and predicate:
    tests/api/test_rule_table.py::test_each_rule_is_in_the_corpus_and_refused_by_its_own_predicate)."""
    from kubetitan_core.validation import RULES

    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    used = {e["rule"] for c in CORPUS for e in c["errors"]} - {"schema"}
    assert used <= set(ids), f"rules missing from validation.RULES: {used - set(ids)}"
    assert {c.id for c in CEL_RULES} <= set(ids)
