"""The CRD's two API-server layers agree with the Python validator, on the same corpus.

For every example and every entry of tests/api/invalid_specs.yaml this plays the API server
with the committed CRD: OpenAPI validation of the raw spec (with kubectl's default strict field
validation, so unknown fields are errors), structural defaulting, then the spec's
``x-kubernetes-validations`` evaluated by a CEL library (cel-python). Then:

- the OpenAPI layer rejects exactly the entries whose Python errors are ``schema`` errors;
- each CEL rule fails on exactly the entries where the Python validator reports the rule
  with the same id; rules without a CEL twin never make CEL fail.

cel-python stands in for cel-go: the rules keep to the common subset (``has``, ternaries,
integer arithmetic, string equality), and values are typed from the schema (``number`` ->
double, ``integer`` -> int), as the API server types them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
from celpy import celtypes

from support.paths import EXAMPLES, load_example
from support.specs import make_lpt
from support import yamlio
from kubetitan_core import crd as crdmod
from kubetitan_core.validation import CEL_RULES, parse

ROOT = Path(__file__).resolve().parents[2]
CORPUS = yamlio.load((Path(__file__).parent / "invalid_specs.yaml").read_text())
CRD = yamlio.load((ROOT / "crds" / crdmod.CRD_FILE).read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
RULES = SPEC_SCHEMA["x-kubernetes-validations"]
CEL_IDS = {r.id for r in CEL_RULES}
RULE_ID = {r.rule: r.id for r in CEL_RULES}

_ENV = celpy.Environment()
PROGRAMS = {RULE_ID[r["rule"]]: _ENV.program(_ENV.compile(r["rule"])) for r in RULES}


# ------------------------------------------------------------------- the API server
def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """kubectl's strict field validation: unknown fields of a closed object are errors."""
    s = copy.deepcopy(schema)

    def close(node: dict[str, Any]) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            close(child)
        if isinstance(node.get("items"), dict):
            close(node["items"])

    close(s)
    return s


OPENAPI = jsonschema.Draft4Validator(_strict(SPEC_SCHEMA))  # OpenAPI v3 bounds are draft-4 style


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """A JSON value as the API server hands it to CEL, typed by the schema."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return celpy.json_to_cel(value)
    kind = schema.get("type")
    if kind == "object":
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return celtypes.MapType({
            celtypes.StringType(k): to_cel(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
            for k, v in value.items()
        })
    if kind == "array":
        return celtypes.ListType([to_cel(v, schema.get("items", {})) for v in value])
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "string":
        return celtypes.StringType(value)
    return celpy.json_to_cel(value)


def cel_failures(spec: dict[str, Any]) -> dict[str, str]:
    """Rule id -> outcome for every rule that does not evaluate to true on the spec."""
    activation = {"self": to_cel(spec, SPEC_SCHEMA)}
    out = {}
    for rule_id, program in PROGRAMS.items():
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError as e:  # cel-go reports an evaluation error as a failed rule too
            result = e
        if result is not celtypes.BoolType(True) and result != celtypes.BoolType(True):
            out[rule_id] = "false" if isinstance(result, celtypes.BoolType) else f"error: {result}"
    return out


def api_server(raw_spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(OpenAPI errors, CEL failures) the API server reports for a spec (memoised)."""
    key = json.dumps(raw_spec, sort_keys=True)
    if key not in _SEEN:
        _SEEN[key] = _api_server(raw_spec)
    return copy.deepcopy(_SEEN[key])


_SEEN: dict[str, tuple[list[str], dict[str, str]]] = {}


def _api_server(raw_spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(OpenAPI errors, CEL failures) the API server reports for a spec.

    Like apiextensions-apiserver, CEL is skipped when a value has the wrong type (a
    "blocking" error); other schema errors (bounds, enums) do not stop it.
    """
    schema_errors = list(OPENAPI.iter_errors(raw_spec))
    if any(e.validator == "type" for e in schema_errors):
        return [e.message for e in schema_errors], {}
    defaulted = crdmod.apply_schema_defaults(raw_spec, SPEC_SCHEMA)
    return [e.message for e in schema_errors], cel_failures(defaulted)


def python_rules(raw_spec: dict[str, Any]) -> set[str]:
    _, errors = parse(make_lpt(raw_spec))
    return {e.rule for e in errors}


# --------------------------------------------------------------------------- tests
def test_every_rule_compiles_and_is_attached():
    assert sorted(PROGRAMS) == sorted(CEL_IDS)
    assert len(RULES) == len(CEL_RULES)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_pass_every_layer(path):
    raw = load_example(path).get("spec") or {}
    schema_errors, failures = api_server(raw)
    assert schema_errors == []
    assert failures == {}
    assert python_rules(raw) == set()


def test_defaults_alone_pass_every_rule():
    assert api_server({}) == ([], {})


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_cel_and_openapi_agree_with_python(case):
    raw = case["spec"]
    py = python_rules(raw)
    assert py, f"{case['name']}: the Python validator accepts it; it does not belong in the corpus"
    schema_errors, failures = api_server(raw)
    assert bool(schema_errors) == ("schema" in py), (
        f"OpenAPI says {schema_errors or 'valid'}, Python rules {sorted(py)}")
    assert set(failures) == py & CEL_IDS, (
        f"CEL failures {failures} vs Python rules with a CEL twin {sorted(py & CEL_IDS)}")


def test_every_cel_rule_fails_somewhere_in_the_corpus():
    """Keeps the agreement test honest: each rule is shown to fire at least once."""
    fired = set()
    for case in CORPUS:
        fired |= set(api_server(case["spec"])[1])
    assert fired == CEL_IDS


@pytest.mark.parametrize(
    "spec, want",
    [
        ({"resources": {"processesPerNode": 3, "gpusPerNode": 0, "nodes": 2},
          "parallelism": {"dataParallelShardDegree": 3, "tensorParallelDegree": 2}}, {}),
        ({"resources": {"gpusPerNode": 0, "nodes": 3}, "parallelism": {"dataParallelShardDegree": 3}}, {}),
        ({"resources": {"gpusPerNode": 0, "nodes": 3}, "parallelism": {"dataParallelShardDegree": 2}},
         {"parallelism.product": "false"}),
        ({"parallelism": {"contextParallelDegree": 4}, "training": {"seqLen": 8196}},
         {"parallelism.context-seq-len": "false"}),
        ({"parallelism": {"contextParallelDegree": 3}, "training": {"seqLen": 8200}},
         {"parallelism.context-seq-len": "false", "parallelism.product": "false"}),
        ({"model": {"flavor": "custom", "custom": {"dim": 256, "nLayers": 2, "nHeads": 4}}}, {}),
        ({"checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}, "hostPath": "/x"}}},
         {"checkpoint.one-storage": "false"}),
        ({"runPolicy": {"maxRestarts": 0}, "checkpoint": {"enabled": False}}, {}),
    ],
    ids=["explicit-procs-cpu", "cpu-one-per-node", "cpu-mismatch", "cp-seq-len", "cp-and-product", "custom-ok",
         "pvc-and-hostpath", "no-restarts-no-checkpoints"],
)
def test_cel_rules_on_hand_written_specs(spec, want):
    schema_errors, failures = api_server(spec)
    assert schema_errors == []
    assert failures == want
    assert python_rules(spec) & CEL_IDS == set(want)


@pytest.mark.parametrize(
    "spec, want",
    [
        ({"resources": {"nodes": "many"}, "parallelism": {"dataParallelShardDegree": 8}}, {}),
        ({"resources": {"nodes": 0}, "parallelism": {"dataParallelShardDegree": 8}}, {"parallelism.product": "false"}),
    ],
    ids=["type-error-blocks-cel", "bound-error-does-not"],
)
def test_type_errors_block_cel_like_the_api_server(spec, want):
    schema_errors, failures = api_server(spec)
    assert len(schema_errors) == 1
    assert failures == want


def test_numbers_reach_cel_as_doubles():
    """`learningRate: 1` is an int in YAML but a double in CEL, as on the API server."""
    v = to_cel({"training": {"learningRate": 1, "steps": 5}}, SPEC_SCHEMA)
    assert isinstance(v["training"]["learningRate"], celtypes.DoubleType)
    assert isinstance(v["training"]["steps"], celtypes.IntType)
