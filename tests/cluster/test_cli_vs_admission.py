"""CLI >= admission: any spec the API server refuses (the committed CRD's OpenAPI schema + CEL rules, answered by
a real kube-apiserver of the pinned version with the CRD installed and no webhook: ``support.crd_answers``),
``kubetitan validate`` refuses too, naming the same field path.

Hypothesis draws specs from the examples and an empty spec, then mutates fields chosen from the CRD schema's own
field list: in- and out-of-range numbers at the bounds, wrong types, enum neighbours, unknown keys, patterns,
removed keys. Valid and invalid specs both come out; the property is one-sided (the CLI may refuse more: it
also checks what no schema can, such as flavour dimensions and pod fields).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetitan_core.validation import CEL_RULES, parse
from support import forkrun
from support.cluster import ControlPlane
from support.crd_answers import CRD, crd_only_server, post_dry_run
from support.paths import EXAMPLES, load_example
from support.specs import make_lpt

pytestmark = pytest.mark.xdist_group("real-crd")
NAMESPACE = "cli"
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
NOT_CHECKED = "some validation rules were not checked because the object was invalid"
"""The server's cause (field ``<nil>``) beside a type error: the CEL rules it did not evaluate."""
SERVER: list[ControlPlane] = []
"""The module's server (hypothesis' @given cannot take a fixture's value: the fixture puts it here)."""


@pytest.fixture(scope="module", autouse=True)
def crd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with crd_only_server(tmp_path_factory.mktemp("crd"), NAMESPACE) as cp:
        SERVER[:] = [cp]
        yield cp
        SERVER.clear()
BASES = [make_lpt({})] + [load_example(p) for p in EXAMPLES]


def _leaves(node: dict[str, Any], path: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    out = [(path, node)]
    for k, sub in (node.get("properties") or {}).items():
        out += _leaves(sub, (*path, k))
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        out += _leaves(node["items"], (*path, 0))
    return out


FIELDS = [(p, n) for p, n in _leaves(SCHEMA["properties"]["spec"], ("spec",)) if len(p) > 1]


def _values(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values near and beyond what the field's schema allows, and of other types."""
    cands: list[Any] = [None, True, "x", "", 0, -1, 1.5, [], {}, {"unknownField": 1}, "1000", 2**63]
    for key in ("minimum", "maximum"):
        if key in node:
            b = node[key]
            cands += [b, b - 1, b + 1, float(b)]
    for key in ("minLength", "maxLength"):
        if key in node:
            cands += ["a" * max(node[key] - 1, 0), "a" * node[key], "a" * (node[key] + 1)]
    if "enum" in node:
        cands += list(node["enum"]) + [str(node["enum"][0]).lower(), str(node["enum"][0]) + "x"]
    if "default" in node:
        cands.append(copy.deepcopy(node["default"]))
    if node.get("type") == "string" and "pattern" in node:
        cands += ["/abs/path", "rel/path", "64Gi", "64GB", "1.5", "100m", "op", "0", "7"]
    if node.get("type") == "array":
        cands += [["a"], [1], [{}], [{"name": "A", "value": "b"}]]
    return st.sampled_from(cands)


def _set(obj: dict[str, Any], path: tuple[Any, ...], value: Any, delete: bool) -> None:
    cur: Any = obj
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(part, int):
            if not isinstance(cur, list):
                return
            while len(cur) <= part:
                cur.append({} if not isinstance(nxt, int) else [])
            cur = cur[part]
        else:
            if not isinstance(cur, dict):
                return
            if not isinstance(cur.get(part), (dict, list)):
                cur[part] = [] if isinstance(nxt, int) else {}
            cur = cur[part]
    last = path[-1]
    if isinstance(last, int):
        if isinstance(cur, list):
            while len(cur) <= last:
                cur.append(None)
            cur[last] = value
    elif isinstance(cur, dict):
        if delete:
            cur.pop(last, None)
        else:
            cur[last] = value


@st.composite
def specs(draw: Any) -> dict[str, Any]:
    obj = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        path, node = draw(st.sampled_from(FIELDS))
        _set(obj, path, draw(_values(node)), delete=draw(st.booleans()) and draw(st.booleans()))
    return obj


def _is_cel(message: str) -> bool:
    return "cannot evaluate" in message or any(r.message in message or r.rule[:40] in message for r in CEL_RULES)


def admission_layers(obj: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(OpenAPI-layer, CEL-layer) field paths the API server refuses, from a dry-run create with strict field
    validation (as kubectl sends it): strict decoding's unknown fields (400), the 422's causes split by whether their
    message is a CEL rule's."""
    doc = copy.deepcopy(obj)
    doc["metadata"] = {**doc.get("metadata", {}), "namespace": NAMESPACE}
    code, body, _ = post_dry_run(SERVER[0].admin, doc)
    if code == 201:
        return set(), set()
    message = body.get("message", "")
    if code == 400:
        unknown = set(re.findall(r'unknown field "([^"]+)"', message))
        assert unknown, body  # the only 400 strict decoding gives for a well-formed body
        return unknown, set()
    assert code == 422 and body.get("reason") == "Invalid", body
    schema, cel = set(), set()
    for c in (body.get("details") or {}).get("causes") or []:
        field, text = c.get("field", ""), c.get("message", "")
        if field in ("", "<nil>"):  # the server names the field in the message, or none (NOT_CHECKED)
            m = re.search(r" in (spec[\w.\[\]]*)", text)
            if m is None:
                assert NOT_CHECKED in text, c
                continue
            field = m.group(1)
        (cel if _is_cel(text) else schema).add(field)
    return schema, cel


def admission(obj: dict[str, Any]) -> set[str]:
    schema, cel = admission_layers(obj)
    return schema | cel


def _covered(api_path: str, cli_paths: set[str]) -> bool:
    # the same path, a field inside it (the API server reports a CEL rule at its fieldPath, the CLI at the
    # field to change), or the object holding it when that object itself is malformed (e.g. `model: null`)
    def under(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or a.startswith(b + "[")

    return any(under(p, api_path) or under(api_path, p) and p != "spec" for p in cli_paths)


@settings(max_examples=int(os.environ.get("KUBETITAN_PROPERTY_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_the_cli_refuses_whatever_the_api_server_refuses_at_the_same_path(obj):
    schema, cel = admission_layers(obj)
    _, errors = parse(copy.deepcopy(obj))
    cli = {e.path for e in errors}
    # CEL paths are compared when neither side found a type error: over a value of the wrong type the rules
    # either cannot be evaluated or compute with it (`processesPerNode: 1.0`), about a spec already refused
    refused = schema if schema or any(e.rule == "schema" for e in errors) else cel
    if schema or cel:
        assert errors, f"API server refuses {sorted(schema | cel)} but the CLI accepts:\n{json.dumps(obj['spec'])}"
    if refused:
        assert errors, f"API server refuses {sorted(refused)} but the CLI accepts:\n{json.dumps(obj['spec'])}"
        missing = sorted(p for p in refused if not _covered(p, cli))
        assert not missing, (f"API server refuses {missing}, the CLI reports {sorted(cli)}:\n"
                             f"{json.dumps(obj['spec'])}\n" + "\n".join(map(str, errors)))


def test_the_property_sees_both_verdicts():
    """The generator is not degenerate: among fixed draws some specs pass admission and some are refused."""
    from hypothesis import find

    untimed = settings(deadline=None)  # hypothesis' default 200 ms per draw fails on a loaded machine, not on a bug
    find(specs(), lambda o: not admission(o) and not parse(copy.deepcopy(o))[1], settings=untimed)
    find(specs(), lambda o: bool(admission(o)), settings=untimed)


def test_cli_command_agrees_on_a_refused_spec(tmp_path: Path):
    """``kubetitan validate`` (the command) refuses what the server refuses; a ``null`` the server prunes before
    validating (``serviceAccountName``, not nullable) is no refusal of the server's."""
    obj = make_lpt({"training": {"steps": 0}, "resources": {"serviceAccountName": None}})
    assert admission(obj) == {"spec.training.steps"}
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(obj))
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "validate", str(f)], capture_output=True, text=True)
    assert r.returncode != 0 and "spec.training.steps" in r.stdout + r.stderr
