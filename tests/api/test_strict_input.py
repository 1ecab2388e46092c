"""Strict, total input: malformed files are exit 1 with a line and a fix, never a traceback."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support.specs import make_lpt
from support import yamlio
from kubetitan import cli
from kubetitan.plan import attempt_children
from kubetitan_core.api import API_VERSION, KIND
from kubetitan_core.validation import parse

HEAD = b"apiVersion: kubetitan.io/v1alpha1\nkind: LlamaPretrain\n"


def run(tmp_path, data: bytes, capsys):
    f = tmp_path / "x.yaml"
    f.write_bytes(data)
    rc = cli.main(["validate", str(f)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("data, fragment", [
    (HEAD + b"metadata: [a, b]\nspec: {}\n", "metadata"),
    (HEAD + b"metadata: {name: r}\nspec: " + b"[" * 5000 + b"]" * 5000 + b"\n", "deeper than"),
    (HEAD + b"metadata: {name: r\xe9}\n", "not UTF-8"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {steps: " + b"7" * 6000 + b"}}\n", "cannot be read"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {steps: 9223372036854775808}}\n", "64-bit"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {steps: 10, steps: 20}}\n", "duplicate key"),
    (HEAD + b"metadata: &m {name: r, labels: *m}\n", "refers to itself"),
    (HEAD + b"a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
     "alias"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {steps: \"1000\"}}\n", "spec.training.steps"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {steps: yes}}\n", "spec.training.steps"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {learningRate: .inf}}\n", "spec.training.learningRate"),
    (HEAD + b"metadata: {name: r}\nspec: {training: {seq_len: 128}}\n", "spec.training.seq_len"),
], ids=["metadata-list", "deep", "not-utf8", "huge-int", "int64", "duplicate", "recursive-alias", "alias-bomb",
        "quoted-int", "yes-int", "inf", "python-name"])
def test_malformed_input_is_exit_1_with_a_reason(tmp_path, capsys, data, fragment):
    rc, err = run(tmp_path, data, capsys)
    assert rc == 1, err
    assert fragment in err and "Traceback" not in err


@pytest.mark.parametrize("name, ok", [
    ("8b-run", False), ("llama3.1-8b", False), ("my.run", False), ("Llama3-8B", False),
    ("a" * 52, True), ("a" * 54, True), ("a" * 55, False),
])
def test_run_names_fit_every_child(name, ok):
    lpt, errors = parse(make_lpt({}, name=name))
    assert (errors == []) is ok, errors
    if ok:
        for obj in attempt_children(lpt, 99999):
            assert len(obj["metadata"]["name"]) <= 63 or obj["kind"] == "ConfigMap"
            if obj["kind"] == "Pod":
                assert len(obj["spec"]["hostname"]) <= 63


def test_user_env_replaces_ours_once():
    lpt, errors = parse(make_lpt({"resources": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}}))
    assert errors == []
    env = attempt_children(lpt, 0)[2]["spec"]["containers"][0]["env"]
    assert [e.get("value") for e in env if e["name"] == "NCCL_DEBUG"] == ["INFO"]


@example(b"0:")  # an integer key at the top: once a traceback in the error's path (found by this test in s15)
@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes_never_traceback(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("fz") / "x.yaml"
    f.write_bytes(HEAD + data)
    assert cli.main(["validate", str(f)]) in (0, 1)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
_tree = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4)), max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["metadata", "spec", "status", "x"]), _tree, max_size=4))
def test_fuzz_trees_never_traceback(tmp_path_factory, tree):
    import yaml

    f = tmp_path_factory.mktemp("fz") / "x.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", **tree}))
    assert cli.main(["validate", str(f)]) in (0, 1)


@pytest.mark.parametrize("spec, paths", [
    ({"checkpoint": {"intervalSteps": 2**63}}, ["spec.checkpoint.intervalSteps"]),
    ({"checkpoint": {"intervalSteps": -(2**63) - 1}}, ["spec.checkpoint.intervalSteps"]),
    ({"model": None, "checkpoint": {"intervalSteps": 2**63}}, ["spec.model", "spec.checkpoint.intervalSteps"]),
], ids=["int64-over", "int64-under", "with-a-null"])
def test_integers_beyond_int64_in_an_object_are_refused_at_their_path(spec, paths):
    """Objects reach parse() without the YAML loader too (the operator, the property test): an integer the API
    server cannot hold is refused where it is, and the rest of the spec is still reported."""
    obj = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "run", "namespace": "ml"}, "spec": spec}
    _, errors = parse(obj)
    assert [e.path for e in errors] == paths, errors
    assert "64-bit" in str(errors[-1])


def test_a_key_that_is_not_a_string_is_named_with_how_to_fix_it(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_bytes(HEAD + b"0:\n")
    lpt, errors = parse(yamlio.load(f.read_text()))
    assert lpt is None and [(e.path, e.message) for e in errors] == [
        ("[0]", "the key 0 is not a field name (YAML read it as a number); remove it, or quote it if it was meant as a name")]

