"""The API double as strict as kube-apiserver 1.32 on two points the operator depends on (issue 30):

- a JSON body with NaN/Infinity (or a number beyond float64) is refused with 400, as Go's decoder refuses it,
  instead of being stored (Python's ``json`` reads it);
- CRD validation ratcheting: a CEL rule is checked again as soon as anything under its ``self`` changed, whatever
  its ``fieldPath`` names; only an unchanged ``self`` (deep-equal to the old value) is exempt; transition rules
  (``oldSelf``) run where an old value correlates and are never ratcheted.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import requests

from kmockx import validation
from kmockx.harness import NS, Cluster, cpu_spec, lpt

LPTS = f"/apis/kubetitan.io/v1alpha1/namespaces/{NS}/llamapretrains"
pytestmark = pytest.mark.xdist_group("apiserver")


def send(c: Cluster, method: str, path: str, text: str, ctype: str = "application/json",
         **params: str) -> requests.Response:
    return requests.request(method, c.url + path, data=text.encode(), params=params,
                            headers={"Content-Type": ctype}, timeout=10)


# ------------------------------------------------------------------------------------------------ NaN / Infinity
@pytest.mark.parametrize(("text", "go_error"), [
    ('{"a": NaN}', "invalid character 'N' looking for beginning of value"),
    ('{"a": Infinity}', "invalid character 'I' looking for beginning of value"),
    ('{"a": -Infinity}', "invalid character 'I' in numeric literal"),
    ('{"a": 1e400}', "json: cannot unmarshal number 1e400 into Go value of type float64"),
    ('{"a": [1, {"b": 2.5}], "c": 1e308}', None),
    ('{"a": "NaN", "b": "Infinity"}', None),
], ids=["nan", "infinity", "minus-infinity", "beyond-float64", "finite-numbers", "strings"])
def test_go_json_error_matches_gos_decoder(text: str, go_error: str | None) -> None:
    assert validation.go_json_error(text) == go_error


def test_a_create_with_infinity_is_refused_400_and_nothing_is_stored(c: Cluster) -> None:
    obj = lpt("inf-create", cpu_spec())
    obj["spec"]["training"]["steps"] = math.inf
    text = json.dumps(obj)
    assert "Infinity" in text  # Python writes it; Go's decoder refuses it
    r = send(c, "POST", LPTS, text)
    assert r.status_code == 400, r.text
    s = r.json()
    assert s["kind"] == "Status" and s["reason"] == "BadRequest" and s["code"] == 400
    assert s["message"] == ("the object provided is unrecognized (must be of type LlamaPretrain): couldn't get "
                            "version/kind; json parse error: invalid character 'I' looking for beginning of value "
                            f"({text[:30]} ...)")
    assert c.lpt(NS, "inf-create") is None


def test_a_status_patch_with_infinity_or_nan_is_refused_400_and_the_status_kept(c: Cluster) -> None:
    c.apply(lpt("inf-status", cpu_spec()))
    path = f"{LPTS}/inf-status/status"
    ok = send(c, "PATCH", path, json.dumps({"status": {"training": {"step": 3}}}), "application/merge-patch+json")
    assert ok.status_code == 200, ok.text
    bad = json.dumps({"status": {"training": {"tokensPerSecondPerGpu": math.inf, "loss": math.nan}}})
    r = send(c, "PATCH", path, bad, "application/merge-patch+json")
    assert (r.status_code, r.json()["reason"], r.json()["message"]) == (400, "BadRequest", "Invalid JSON Patch")
    r = send(c, "PATCH", path, bad, "application/merge-patch+json", fieldValidation="Strict")
    assert r.status_code == 400 and r.json()["message"] == (
        "error decoding patch: invalid character 'I' looking for beginning of value")
    r = send(c, "PATCH", path, '[{"op": "replace", "path": "/status/training/step", "value": -Infinity}]',
             "application/json-patch+json")
    assert r.status_code == 400 and r.json()["message"] == "invalid character 'I' in numeric literal"
    assert c.status(NS, "inf-status")["training"] == {"step": 3}


# ------------------------------------------------------------------------------------------------ ratcheting, CEL
def test_a_spec_rule_is_checked_when_a_field_it_reads_changed_not_only_its_field_path(c: Cluster) -> None:
    """``self.runPolicy.maxBackoffSeconds >= self.runPolicy.backoffSeconds`` sits on ``spec`` with fieldPath
    ``.runPolicy.maxBackoffSeconds``: raising backoffSeconds alone (maxBackoffSeconds unchanged) breaks it, and the
    API server answers 422 (the rule's self, spec, changed)."""
    c.apply(lpt("backoff", cpu_spec(backoffSeconds=10, maxBackoffSeconds=60)))
    version = c.lpt(NS, "backoff")["metadata"]["resourceVersion"]
    r = send(c, "PATCH", f"{LPTS}/backoff", json.dumps({"spec": {"runPolicy": {"backoffSeconds": 120}}}),
             "application/merge-patch+json")
    assert r.status_code == 422, r.text
    assert r.json()["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": "spec.runPolicy.maxBackoffSeconds",
        "message": 'Invalid value: "object": runPolicy.maxBackoffSeconds must be at least runPolicy.backoffSeconds'}]
    stored = c.lpt(NS, "backoff")
    assert stored["spec"]["runPolicy"]["backoffSeconds"] == 10 and stored["metadata"]["resourceVersion"] == version


def test_an_object_stored_before_a_rule_is_exempt_only_while_the_rules_self_is_unchanged(c: Cluster) -> None:
    spec = cpu_spec(backoffSeconds=120, maxBackoffSeconds=60)  # breaks the rule: stored past the schema
    c.apply(lpt("legacy", spec), admit=False)
    path = f"{LPTS}/legacy"
    ok = send(c, "PATCH", f"{path}/status", json.dumps({"status": {"phase": "Running"}}),
              "application/merge-patch+json")
    assert ok.status_code == 200, ok.text  # spec untouched: ratcheted
    ok = send(c, "PATCH", path, json.dumps({"metadata": {"labels": {"team": "a"}}}), "application/merge-patch+json")
    assert ok.status_code == 200, ok.text
    r = send(c, "PATCH", path, json.dumps({"spec": {"training": {"steps": 200}}}), "application/merge-patch+json")
    assert r.status_code == 422, r.text  # another field of spec changed: every rule on spec is checked again
    assert [x["field"] for x in r.json()["details"]["causes"]] == ["spec.runPolicy.maxBackoffSeconds"]


def _schema() -> validation.StructuralSchema:
    item = {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}},
            "x-kubernetes-validations": [{"rule": "self.v >= oldSelf.v", "message": "v may not decrease"}]}
    return validation.StructuralSchema({"type": "object", "properties": {
        "spec": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer", "minimum": 0},
            "keyed": {"type": "array", "items": item, "x-kubernetes-list-type": "map",
                      "x-kubernetes-list-map-keys": ["name"]},
            "plain": {"type": "array", "items": item},
        }, "x-kubernetes-validations": [
            {"rule": "self.a <= self.b", "fieldPath": ".b", "message": "a may not exceed b"},
            {"rule": "self.b >= oldSelf.b", "message": "b may not decrease"},
            {"rule": "self.c != oldSelf.c || self.c != 7", "message": "c may not stay 7"},
        ]},
        "status": {"type": "object", "properties": {"n": {"type": "integer"}}},
    }})


BASE = {"a": 1, "b": 5, "c": 0, "keyed": [{"name": "x", "v": 3}], "plain": [{"name": "x", "v": 3}]}
RATCHET = [
    # (id, old spec or None for a create, new spec, old status, new status, the causes' (field, message))
    ("create-runs-no-transition-rule", None, {**BASE, "b": 0, "a": 0}, {}, {}, []),
    ("rule-reads-a-changed-field-not-its-field-path", BASE, {**BASE, "a": 9}, {}, {},
     [("spec.b", "a may not exceed b")]),
    ("unchanged-self-is-exempt", {**BASE, "a": 9}, {**BASE, "a": 9}, {"n": 1}, {"n": 2}, []),
    ("a-sibling-change-ends-the-exemption", {**BASE, "a": 9}, {**BASE, "a": 9, "c": 1}, {}, {},
     [("spec.b", "a may not exceed b")]),
    ("openapi-error-on-an-unchanged-field-is-exempt", {**BASE, "c": -1}, {**BASE, "c": -1, "a": 2}, {}, {}, []),
    ("openapi-error-on-a-changed-field-is-not", {**BASE, "c": -1}, {**BASE, "c": -2}, {}, {},
     [("spec.c", "Invalid value: -2: spec.c in body should be greater than or equal to 0")]),
    ("transition-rule-breaks", BASE, {**BASE, "b": 4, "a": 0}, {}, {}, [("spec", "b may not decrease")]),
    ("transition-rule-is-never-ratcheted", {**BASE, "c": 7}, {**BASE, "c": 7}, {}, {"n": 1},
     [("spec", "c may not stay 7")]),
    ("transition-rule-in-a-map-list-item-by-key", BASE,
     {**BASE, "keyed": [{"name": "y", "v": 0}, {"name": "x", "v": 2}]}, {}, {},
     [("spec.keyed[1]", "v may not decrease")]),
    ("no-oldSelf-in-a-plain-list-item", BASE, {**BASE, "plain": [{"name": "x", "v": 2}]}, {}, {}, []),
]


@pytest.mark.parametrize(("old", "new", "old_status", "new_status", "want"), [r[1:] for r in RATCHET],
                         ids=[r[0] for r in RATCHET])
def test_ratcheting_follows_the_api_server(old: dict[str, Any] | None, new: dict[str, Any],
                                           old_status: dict[str, Any], new_status: dict[str, Any],
                                           want: list[tuple[str, str]]) -> None:
    obj = {"spec": copy.deepcopy(new), "status": new_status}
    prev = None if old is None else {"spec": copy.deepcopy(old), "status": old_status}
    causes, _ = _schema().apply(obj, prev)
    got = [(x.field, x.message.split(": ", 2)[-1] if x.message.startswith('Invalid value: "object"') else x.message)
           for x in causes]
    assert got == [(f, m) for f, m in want], [x.render() for x in causes]

