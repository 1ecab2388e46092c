"""The API double's fast paths (session 15) answer exactly what the slow ones did.

- ``kmockx.schemacheck``: built-in objects are pre-checked by a function compiled from the Kubernetes schema; it must
  agree with jsonschema on every object (a rendered trainer pod and hundreds of broken variants of it; small schemas
  for each keyword's edge cases) and refuse to compile any keyword it does not model.
- the store's index by resource: GET, list (namespace, label selector), delete and re-create stay consistent.
- CRD schemas (and their compiled CEL programs) belong to one registration of the CRD: an update of the CRD takes
  effect at once (nothing cached from the old schema is used); the rules are compiled when the CRD is registered,
  and a rule that does not compile still fails where it is evaluated.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import requests
from referencing import Registry

from kmockx import schemacheck, validation
from kmockx.harness import CRDS, Cluster
from kubetitan import plan
from kubetitan_core import validation as spec_validation
from support.specs import NS, cpu_spec, lpt

pytestmark = pytest.mark.xdist_group("apiserver")
V = jsonschema.Draft202012Validator


def _trainer_pod() -> dict[str, Any]:
    """A pod exactly as the operator renders it (every field kubetitan sends), in namespace ``NS``."""
    run, errors = spec_validation.parse(lpt("big", cpu_spec(nodes=2)))
    assert run is not None and not errors
    pod = next(c for c in plan.attempt_children(run, 0) if c["kind"] == "Pod")
    pod["metadata"]["namespace"] = NS
    return pod


def _paths(x: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*at, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*at, i))


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(obj)
    parent = out
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return out


def _mutations(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Broken (and some still valid) variants of ``pod``: each value replaced by null, by another JSON type, by an
    unknown string (enums), an integral float for integers, an unknown key added to each object, each key removed."""
    for path in _paths(pod):
        if not path:
            continue
        cur = copy.deepcopy(pod)
        for p in path:
            cur = cur[p]
        others = {str: [1, True], bool: [1, "true"], int: ["1", True, float(cur) if type(cur) is int else 0.5],
                  float: ["1"], dict: [[], "x"], list: [{}, "x"]}[type(cur)]
        for value in [None, *others, "Bogus-Value"]:
            yield f"{path} = {value!r}", _set(pod, path, value)
        if isinstance(cur, dict):
            yield f"{path} + unknown key", _set(pod, path, {**cur, "bogusField": 1})
        if isinstance(path[-1], str):
            parent = _set(pod, path, None)
            for p in path[:-1]:
                parent = parent[p]
            del parent[path[-1]]
            yield f"{path} removed", _set(pod, path[:-1], parent) if len(path) > 1 else parent


def test_the_compiled_check_agrees_with_jsonschema_on_a_pod_and_every_mutation_of_it() -> None:
    validator = validation._builtin_validator("Pod", "v1")
    check = validation._builtin_check("Pod", "v1")
    assert check is not None, "the Pod schema no longer compiles: every pod create falls back to jsonschema"
    pod = _trainer_pod()
    assert check(pod) and validator.is_valid(pod)
    verdicts = {True: 0, False: 0}
    for what, variant in _mutations(pod):
        want = validator.is_valid(variant)
        assert check(variant) == want, f"{what}: jsonschema says {'valid' if want else 'invalid'}"
        verdicts[want] += 1
    assert verdicts[False] > 300 and verdicts[True] > 20, verdicts  # both answers were exercised


@pytest.mark.parametrize(("kind", "api_version"), [("Pod", "v1"), ("ConfigMap", "v1"), ("Service", "v1"),
                                                   ("Namespace", "v1"), ("Node", "v1"), ("Secret", "v1"),
                                                   ("Event", "v1"), ("Event", "events.k8s.io/v1"),
                                                   ("Lease", "coordination.k8s.io/v1")])
def test_the_kinds_kubetitan_writes_compile(kind: str, api_version: str) -> None:
    assert validation._builtin_check(kind, api_version) is not None


def test_an_invalid_pod_still_gets_jsonschemas_errors() -> None:
    pod = _trainer_pod()
    pod["spec"]["containers"][0]["bogus"] = 1
    pod["spec"]["restartPolicy"] = 7
    causes, unknown = validation.builtin_errors(pod)
    assert unknown == ["spec.containers[0].bogus"]
    assert [c.render() for c in causes] == ["spec.restartPolicy: Invalid value: 7: 7 is not of type 'string', 'null'"]


SEMANTICS = [  # (schema, instance): compiled and jsonschema must agree (each keyword's edge cases)
    ({"type": "integer"}, 1.0), ({"type": "integer"}, 1.5), ({"type": "integer"}, True), ({"type": "number"}, False),
    ({"type": ["string", "null"]}, None), ({"type": ["string", "null"]}, 0), ({"type": "object"}, []),
    ({"type": ["string", "null"], "enum": ["v1"]}, None), ({"enum": ["a"]}, "a"), ({"enum": ["a"]}, "b"),
    ({"oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]}, None),
    ({"oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]}, 3),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 2.0), ({"allOf": [{"type": "integer"}, False]}, 1),
    ({"not": {"type": "string"}}, "x"), ({"properties": {"a": {"type": "string"}}}, {"a": 1}),
    ({"properties": {"a": {"type": "string"}}}, "not an object"),
    ({"properties": {"a": True}, "additionalProperties": False}, {"a": 1, "b": 2}),
    ({"additionalProperties": {"type": "string"}}, {"b": 2}), ({"additionalProperties": False}, {}),
    ({"required": ["a"]}, {"b": 1}), ({"required": ["a"]}, []), ({"items": {"type": "string"}}, ["a", 1]),
    ({"items": {"type": "string"}}, {"0": 1}), ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "x"),
    ({"$defs": {"t": {"properties": {"c": {"$ref": "#/$defs/t"}}, "additionalProperties": False}},
      "$ref": "#/$defs/t"}, {"c": {"c": {"d": 1}}}),
    ({"format": "int32", "description": "annotations only", "x-kubernetes-list-type": "map"}, "x"),
    (True, None), (False, None),
]


@pytest.mark.parametrize(("schema", "instance"), SEMANTICS, ids=[json.dumps(r) for r in SEMANTICS])
def test_each_keyword_means_what_jsonschema_means(schema: Any, instance: Any) -> None:
    check = schemacheck.compile_check(schema, Registry(), V)
    assert check(instance) == V(schema).is_valid(instance)


UNSUPPORTED = [
    {"pattern": "^a"}, {"minimum": 1}, {"maxLength": 3}, {"enum": [1, "a"]}, {"const": "a"}, {"items": [{}]},
    {"patternProperties": {"^a": {}}}, {"properties": {"a": {"$id": "other"}}}, {"$dynamicRef": "#x"},
    {"properties": {"a": {"$anchor": "x"}}}, {"type": "decimal"}, {"unevaluatedProperties": False},
]


@pytest.mark.parametrize("schema", UNSUPPORTED, ids=[json.dumps(s) for s in UNSUPPORTED])
def test_a_keyword_not_modelled_is_refused_so_jsonschema_decides(schema: dict[str, Any]) -> None:
    with pytest.raises(schemacheck.Unsupported):
        schemacheck.compile_check(schema, Registry(), V)


def test_formats_are_refused_when_the_validator_checks_them() -> None:
    with pytest.raises(schemacheck.Unsupported):
        schemacheck.compile_check({"format": "date-time"}, Registry(), V, format_checker=V.FORMAT_CHECKER)


# ------------------------------------------------------------------------------------------------ the store's index
@pytest.fixture(scope="module")
def c():
    with Cluster(namespaces=("other",)) as cluster:
        yield cluster


def _pod(name: str, ns: str = NS, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def _names(r: requests.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [o["metadata"]["name"] for o in r.json()["items"]]


def test_reads_by_resource_namespace_name_and_selector_after_deletes_and_recreates(c: Cluster) -> None:
    assert c.k is not None
    for name, ns, team in (("ix-a", NS, "x"), ("ix-b", NS, "y"), ("ix-c", "other", "x")):
        c.call(c.k.put("v1/pods", _pod(name, ns, team=team)))
    c.call(c.k.put("v1/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ix-a",
                                                                                            "namespace": NS}}))
    pods = f"{c.url}/api/v1/namespaces/{NS}/pods"
    assert [n for n in _names(requests.get(pods, timeout=10)) if n.startswith("ix-")] == ["ix-a", "ix-b"]
    assert _names(requests.get(f"{c.url}/api/v1/pods", params={"labelSelector": "team=x"}, timeout=10)) == \
        ["ix-a", "ix-c"]
    assert [o["metadata"]["name"] for o in c.list("v1/pods", "other")] == ["ix-c"]
    assert requests.get(f"{pods}/ix-c", timeout=10).status_code == 404  # another namespace's
    assert requests.get(f"{c.url}/api/v1/namespaces/{NS}/configmaps/ix-b", timeout=10).status_code == 404
    c.delete("v1/pods", NS, "ix-a")
    assert requests.get(f"{pods}/ix-a", timeout=10).status_code == 404
    assert c.get("v1/pods", NS, "ix-a") is None and c.get("v1/configmaps", NS, "ix-a") is not None
    assert [n for n in _names(requests.get(pods, timeout=10)) if n.startswith("ix-")] == ["ix-b"]
    again = c.call(c.k.put("v1/pods", _pod("ix-a", NS, team="z")))
    got = requests.get(f"{pods}/ix-a", timeout=10).json()
    assert got["metadata"]["uid"] == again["metadata"]["uid"] and got["metadata"]["labels"] == {"team": "z"}
    assert [n for n in _names(requests.get(pods, timeout=10)) if n.startswith("ix-")] == ["ix-a", "ix-b"]


def test_handed_out_objects_are_copies(c: Cluster) -> None:
    assert c.k is not None
    c.call(c.k.put("v1/pods", _pod("ix-copy")))
    got = c.get("v1/pods", NS, "ix-copy")
    assert got is not None
    got["metadata"]["labels"]["changed"] = "yes"
    c.list("v1/pods", NS)[0]["metadata"]["name"] = "changed"
    assert "changed" not in c.get("v1/pods", NS, "ix-copy")["metadata"]["labels"]
    assert all(o["metadata"]["name"] != "changed" for o in c.list("v1/pods", NS))


# ------------------------------------------------------------------------------------------------ CRD updates
def _crd(maximum: int, rule: str | None = None) -> dict[str, Any]:
    n: dict[str, Any] = {"type": "integer", "maximum": maximum}
    spec: dict[str, Any] = {"type": "object", "properties": {"n": n, "m": {"type": "integer"}}}
    if rule:
        spec["x-kubernetes-validations"] = [{"rule": rule, "message": f"needs {rule}"}]
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {"group": "example.com", "scope": "Namespaced",
                     "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {"spec": spec}}}}]}}


def _widget(name: str, n: int, m: int = 0) -> dict[str, Any]:
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": name, "namespace": NS},
            "spec": {"n": n, "m": m}}


def test_a_crd_update_replaces_its_schema_and_cel_rules_at_once(c: Cluster) -> None:
    assert c.k is not None
    widgets = f"{c.url}/apis/example.com/v1/namespaces/{NS}/widgets"
    c.call(c.k.put(CRDS, _crd(maximum=5, rule="self.n >= self.m")))
    assert requests.post(widgets, json=_widget("w1", 4), timeout=10).status_code == 201
    r = requests.post(widgets, json=_widget("w2", 1, m=2), timeout=10)
    assert r.status_code == 422 and "needs self.n >= self.m" in r.text
    c.patch(CRDS, None, "widgets.example.com", {"spec": _crd(maximum=3, rule="self.n <= self.m")["spec"]})
    r = requests.post(widgets, json=_widget("w3", 4, m=9), timeout=10)
    assert r.status_code == 422 and "should be less than or equal to 3" in r.text  # the new bound
    r = requests.post(widgets, json=_widget("w4", 2, m=1), timeout=10)
    assert r.status_code == 422 and "needs self.n <= self.m" in r.text  # the new rule, not the old one
    assert requests.post(widgets, json=_widget("w5", 1, m=2), timeout=10).status_code == 201


def test_cel_rules_are_compiled_when_the_crd_is_registered_and_a_broken_one_still_fails_at_admission(
        c: Cluster) -> None:
    assert c.k is not None
    crd = _crd(maximum=9, rule="self.n >= self.m")
    crd["spec"]["names"] = {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"}
    crd["metadata"]["name"] = "gadgets.example.com"
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"].append({"rule": "self.n >>> 1", "message": "never compiles"})
    c.call(c.k.put(CRDS, crd))
    schema = next(t.schema for r, t in c.k.types.items() if r.plural == "gadgets")
    assert set(schema._cel) == {"self.n >= self.m"}  # compiled at registration; the broken one is not
    obj = {**_widget("g1", 1, m=0), "apiVersion": "example.com/v1", "kind": "Gadget"}
    r = requests.post(f"{c.url}/apis/example.com/v1/namespaces/{NS}/gadgets", json=obj, timeout=10)
    assert r.status_code == 422 and "self.n >>> 1" in r.text  # reported where it is evaluated, as before
