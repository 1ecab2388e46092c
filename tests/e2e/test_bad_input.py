"""Bad input end to end: >= 50 hand-written and >= 1,000 generated invalid LlamaPretrains.

- every one is rejected by ``kubetitan_core.validation.parse`` (the 1,000 generated ones) and by the
  ``kubetitan validate`` CLI (a sample), each error naming a field path and saying how to fix it;
- applied straight to the mock API (no schema validation in between), every one gets
  ``Ready=False/InvalidSpec`` from the REAL operator, no child object is created, the operator never
  crashes, and a valid run applied after them still gets its pods.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support import forkrun
from support.specs import NS, e2e_spec
from support.specs import lpt as _obj
from support import yamlio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmockx.harness import CMS, LPT, PODS, SVCS, Cluster, Operator, wait_for
from kubetitan_core.validation import parse

HERE = Path(__file__).parent
API_CORPUS = yamlio.load((HERE.parent / "api" / "invalid_specs.yaml").read_text())
E2E_CORPUS = yamlio.load((HERE / "invalid_specs_e2e.yaml").read_text())
FIX = re.compile(r"\b(use|set|remove|lower|raise|change|should|must|needs?|leave|exceeds?|divide|below|above|"
                 r"revert|pick|choose|add|drop|only|required|give|divisible|e\.g\.)\b", re.I)
"""A rejection says how to fix it: it names the accepted values or the action."""
BASE = e2e_spec(Path("/ckpt"), 20, 5, 9400)


def hand_written() -> list[tuple[str, dict, str | None]]:
    """(name, object, expected path or None) for both corpora."""
    out = [(c["name"], _obj(c["name"], c["spec"]), c["errors"][0]["path"]) for c in API_CORPUS]
    for c in E2E_CORPUS:
        obj = copy.deepcopy(c["object"]) if "object" in c else _obj(c["name"], c["spec"])
        obj["metadata"].update(name=c["name"], namespace=NS)
        out.append((c["name"], obj, c["path"]))
    return out


HAND = hand_written()


# ---------------------------------------------------------------------- generated invalid specs
def _not(allowed: set[str]):
    return st.text(min_size=0, max_size=12).filter(lambda s: s not in allowed)


_WRONG_TYPE = st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=3), st.booleans().map(lambda b: [b]))
MUTATIONS: list[tuple[tuple[str, ...], st.SearchStrategy]] = [
    (("training", "steps"), st.one_of(st.integers(max_value=0), _WRONG_TYPE)),
    (("training", "seqLen"), st.one_of(st.integers(max_value=15), st.integers(min_value=1_048_577))),
    (("training", "localBatchSize"), st.integers(max_value=0)),
    (("resources", "nodes"), st.one_of(st.integers(max_value=0), st.integers(min_value=4097))),
    (("resources", "gpusPerNode"), st.one_of(st.integers(max_value=-1), st.integers(min_value=17))),
    (("model", "flavor"), _not({"debug", "1B", "3B", "8B", "70B", "405B", "custom"})),
    (("precision", "activationCheckpointing"), _not({"none", "selective", "full"})),
    (("checkpoint", "asyncMode"), _not({"disabled", "async", "async_with_pinned_mem"})),
    (("checkpoint", "intervalSteps"), st.integers(max_value=0)),
    (("checkpoint", "mountPath"), st.text(max_size=10).filter(lambda s: not s.startswith("/"))),
    (("runPolicy", "hangTimeoutSeconds"), st.one_of(st.integers(max_value=9), st.integers(min_value=86401))),
    (("runPolicy", "maxRestarts"), st.integers(max_value=-1)),
    (("runPolicy", "backoffSeconds"), st.integers(min_value=3601)),
    (("monitoring", "metricsPort"), st.one_of(st.integers(max_value=1023), st.integers(min_value=65536))),
]
SEMANTIC: list[tuple[tuple[str, ...], st.SearchStrategy]] = [
    # Reported only once the object passes the schema (validation.parse's documented order).
    (("training", "warmupSteps"), st.integers(min_value=20, max_value=10**6)),  # >= steps (20)
    (("parallelism", "dataParallelShardDegree"), st.integers(min_value=3, max_value=64)),  # 2 processes in all
]
SECTIONS = sorted(BASE)
_KEY = st.from_regex(r"\A[a-z][a-zA-Z]{2,12}\Z")


@st.composite
def invalid_lpt(draw) -> tuple[dict, set[str]]:
    """A valid CPU spec with 1-3 breakages; returns the object and the paths that must be reported."""
    spec = copy.deepcopy(BASE)
    paths: set[str] = set()
    if draw(st.integers(0, 4)) == 0:
        path, strat = draw(st.sampled_from(SEMANTIC))
        spec[path[0]][path[1]] = draw(strat)
        return _obj("gen", spec), {"spec." + ".".join(path)}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "field", "unknown", "section"]))
        if kind == "field":
            path, strat = draw(st.sampled_from(MUTATIONS))
            if not isinstance(spec.get(path[0]), dict):
                continue
            spec[path[0]][path[1]] = draw(strat)
            paths.add("spec." + ".".join(path))
        elif kind == "unknown":
            section = draw(st.sampled_from(SECTIONS))
            if not isinstance(spec.get(section), dict):
                continue
            key = draw(_KEY.filter(lambda k, s=section: k not in BASE[s]))
            spec[section][key] = draw(st.one_of(st.integers(), st.text(max_size=5)))
            paths.add(f"spec.{section}.{key}")
        else:
            section = draw(st.sampled_from(SECTIONS))
            spec[section] = draw(_WRONG_TYPE)
            paths = {p for p in paths if not p.startswith(f"spec.{section}.")} | {f"spec.{section}"}
    if not paths:  # every draw skipped: break one field for sure
        spec["training"]["steps"] = 0
        paths.add("spec.training.steps")
    return _obj("gen", spec), paths


def _check(errors, want_paths: set[str] | None) -> None:
    assert errors, "accepted an invalid LlamaPretrain"
    for e in errors:
        assert e.path and e.message, e
        assert FIX.search(e.message), f"no fix in the message: {e}"
    if want_paths:
        got = {e.path for e in errors}
        # a path is reported directly, or through a parent/child (a broken section hides its fields)
        for p in want_paths:
            assert any(g == p or g.startswith(p + ".") or p.startswith(g + ".") for g in got), (p, got)


def test_base_spec_is_valid() -> None:
    lpt, errors = parse(_obj("base", BASE))
    assert lpt is not None and not errors


def test_hand_written_corpus_is_large_enough() -> None:
    assert len(HAND) >= 50 and len({n for n, _, _ in HAND}) == len(HAND)


@pytest.mark.parametrize(("name", "obj", "path"), HAND, ids=[n for n, _, _ in HAND])
def test_hand_written_rejected_with_path_and_fix(name: str, obj: dict, path: str | None) -> None:
    _, errors = parse(obj)
    _check(errors, {path} if path else None)


@settings(max_examples=1000, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(invalid_lpt())
def test_generated_rejected_with_path_and_fix(case) -> None:
    obj, paths = case
    _, errors = parse(obj)
    _check(errors, paths)


def test_cli_rejects_every_hand_written_case(tmp_path: Path) -> None:
    """``kubetitan validate`` as a user runs it: one file alone (exit 1, the path named), then every hand-written case
    in one call (one interpreter: each file's own block says it is invalid and names its path; exit 1)."""
    files = []
    for name, obj, _ in HAND:
        f = tmp_path / f"{name}.yaml"
        f.write_text(yaml.safe_dump(obj))
        files.append(f)

    def validate(*paths: Path) -> tuple[int, str]:
        r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "validate", *map(str, paths)], capture_output=True,
                           text=True, timeout=120)
        return r.returncode, r.stdout + r.stderr

    rc, out = validate(files[0])
    assert rc == 1 and HAND[0][2] in out, (HAND[0][0], out)
    rc, out = validate(*files)
    assert rc == 1, out
    blocks: dict[str, str] = {}
    for line in out.splitlines():  # "<file>: LlamaPretrain ... is invalid ..." then indented "  - <path>: ..." lines
        head = next((str(f) for f in files if line.startswith(f"{f}: ")), None)
        if head is not None:
            blocks[head] = blocks.get(head, "") + line + "\n"
            last = head
        elif line.startswith(" ") and blocks:
            blocks[last] += line + "\n"
    for f, (name, _, path) in zip(files, HAND, strict=True):
        block = blocks.get(str(f), "")
        assert " is invalid" in block and path in block, (name, path, block)


# ---------------------------------------------------------------------- through the running operator
# (no trainer runs, so no xdist group: it overlaps the e2e group's scenarios on the other worker)
@settings(max_examples=1, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(invalid_lpt(), min_size=30, max_size=30))
def test_operator_rejects_every_one_and_keeps_serving(generated) -> None:
    objs = [obj for _, obj, _ in HAND]
    for i, (obj, _) in enumerate(generated):
        obj = copy.deepcopy(obj)
        obj["metadata"]["name"] = f"gen-{i}"
        objs.append(obj)
    with Cluster() as c, Operator(c, namespaces=(NS,), scan_interval=5.0) as op:
        for obj in objs:
            c.apply(obj, admit=False)  # straight into storage: no schema validation on the way
        c.apply(_obj("valid", BASE))
        # a bound, not a sync: 53 runs reach the operator at once; on two cores under load that took > 60 s
        wait_for(lambda: len(c.pod_names(NS, "valid")) == 2, 180, "the valid run's pods")
        # The API server prunes fields the CRD does not declare on every write (kopf's first patch here), so an
        # object whose only fault is an unknown field never reaches the operator as invalid: it must come out
        # pruned and be judged as such. Everything else must be marked InvalidSpec.
        assert c.k is not None
        schema = next(t.schema for r, t in c.k.types.items() if r.plural == "llamapretrains")

        def pruned(obj: dict) -> tuple[dict, list[str]]:
            obj = copy.deepcopy(obj)
            return obj, schema.apply(obj, None)[1]

        prunable = {o["metadata"]["name"]: pruned(o)[0] for o in objs if pruned(o)[1]}
        names = [o["metadata"]["name"] for o in objs
                 if o["metadata"]["name"] not in prunable or parse(prunable[o["metadata"]["name"]])[1]]
        wait_for(lambda: all(not pruned(c.lpt(NS, n) or {})[1] for n in prunable), 60, "unknown fields pruned")

        def rejected(n: str) -> bool:
            cond = c.condition(NS, n, "Ready")
            return cond is not None and cond["reason"] == "InvalidSpec"

        wait_for(lambda: all(rejected(n) for n in names), 60,
                 "every invalid run marked InvalidSpec")
        for n in names:
            msg = c.condition(NS, n, "Ready")["message"]
            assert re.search(r"\bspec(\.[\w]+)*\b|apiVersion|metadata", msg) and FIX.search(msg), (n, msg)
            assert c.status(NS, n).get("phase") not in ("Running", "Starting"), n
        runs = {"valid"} | {n for n in prunable if n not in names}  # valid once pruned: they may start
        pods = c.list(PODS, NS)
        assert "valid" in {p["metadata"]["labels"]["kubetitan.io/name"] for p in pods}
        assert {p["metadata"]["labels"]["kubetitan.io/name"] for p in pods} <= runs
        assert "valid-config" in {x["metadata"]["name"] for x in c.list(CMS, NS)}
        assert {x["metadata"]["name"] for x in c.list(CMS, NS)} <= {f"{n}-config" for n in runs}
        assert {x["metadata"]["name"] for x in c.list(SVCS, NS)} <= runs
        assert len(c.list(LPT, NS)) == len(objs) + 1
    assert op.error is None
