"""The rule table ``kubetitan_core.validation.RULES`` drives the CRD: every entry with a CEL twin is in the CRD's
``x-kubernetes-validations`` (rule, message, fieldPath), the CRD holds no CEL rule the table lacks, and the
generator reads the table (a rule added there appears in the CRD); the Python validator runs the table's predicates
(``CHECKS``, one per rule, in table order) and every rule has a corpus case its own predicate refuses. The trainer
side: tests/trainer/test_rechecks.py; docs/api.md: tests/api/test_apidoc.py; the corpus: tests/api/test_validation.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from support.specs import make_lpt
from support import yamlio
from kubetitan_core import crd as crdmod
from kubetitan_core import validation
from kubetitan_core.api import LlamaPretrain
from kubetitan_core.validation import CEL_RULES, CHECKS, RULES, Cel, Facts, Rule, parse

REPO = Path(__file__).resolve().parents[2]
COMMITTED = [REPO / "crds" / crdmod.CRD_FILE, REPO / "charts" / "kubetitan" / "crds" / crdmod.CRD_FILE]


def _validations(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every x-kubernetes-validations entry anywhere in a schema, with where it sits."""
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out += [(path, v) for v in node.get("x-kubernetes-validations", [])]
        for k, v in node.items():
            out += _validations(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _validations(v, f"{path}[{i}]")
    return out


def _want() -> list[dict[str, Any]]:
    return [{"rule": r.cel.rule, "message": r.cel.message, "fieldPath": r.cel.field_path, "reason": "FieldValueInvalid"}
            for r in RULES if r.cel is not None]


def test_the_committed_crds_cel_rules_are_exactly_the_tables_cel_twins():
    assert len(_want()) >= 10
    for f in COMMITTED:
        found = _validations(yamlio.load(f.read_text()))
        assert {where for where, _ in found} == {
            "/spec/versions[0]/schema/openAPIV3Schema/properties/spec"}, f"{f}: CEL outside spec"
        assert [v for _, v in found] == _want(), f"{f}: regenerate with {crdmod.GENERATE_COMMAND}"


def test_cel_rules_is_the_tables_view():
    assert [c.id for c in CEL_RULES] == [r.id for r in RULES if r.cel is not None]
    assert all(next(r for r in RULES if r.id == c.id).cel_rule == c for c in CEL_RULES)


def test_the_crd_is_generated_from_the_table(monkeypatch):
    """A rule added to (or dropped from) the table is added to (or dropped from) the generated CRD."""
    extra = Rule("training.example", "spec.training.steps", "a made-up rule",
                 cel=Cel("self.training.steps != 7", "training.steps may not be 7", ".training.steps"))
    dropped = next(r for r in RULES if r.cel is not None)
    monkeypatch.setattr(validation, "RULES", tuple(r for r in RULES if r is not dropped) + (extra,))
    rules = crdmod.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    assert rules[-1] == {"rule": "self.training.steps != 7", "message": "training.steps may not be 7",
                         "fieldPath": ".training.steps", "reason": "FieldValueInvalid"}
    assert dropped.cel.rule not in [r["rule"] for r in rules]


def test_every_cel_twin_reports_at_its_rules_field():
    for r in RULES:
        if r.cel is not None:
            assert r.cel.field_path.startswith("."), r.id
            assert f"spec{r.cel.field_path}".startswith(r.field.split(",")[0]) or r.field.startswith(
                f"spec{r.cel.field_path}"), (r.id, r.field, r.cel.field_path)


# ------------------------------------------------------------------ the table drives the Python validator
CORPUS = yamlio.load((REPO / "tests" / "api" / "invalid_specs.yaml").read_text())
# The metadata rules' cases (tests/api/invalid_specs.yaml holds specs only): objects each rule refuses.
OBJECT_CASES: dict[str, list[dict[str, Any]]] = {
    "metadata.fields": [
        {**make_lpt({}), "metadata": {"name": "r", "nmae": "x"}},
        make_lpt({}, namespace="ML_team"),
        {**make_lpt({}), "metadata": {"name": "r", "labels": {"team": "ml research"}, "finalizers": ["a b"]}},
    ],
    "metadata.name": [
        make_lpt({}, name="8b-run"),
        make_lpt({"resources": {"nodes": 11}}, name="x" * 54),  # 11 nodes: ranks of 2 digits, limit 53
        {**make_lpt({}), "metadata": {"generateName": "Llama3-"}},
    ],
}


def _cases(rule: Rule) -> list[dict[str, Any]]:
    """The objects of the corpus that break ``rule``."""
    rows = [make_lpt(c["spec"]) for c in CORPUS if any(e["rule"] == rule.id for e in c["errors"])]
    return rows + OBJECT_CASES.get(rule.id, [])


def _subject(rule: Rule, obj: dict[str, Any]) -> Any:
    """What the rule's predicate reads: the raw metadata, or the Facts of the parsed object."""
    return obj.get("metadata") if rule.before_parse else Facts.of(LlamaPretrain.model_validate(obj))


def test_every_rule_has_exactly_one_predicate():
    assert set(CHECKS) == {r.id for r in RULES}, set(CHECKS) ^ {r.id for r in RULES}
    with pytest.raises(ValueError, match="has a predicate already"):
        validation.check("training.warmup")(lambda f: iter(()))
    with pytest.raises(LookupError, match="not a RULES entry"):
        validation.check("training.made-up")(lambda f: iter(()))


@pytest.mark.parametrize("rule", RULES, ids=[r.id for r in RULES])
def test_each_rule_is_in_the_corpus_and_refused_by_its_own_predicate(rule):
    """Iterates the table: every rule has a corpus case; on each, the rule's predicate alone returns exactly the
    errors that ``parse`` reports under that rule's id (so no other predicate reports it, and it reports no other)."""
    cases = _cases(rule)
    assert cases, f"{rule.id}: add a case to tests/api/invalid_specs.yaml (or OBJECT_CASES for metadata rules)"
    for obj in cases:
        own = CHECKS[rule.id](_subject(rule, obj))
        assert own, (rule.id, obj)
        assert own == [e for e in parse(obj)[1] if e.rule == rule.id], (rule.id, obj)


def test_a_predicate_reports_only_its_own_rule():
    """Every predicate on every corpus object: each error it returns carries its own rule's id."""
    objects = [make_lpt(c["spec"]) for c in CORPUS] + [o for cs in OBJECT_CASES.values() for o in cs]
    seen: set[str] = set()
    for obj in objects:
        try:
            facts = Facts.of(LlamaPretrain.model_validate(obj))
        except ValidationError:
            facts = None  # a schema row: only the raw-metadata predicates can run
        for rule in RULES:
            if facts is None and not rule.before_parse:
                continue
            for e in CHECKS[rule.id](_subject(rule, obj)):
                assert e.rule == rule.id, (rule.id, e)
                seen.add(e.rule)
    assert seen == {r.id for r in RULES}


def test_validate_runs_the_tables_predicates_in_table_order(monkeypatch):
    """A rule dropped from the table is no longer checked, a rule added (entry + predicate) is, and errors come in
    table order."""
    spec = {"checkpoint": {"keepLatestK": 1}, "runPolicy": {"backoffSeconds": 60, "maxBackoffSeconds": 30},
            "training": {"steps": 7, "warmupSteps": 1}}
    assert [e.rule for e in parse(make_lpt(spec))[1]] == ["checkpoint.keep-latest-k", "run-policy.backoff-order"]

    extra = Rule("training.example", "spec.training.steps", "a made-up rule: steps is not 7")
    backoff = next(r for r in RULES if r.id == "run-policy.backoff-order")
    keep = next(r for r in RULES if r.id == "checkpoint.keep-latest-k")
    table = (extra,) + tuple(r for r in RULES if r not in (backoff, keep)) + (keep,)
    monkeypatch.setattr(validation, "RULES", table)
    monkeypatch.setattr(validation, "_IDS", frozenset(r.id for r in table))
    monkeypatch.setattr(validation, "CHECKS", dict(CHECKS))

    @validation.check("training.example")
    def _example(f):
        if f.spec.training.steps == 7:
            yield "spec.training.steps", "is 7; use another number"

    assert [(e.rule, e.path) for e in parse(make_lpt(spec))[1]] == [
        ("training.example", "spec.training.steps"), ("checkpoint.keep-latest-k", "spec.checkpoint.keepLatestK")]
