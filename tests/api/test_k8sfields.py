"""The env-var fast path of kubetitan_core.k8sfields agrees with the Kubernetes schema it skips."""

from __future__ import annotations

import itertools
from typing import Any

from kubetitan_core import k8sfields


def _selectors() -> list[Any]:
    good = [{"key": "k"}, {"key": "k", "name": "s"}, {"key": "k", "name": None, "optional": True},
            {"key": "k", "name": "s", "optional": None}]
    bad = [{}, {"name": "s"}, {"key": 1}, {"key": None}, {"key": "k", "name": 3}, {"key": "k", "optional": "yes"},
           {"key": "k", "optional": 1}, {"key": "k", "extra": 1}, {"key": "k", "Name": "s"}, "s", ["k"], 0]
    return good + bad


def _sources() -> list[Any]:
    out: list[Any] = [None, {}, "x", [], {"fieldRef": {"fieldPath": "metadata.name"}},
                      {"resourceFieldRef": {"resource": "limits.cpu"}}, {"secretRef": {"name": "s"}}]
    for kind, sel in itertools.product(("secretKeyRef", "configMapKeyRef"), _selectors()):
        out.append({kind: sel})
    out += [{"secretKeyRef": {"key": "k"}, "configMapKeyRef": {"key": "k"}}, {"secretKeyRef": None},
            {"secretKeyRef": {"key": "k"}, "fieldRef": {"fieldPath": "metadata.name"}}]
    return out


def _items() -> list[Any]:
    out: list[Any] = [None, "A=1", 7, [], {}]
    for name, value, source in itertools.product(("A", None, 5, ""), ("1", None, 2, True, "<absent>"), _sources()):
        item: dict[str, Any] = {"name": name} if name is not None else {}
        if value != "<absent>":
            item["value"] = value
        if source is not None or name == "A":
            item["valueFrom"] = source
        out.append(item)
    out += [{"name": "A", "value": "1"}, {"name": "A", "valueFrom": {"secretKeyRef": {"key": "k"}}},
            {"name": "A", "value": "1", "extra": 1}, {"name": "A", "valuefrom": {}}, {"NAME": "A"}]
    return out


def test_the_fast_path_accepts_only_what_the_schema_accepts_and_most_env_vars() -> None:
    items = _items()
    fast = [i for i in items if k8sfields._plain_env_var(i)]
    for item in fast:
        assert k8sfields.schema_errors(k8sfields.ENV_VAR, item, "env[0]") == [], item
    # not vacuous: the common shapes take it, and items the schema refuses are among the generated ones
    assert {"name": "A", "value": "1"} in fast and {"name": "A", "valueFrom": {"secretKeyRef": {"key": "k"}}} in fast
    assert len(fast) >= 50
    refused = [i for i in items if k8sfields.schema_errors(k8sfields.ENV_VAR, i, "env[0]")]
    assert len(refused) >= 200


def test_a_null_selector_name_is_an_error_not_an_exception() -> None:
    """The schema lets ``name: null`` through (the field is nullable); the name check that follows must say what
    is wrong with it, not fail."""
    errs = k8sfields.env_errors([{"name": "A", "valueFrom": {"secretKeyRef": {"key": "k", "name": None}}}], "env")
    assert [path for path, _ in errs] == ["env[0].valueFrom.secretKeyRef.name"], errs


def test_env_errors_are_the_same_with_and_without_the_fast_path(monkeypatch) -> None:
    env = [i for i in _items() if isinstance(i, dict)]
    with_fast = k8sfields.env_errors(env, "spec.resources.env")
    monkeypatch.setattr(k8sfields, "_plain_env_var", lambda item: False)
    assert k8sfields.env_errors(env, "spec.resources.env") == with_fast
    assert with_fast  # bad items give errors either way
