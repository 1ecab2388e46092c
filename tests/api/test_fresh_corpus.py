"""The fresh corpus (tests/api/fresh_corpus.yaml, written from the issue, docs/api.md, the CRD, Kubernetes' and
torchtitan's rules, not from the validator): `kubetitan validate` refuses every invalid case with exit 1 and an
error line naming the expected field path and a fix, accepts every valid case with exit 0, and never raises.

Each case runs the CLI in-process (``cli.main``, what ``python -m kubetitan.cli`` calls); an exception out of it
is what a user sees as a traceback. ``test_refused_fraction`` prints the fraction refused with the right path.
"""

from __future__ import annotations

import copy
import re
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetitan import cli
from support import yamlio

CORPUS = yamlio.load((Path(__file__).parent / "fresh_corpus.yaml").read_text(encoding="utf-8"))
BASE = CORPUS["base"]
INVALID = CORPUS["invalid"]
VALID = CORPUS["valid"]
DELETE = "~delete"
HEAD = b"apiVersion: kubetitan.io/v1alpha1\nkind: LlamaPretrain\nmetadata: {name: r}\n"

# Words that tell the user what to do (the allowed values, the change, an example); a message that only says
# what is wrong ("invalid value") has none of them.
FIX = re.compile(r"\b(use|set|remove|drop|rename|quote|write|choose|pick|give|make|add|change|lower|raise|shorten|"
                 r"instead|e\.g\.|for example|did you mean|fix|try|delete|split|save|encode|keep|put|replace|omit|"
                 r"unset|increase|decrease|reduce|spell|correct|at most|at least|one of|between|only|without|"
                 r"start with|end with|must (?:be|have|match|start|end|not|contain|divide|equal)|needs?|requires?|"
                 r"expected|move|flatten)\b", re.I)


def _alias_bomb() -> bytes:
    lines = [b"metadata: {name: r, annotations: {x: y}}", b"spec:", b"  resources:", b"    nodeSelector:",
             b"      a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 9):
        lines.append(f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]".encode())
    return HEAD.replace(b"metadata: {name: r}\n", b"") + b"\n".join(lines) + b"\n"


MAKERS = {
    "deep-lists": lambda: HEAD + b"spec: {resources: {env: " + b"[" * 10000 + b"]" * 10000 + b"}}\n",
    "deep-mappings": lambda: HEAD + b"spec: " + b"{a: " * 5000 + b"1" + b"}" * 5000 + b"\n",
    "nul-byte": lambda: HEAD.replace(b"{name: r}", b"{name: r\x00x}") + b"spec: {}\n",
    "binary-junk": lambda: bytes(range(128, 256)) * 4,
    "huge-int-steps": lambda: HEAD + b"spec: {training: {steps: " + b"7" * 6000 + b"}}\n",
    "huge-negative-seed": lambda: HEAD + b"spec: {training: {seed: -" + b"9" * 5000 + b"}}\n",
    "huge-int-toleration": lambda: HEAD + b"spec: {resources: {tolerations: [{key: spot, operator: Exists, "
                                          b"effect: NoExecute, tolerationSeconds: " + b"3" * 5000 + b"}]}}\n",
    "alias-bomb": _alias_bomb,
}


class _Dumper(yaml.SafeDumper):
    """Quotes strings that go-yaml (and kubetitan's reader) would read as numbers, e.g. "3e-4"."""


_Dumper.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
                              list("-+0123456789."))


def merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v == DELETE:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v) if k in out else copy.deepcopy(v)
    return out


def content(case: dict[str, Any]) -> bytes:
    if "make" in case:
        return MAKERS[case["make"]]()
    if "latin1" in case:
        return case["latin1"].encode("latin-1")
    if "text" in case:
        return case["text"].encode("utf-8")
    doc = merge(BASE, case["patch"])
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True).encode("utf-8")


def validate(tmp_path: Path, case: dict[str, Any], capsys) -> tuple[int | None, str, str, str | None]:
    """(exit code, stdout, stderr, traceback text or None) of ``kubetitan validate`` on the case."""
    f = tmp_path / f"{case['id']}.yaml"
    f.write_bytes(content(case))
    capsys.readouterr()
    try:
        rc, tb = cli.main(["validate", str(f)]), None
    except SystemExit as e:  # argparse: still no traceback
        rc, tb = (e.code if isinstance(e.code, int) else 2), None
    except BaseException:  # noqa: BLE001 - what the user would see as a traceback
        rc, tb = None, traceback.format_exc()
    out = capsys.readouterr()
    return rc, out.out, out.err, tb


def _path_at(line: str, path: str) -> bool:
    """``path`` appears in ``line`` as a whole field path (or the start of a deeper one: ``.x``/``[i]``)."""
    for m in re.finditer(re.escape(path), line):
        before = line[m.start() - 1] if m.start() else " "
        after = line[m.end()] if m.end() < len(line) else " "
        if not (before.isalnum() or before in "._") and not (after.isalnum() or after == "_"):
            return True
    return False


def verdict(tmp_path: Path, case: dict[str, Any], capsys) -> str | None:
    """None when the invalid case is refused as it should be, else why not."""
    if "name_length" in case:
        assert len(case["patch"]["metadata"]["name"]) == case["name_length"], case["id"]
    rc, out, err, tb = validate(tmp_path, case, capsys)
    if tb is not None:
        return f"traceback:\n{tb}"
    if "Traceback" in err:
        return f"traceback printed:\n{err}"
    if rc != 1:
        return f"exit {rc} (expected 1); stdout {out!r} stderr {err!r}"
    path, *words = case["expect"]
    lines = [ln for ln in err.splitlines() if _path_at(ln, path) and all(w in ln for w in words)]
    if not lines:
        return f"no error line names {case['expect']}: {err!r}"
    if not any(FIX.search(ln.split(path, 1)[-1]) for ln in lines):
        return f"the error names {path} but not how to fix it: {lines}"
    return None


@pytest.mark.parametrize("case", INVALID, ids=[c["id"] for c in INVALID])
def test_invalid_case_is_refused_with_its_path_and_a_fix(tmp_path, capsys, case):
    why = verdict(tmp_path, case, capsys)
    assert why is None, f"{case['id']} ({case['class']}): {why}"


WARNING_LINE = re.compile(r"^\S+: warning \[(?P<rule>[a-z0-9.-]+)\] (?:spec|metadata)[^:]*: .{20,}$")


@pytest.mark.parametrize("case", VALID, ids=[c["id"] for c in VALID])
def test_valid_case_is_accepted(tmp_path, capsys, case):
    if "name_length" in case:
        assert len(case["patch"]["metadata"]["name"]) == case["name_length"], case["id"]
    rc, out, err, tb = validate(tmp_path, case, capsys)
    assert tb is None, tb
    assert rc == 0, f"{case['id']}: exit {rc}: {err}"
    assert "is valid" in out and "Traceback" not in err
    if "warning" in case:
        assert f"spec.resources.instanceType: instance type {case['warning']}" in err, err
    # A valid spec may get warnings (kubetitan_core.warning_rules: e.g. the default synthetic data on 8 GPUs), each a
    # table row's id, a field path and a message; an error line never.
    for line in err.splitlines():
        assert WARNING_LINE.match(line), f"{case['id']}: not a warning line: {line!r}"
    docs = [d for d in yamlio.load_all(content(case)) if d]
    single = len(docs) == 1 and docs[0].get("kind") == "LlamaPretrain"
    nodes = (docs[0].get("spec") or {}).get("resources", {}).get("nodes", 1) if single else 0
    if 0 < nodes <= 16 and docs[0]["metadata"].get("name"):  # the children render (not the 4096-pod gangs: slow), and no env name is set twice in a pod
        f = tmp_path / f"{case['id']}.yaml"
        assert cli.main(["render", str(f)]) == 0
        pods = [o for o in yamlio.load_all(capsys.readouterr().out) if o and o["kind"] == "Pod"]
        assert len(pods) == nodes
        for pod in pods:
            names = [e["name"] for c in pod["spec"]["containers"] for e in c.get("env", [])]
            assert len(names) == len(set(names)), names


def test_refused_fraction(tmp_path, capsys):
    """The must-show number: the fraction of the invalid corpus refused with the right path and a fix."""
    results = {c["id"]: verdict(tmp_path, c, capsys) for c in INVALID}
    missed = {k: v for k, v in results.items() if v is not None}
    tracebacks = [k for k, v in missed.items() if v.startswith("traceback")]
    refused = len(INVALID) - len(missed)
    with capsys.disabled():
        print(f"\nfresh corpus: {refused}/{len(INVALID)} invalid cases refused with the right path and a fix "
              f"({refused / len(INVALID):.1%}); {len(tracebacks)} tracebacks; {len(VALID)} valid cases")
        for k, v in missed.items():
            print(f"  MISSED {k}: {v[:300]}")
    assert not tracebacks
    assert refused / len(INVALID) >= 0.99


ODD_VALUES = [[], {}, None, 1, -1, 0, "x", "", True, 1.5, [[]], [{}], [None], {"a": None}, {"a": []}, 2**70, "ü"]
FULL = merge(BASE, {
    "metadata": {"labels": {"a": "b"}, "annotations": {"c": "d"}, "finalizers": ["example.com/f"]},
    "spec": {
        "model": {"flavor": "custom", "custom": {"dim": 1024, "nLayers": 4, "nHeads": 16, "nKvHeads": 4,
                                                  "vocabSize": 128256}},
        "data": {"source": "shards", "shards": {"path": "/d"}, "volume": {"claimName": "c"}, "mountPath": "/data"},
        "scheduling": {"queueName": "q", "schedulerName": "s"},
        "precision": {"float8": {"enabled": True, "filterFqns": ["output"]}},
        "resources": {
            "env": [{"name": "A", "value": "b"}, {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    {"name": "F", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
            "tolerations": [{"key": "a", "operator": "Equal", "value": "b", "effect": "NoExecute", "tolerationSeconds": 5}],
            "nodeSelector": {"a": "b"}, "imagePullSecrets": ["x"],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                        "matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}],
                        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]},
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [{"key": "k", "operator": "Exists"}]}}]},
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "t", "labelSelector": {
                        "matchLabels": {"a": "b"}, "matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}}],
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "podAffinityTerm": {
                        "topologyKey": "t", "labelSelector": {"matchLabels": {"a": "b"}}}}]}}}}})


def _paths(o: Any, p: list[Any]) -> list[list[Any]]:
    out = [p]
    for k, v in (o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()):
        out += _paths(v, p + [k])
    return out


def test_an_odd_value_anywhere_is_an_error_never_an_exception():
    """Every field of a spec that uses every section (pod fields included), replaced by each odd value: the
    validator (and the planner, for what it accepts) returns errors, never raises."""
    from kubetitan.plan import attempt_children
    from kubetitan_core.validation import parse

    assert parse(FULL)[1] == []
    paths = _paths(FULL, [])
    for path in paths:
        for value in ODD_VALUES:
            doc = copy.deepcopy(FULL)
            if path:
                at = doc
                for k in path[:-1]:
                    at = at[k]
                at[path[-1]] = value
            else:
                doc = value
            lpt, errors = parse(doc)
            if lpt is not None and not errors:
                attempt_children(lpt, 0)
    assert len(paths) * len(ODD_VALUES) > 2000
