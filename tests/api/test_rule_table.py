"""The rule table ``kubetitan_core.validation.RULES`` drives the CRD: every entry with a CEL twin is in the CRD's
``x-kubernetes-validations`` (rule, message, fieldPath), the CRD holds no CEL rule the table lacks, and the
generator reads the table (a rule added there appears in the CRD). The trainer side: tests/trainer/test_rechecks.py;
docs/api.md: tests/api/test_apidoc.py; the corpus per rule: tests/api/test_validation.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kubetitan_core import crd as crdmod
from kubetitan_core import validation
from kubetitan_core.validation import CEL_RULES, RULES, Cel, Rule

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
        found = _validations(yaml.safe_load(f.read_text()))
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
