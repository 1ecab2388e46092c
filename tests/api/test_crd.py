"""The generated CustomResourceDefinition: drift, structure, descriptions, defaults, columns.

The CRD is generated from kubetitan_core.api by kubetitan_core.crd; these tests check that what is
committed under crds/ is what the generator makes, that the API server would accept it
(structural schema, valid defaults, CEL field paths, printer columns that exist), and that
its defaulting gives the same spec as pydantic's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import kubernetes_validate
import pytest
from pydantic import Field

from kubetitan_core import crd as crdmod
from kubetitan_core.api import LlamaPretrain, _Base
from kubetitan_core.validation import CEL_RULES
from support import yamlio

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / crdmod.CRD_FILE
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

CRD = crdmod.crd()
VERSION = CRD["spec"]["versions"][0]
ROOT_SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = ROOT_SCHEMA["properties"]["spec"]
STATUS_SCHEMA = ROOT_SCHEMA["properties"]["status"]


def walk(node: dict[str, Any], path: str = ""):
    """Every schema node with its path (``.spec.training.seqLen``, ``[]`` for items)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}[*]")


def node_at(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The schema node of a simple JSONPath like ``.status.training.mfu``; None if absent."""
    node: dict[str, Any] | None = schema
    for part in path.strip(".").split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node


def drop_empty(x: Any) -> Any:
    """Remove empty lists and maps: absent and empty mean the same to pydantic."""
    if isinstance(x, dict):
        out = {k: drop_empty(v) for k, v in x.items()}
        return {k: v for k, v in out.items() if v not in ({}, [])}
    if isinstance(x, list):
        return [drop_empty(v) for v in x]
    return x


# ------------------------------------------------------------------------- drift
def test_committed_crd_matches_generator():
    want = crdmod.crd_yaml()
    got = COMMITTED.read_text() if COMMITTED.exists() else ""
    assert got == want, (
        f"{COMMITTED.relative_to(ROOT)} is out of date with kubetitan_core/api.py or the CEL rules; "
        f"regenerate it with `{crdmod.GENERATE_COMMAND}` and commit the result"
    )


def test_cli_crd_prints_the_committed_file(capsys):
    from kubetitan.cli import main

    assert main(["crd"]) == 0
    assert capsys.readouterr().out == COMMITTED.read_text()


def test_generator_write_and_output(tmp_path):
    out = tmp_path / "crd.yaml"
    assert crdmod.main(["--output", str(out)]) == 0
    assert out.read_text() == crdmod.crd_yaml()
    assert crdmod.main(["--output", str(out), "--kubernetes-version", "1.27"]) == 0
    assert "fieldPath" not in out.read_text() and "x-kubernetes-validations" in out.read_text()


# ------------------------------------------------------------------ names, shape
def test_names_scope_and_subresources():
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "llamapretrains.kubetitan.io"
    assert spec["group"] == "kubetitan.io" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "LlamaPretrain",
        "listKind": "LlamaPretrainList",
        "plural": "llamapretrains",
        "singular": "llamapretrain",
        "shortNames": ["lpt"],
        "categories": ["kubetitan"],
    }
    assert [(v["name"], v["served"], v["storage"]) for v in spec["versions"]] == [("v1alpha1", True, True)]
    assert VERSION["subresources"] == {"status": {}}


STRUCTURAL_FORBIDDEN = {"$ref", "anyOf", "allOf", "oneOf", "not", "title", "definitions", "$defs", "const"}


def test_schema_is_structural():
    problems = []
    for path, node in walk(ROOT_SCHEMA):
        if leftovers := STRUCTURAL_FORBIDDEN & node.keys():
            problems.append(f"{path}: has {sorted(leftovers)}")
        if "type" not in node:
            problems.append(f"{path}: no type")
        if node.get("type") == "object" and "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties together")
        if node.get("additionalProperties") is False:
            problems.append(f"{path}: additionalProperties false (the API server prunes instead)")
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
            problems.append(f"{path}: JSON-Schema-2020 exclusiveMinimum (OpenAPI v3 wants a bool)")
        if node.get("type") == "object" and not (
            "properties" in node or "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
        ) and path != ".metadata":
            problems.append(f"{path}: object without properties, additionalProperties or preserve-unknown-fields")
    assert problems == []
    # A real API server refuses anything about metadata but its type, a description included (the lane on a real
    # kube-apiserver, tests/cluster, found that the double had accepted one).
    assert ROOT_SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_every_property_has_a_description():
    missing = [path for path, node in walk(ROOT_SCHEMA) if path and not path.endswith(("[]", "[*]"))
               and path != ".metadata" and not node.get("description", "").strip()]  # metadata: type only
    assert missing == []


@pytest.mark.parametrize(
    "path, want",
    [
        (".spec.training.seqLen", {"type": "integer", "default": 8192, "minimum": 16, "maximum": 1048576,
                                   "description": "Tokens per sequence."}),
        (".spec.training.learningRate", {"type": "number", "default": 3.0e-4, "minimum": 0,
                                         "exclusiveMinimum": True, "maximum": 1}),
        (".spec.model.flavor", {"enum": ["debug", "1B", "3B", "8B", "70B", "405B", "custom"], "default": "8B"}),
        (".spec.precision.selectiveActivationCheckpointing", {"pattern": "^(op|[1-9][0-9]*)$", "default": "op"}),
        (".spec.precision.float8.filterFqns", {"type": "array", "default": ["output"], "items": {"type": "string"}}),
        (".spec.resources.shmSize", {"default": "64Gi", "pattern": "^[0-9]+(Ki|Mi|Gi|Ti)?$"}),
        (".spec.resources.nodeSelector", {"type": "object", "additionalProperties": {"type": "string"}}),
        (".spec.resources.affinity", {"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
        (".spec.resources.tolerations", {"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}),
        (".spec.resources.env", {"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}),
        (".spec.checkpoint.storage.persistentVolumeClaim.claimName", {"minLength": 1, "maxLength": 253}),
        (".spec.checkpoint.storage", {"default": {}}),
        (".spec.model.custom", {"required": ["dim", "nLayers", "nHeads"]}),
        (".spec.tokenizer.tokenSecretRef", {"required": ["name"]}),
        (".status.conditions", {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_schema_node(path, want):
    node = node_at(ROOT_SCHEMA, path)
    assert node is not None, f"{path} is not in the schema"
    assert {k: node.get(k) for k in want} == want


@pytest.mark.parametrize(
    "path",
    [".spec.model.custom", ".spec.data.shards", ".spec.data.huggingface", ".spec.tokenizer.tokenSecretRef",
     ".spec.resources.processesPerNode", ".spec.training.globalBatchSize", ".status", ".status.training"],
)
def test_optional_fields_have_no_default(path):
    """An optional section must stay absent: a default would turn it on (e.g. a custom model)."""
    assert "default" not in node_at(ROOT_SCHEMA, path)


def test_every_defaulted_section_cascades():
    """Each nested model with a default is `default: {}`, so the server fills its fields."""
    sections = [path for path, node in walk(SPEC_SCHEMA, ".spec")
                if node.get("type") == "object" and "properties" in node and "default" in node]
    assert all(node_at(ROOT_SCHEMA, p)["default"] == {} for p in sections)
    assert ".spec" not in sections  # spec itself has no default: test_spec_has_no_default
    assert {".spec.model", ".spec.training", ".spec.precision.float8", ".spec.checkpoint.storage",
            ".spec.runPolicy", ".spec.monitoring"} <= set(sections)


def test_spec_has_no_default():
    """A real API server evaluates the CEL rules on a default as written (no nested defaults), so `default: {}` on
    spec made it refuse the CRD ("no such key: parallelism"); a `spec: {}` that is sent is defaulted section by
    section before the rules run (test_cel.py::test_defaults_alone_pass_every_rule)."""
    assert "default" not in SPEC_SCHEMA and SPEC_SCHEMA["x-kubernetes-validations"]


def test_defaults_validate_against_their_schema():
    """The API server rejects a CRD whose defaults (after defaulting) do not validate."""
    problems = []
    for path, node in walk(ROOT_SCHEMA):
        if "default" in node:
            value = crdmod.apply_schema_defaults(node["default"], node)
            for err in jsonschema.Draft4Validator(node).iter_errors(value):
                problems.append(f"{path}: default {node['default']!r}: {err.message}")
    assert problems == []


# ---------------------------------------------------------------------- defaulting
def _examples() -> list[tuple[str, dict[str, Any]]]:
    out = [("empty", {})]
    for f in EXAMPLES:
        for i, doc in enumerate(d for d in yamlio.load_all(f.read_text()) if d):
            out.append((f"{f.stem}-{i}" if i else f.stem, doc.get("spec") or {}))
    return out


@pytest.mark.parametrize("name, raw", _examples(), ids=[n for n, _ in _examples()])
def test_apiserver_defaulting_equals_pydantic(name, raw):
    """What the cluster stores after defaulting is what `LlamaPretrain.model_validate` fills in."""
    served = crdmod.apply_schema_defaults(raw, SPEC_SCHEMA)
    parsed = LlamaPretrain.model_validate({"spec": raw}).spec.dump()
    assert drop_empty(served) == drop_empty(parsed)


def test_apply_schema_defaults_replaces_nulls_and_keeps_values():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "default": 1},
        "s": {"type": "object", "default": {}, "properties": {"b": {"type": "string", "default": "x"}}},
        "l": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "integer", "default": 7}}}},
    }}
    assert crdmod.apply_schema_defaults({"a": None, "l": [{}, {"c": 2}]}, schema) == {
        "a": 1, "s": {"b": "x"}, "l": [{"c": 7}, {"c": 2}]}
    assert crdmod.apply_schema_defaults({"a": 5, "s": {"b": "y"}}, schema) == {"a": 5, "s": {"b": "y"}}


# ------------------------------------------------------------------ printer columns
@pytest.mark.parametrize("column", VERSION["additionalPrinterColumns"], ids=lambda c: c["name"])
def test_printer_column_points_at_a_real_field(column):
    node = node_at(ROOT_SCHEMA, column["jsonPath"])
    if column["jsonPath"] == ".metadata.creationTimestamp":
        assert column["type"] == "date"  # server-set metadata is not in the schema
        return
    assert column["jsonPath"].startswith(".status."), "columns show observed state"
    assert node is not None, f"{column['jsonPath']} is not a field of the status schema"
    assert node["type"] == column["type"], f"{column['name']}: column type {column['type']} vs field {node['type']}"


def test_printer_columns_names_and_wide_only():
    cols = VERSION["additionalPrinterColumns"]
    assert [c["name"] for c in cols if not c.get("priority")] == [
        "Phase", "Progress", "Loss", "Tok/s", "MFU", "Ckpt", "Restarts", "Age"]
    assert [c["name"] for c in cols if c.get("priority") == 1] == ["Nodes", "Attempt", "ETA", "Message"]


# ------------------------------------------------------------------------ CEL rules
def test_cel_rules_are_attached_to_spec():
    got = SPEC_SCHEMA["x-kubernetes-validations"]
    assert got == [{"rule": r.rule, "message": r.message, "fieldPath": r.field_path, "reason": "FieldValueInvalid"}
                   for r in CEL_RULES]
    assert all("x-kubernetes-validations" not in n for p, n in walk(ROOT_SCHEMA) if p != ".spec")


@pytest.mark.parametrize("rule", CEL_RULES, ids=lambda r: r.id)
def test_cel_field_path_exists(rule):
    """The API server rejects a fieldPath that does not name a field of the schema."""
    assert re.fullmatch(r"(\.[a-zA-Z0-9]+)+", rule.field_path), rule.field_path
    assert node_at(SPEC_SCHEMA, rule.field_path) is not None, f"{rule.id}: {rule.field_path} is not in spec"


def test_cel_fields_exist_in_the_schema():
    """Every `self.a.b` a rule reads is a field of the spec schema (a typo would never fire); a list macro's
    variable (`self.a.all(m, has(m.b))`) reads fields of the list's items."""
    macro = r"\.(all|exists|exists_one|map|filter)\((\w+),"
    for r in CEL_RULES:
        for ref in re.findall(r"self((?:\.[a-zA-Z][a-zA-Z0-9]*)+)", r.rule):
            ref = re.sub(r"\.(all|exists|exists_one|map|filter)$", "", ref)
            assert node_at(SPEC_SCHEMA, ref) is not None, f"{r.id}: {ref} is not a spec field"
        for m in re.finditer(r"self((?:\.[a-zA-Z][a-zA-Z0-9]*)+)" + macro, r.rule):
            items = node_at(SPEC_SCHEMA, m.group(1))["items"]
            for field in re.findall(rf"\b{m.group(3)}\.([a-zA-Z][a-zA-Z0-9]*)", r.rule):
                assert field in items["properties"], f"{r.id}: {m.group(1)}[].{field} is not a field"


# ---------------------------------------------------------------- kubernetes-validate
LATEST = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())


@pytest.mark.parametrize(
    "kube, target",
    [("1.27", "1.27"), ("1.28", None), ("1.35", None), (LATEST, None)],
    ids=["1.27-variant", "1.28", "1.35", "latest"],
)
def test_kubernetes_validate_accepts_the_crd(kube, target):
    obj = crdmod.crd(kubernetes_version=target) if target else yamlio.load(COMMITTED.read_text())
    assert kubernetes_validate.validate(obj, kube, strict=True) == kube


def test_1_27_does_not_know_field_path_and_reason():
    """Why `--kubernetes-version 1.27` exists: 1.27's ValidationRule has neither field."""
    with pytest.raises(kubernetes_validate.ValidationError, match="fieldPath"):
        kubernetes_validate.validate(CRD, "1.27", strict=True)
    rules = crdmod.crd(kubernetes_version="1.27")["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]["x-kubernetes-validations"]
    assert rules == [{"rule": r.rule, "message": r.message} for r in CEL_RULES]


# ------------------------------------------------------------- the converter itself
class _Probe(_Base):
    """A probe model."""

    ratio: float = Field(default=0.5, gt=0, lt=1)
    """A ratio."""
    maybe: int | None = Field(default=None, ge=3)
    """An optional bounded int."""
    mode: Literal["a", "b"] = "a"
    """A closed choice."""
    labels: dict[str, str] = Field(default_factory=dict)
    """A string map."""
    anything: dict[str, Any] | None = None
    """A free-form object."""


class _Bad(_Base):
    """Not structural."""

    either: int | str = 1
    """Two types."""


def test_converter_shapes():
    raw = _Probe.model_json_schema(by_alias=True)
    got = crdmod._structural(raw, raw.get("$defs", {}), "_Probe")
    crdmod._apply_defaults(got, _Probe)
    p = got["properties"]
    assert p["ratio"] == {"description": "A ratio.", "type": "number", "default": 0.5, "minimum": 0,
                          "exclusiveMinimum": True, "maximum": 1, "exclusiveMaximum": True}
    assert p["maybe"] == {"description": "An optional bounded int.", "type": "integer", "minimum": 3}
    assert p["mode"] == {"description": "A closed choice.", "type": "string", "enum": ["a", "b"], "default": "a"}
    assert p["labels"] == {"description": "A string map.", "type": "object", "additionalProperties": {"type": "string"}}
    assert p["anything"] == {"description": "A free-form object.", "type": "object",
                             "x-kubernetes-preserve-unknown-fields": True}


def test_converter_rejects_unions():
    raw = _Bad.model_json_schema(by_alias=True)
    with pytest.raises(ValueError, match=r"_Bad\.either: anyOf with 2 non-null options"):
        crdmod._structural(raw, {}, "_Bad")


@pytest.mark.parametrize(
    "argv, rc, has_field_path",
    [(["crd"], 0, True), (["crd", "--kubernetes-version", "1.27"], 0, False),
     (["crd", "--kubernetes-version", "1.35"], 0, True), (["crd", "--kubernetes-version", "latest"], 2, None)],
    ids=["default", "1.27", "1.35", "not-a-version"],
)
def test_cli_crd_kubernetes_version(argv, rc, has_field_path, capsys):
    from kubetitan.cli import main

    assert main(argv) == rc
    out, err = capsys.readouterr()
    if rc:
        assert "--kubernetes-version" in err and "MAJOR.MINOR" in err
    else:
        obj = yamlio.load(out)
        assert kubernetes_validate.validate(obj, "1.27" if not has_field_path else "1.35", strict=True)
        assert ("fieldPath" in out) == has_field_path
