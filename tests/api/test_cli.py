"""The `kubetitan` CLI: validate, render and crd, with clear errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from support import forkrun
from support.paths import REPO
from support.specs import make_lpt
from support import yamlio


def kt(*args, stdin=None):
    return subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_validate_good_examples():
    r = kt("validate", *[str(p) for p in sorted((REPO / "examples").glob("*.yaml"))])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("is valid") == len(list((REPO / "examples").glob("*.yaml")))


def test_validate_lists_every_error(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                 "metadata": {"name": "bad"},
                                 "spec": {"checkpoint": {"keepLatestK": 1},
                                          "runPolicy": {"backoffSeconds": 60, "maxBackoffSeconds": 30}}}))
    r = kt("validate", str(f))
    assert r.returncode == 1
    assert "spec.runPolicy.maxBackoffSeconds" in r.stderr and "spec.checkpoint.keepLatestK" in r.stderr
    assert "(2 error(s))" in r.stderr


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("a: [unclosed", "not valid YAML"),
        ("", "no YAML document"),
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", "not LlamaPretrain"),
        ("apiVersion: kubetitan.io/v1alpha1\nkind: LlamaPretrain\nmetadata: {name: p}\nspec: {trainin: {}}\n",
         "spec.trainin: unknown field"),
    ],
    ids=["bad-yaml", "empty", "wrong-kind", "unknown-field"],
)
def test_bad_input_is_explained(tmp_path, content, fragment):
    f = tmp_path / "x.yaml"
    f.write_text(content)
    r = kt("validate", str(f))
    assert r.returncode in (1, 2)
    assert fragment in r.stderr


def test_missing_file():
    r = kt("validate", "/nonexistent.yaml")
    assert r.returncode == 2 and "cannot read the file" in r.stderr


def test_render_prints_the_children_of_an_attempt():
    r = kt("render", "examples/llama3-8b-p5-4node.yaml", "--attempt", "2")
    assert r.returncode == 0, r.stderr
    objs = [o for o in yamlio.load_all(r.stdout) if o]
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "Pod", "Pod", "Pod", "Pod"]
    assert objs[2]["metadata"]["name"] == "llama3-8b-p5-4node-a2-0"


def test_render_with_pod_groups_shows_the_attempts_pod_group():
    r = kt("render", "examples/llama3-8b-p5-4node.yaml", "--attempt", "2", "--pod-groups")
    assert r.returncode == 0, r.stderr
    objs = [o for o in yamlio.load_all(r.stdout) if o]
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "PodGroup", "Pod", "Pod", "Pod", "Pod"]
    assert objs[2]["metadata"]["name"] == "llama3-8b-p5-4node-a2"
    assert objs[2]["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert {o["spec"]["schedulingGroup"]["podGroupName"] for o in objs[3:]} == {"llama3-8b-p5-4node-a2"}


def test_render_refuses_invalid_spec(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("apiVersion: kubetitan.io/v1alpha1\nkind: LlamaPretrain\nmetadata: {name: p}\n"
                 "spec: {parallelism: {dataParallelShardDegree: 3}}\n")
    r = kt("render", str(f))
    assert r.returncode == 1 and "spec.parallelism" in r.stderr and r.stdout == ""


def test_render_takes_stdin():
    r = kt("render", "-", stdin=(REPO / "examples/debug-cpu.yaml").read_text())
    assert r.returncode == 0 and "kind: Pod" in r.stdout


def test_render_several_documents_is_an_error(tmp_path):
    f = tmp_path / "two.yaml"
    text = (REPO / "examples/debug-cpu.yaml").read_text()
    f.write_text(text + "\n---\n" + text)
    r = kt("render", str(f))
    assert r.returncode == 2 and "exactly one" in r.stderr


class _Exec(Exception):
    pass


@pytest.mark.parametrize(("argv", "handed"), [
    (["run", "{f}", "--steps", "3"], ["-m", "kubetitan_trainer.local", "{f}", "--steps", "3"]),
    (["run", "{f}", "--output-dir", "/tmp/o"], ["-m", "kubetitan_trainer.local", "{f}", "--output-dir", "/tmp/o"]),
    (["run", "{f}", "--ledger"], ["-m", "kubetitan_trainer.local", "{f}", "--ledger"]),
    (["prepare-data", "a.txt", "-o", "out"], ["-m", "kubetitan_trainer.data.prepare", "a.txt", "-o", "out"]),
], ids=["run-steps", "run-output-dir", "run-ledger", "prepare-data"])
def test_trainer_commands_hand_the_process_over_to_the_trainer_without_importing_it(monkeypatch, argv, handed):
    """`kubetitan run` / `prepare-data` exec `python -m kubetitan_trainer...`: the operator package never imports
    the trainer's (tests/api/test_pure_core.py); the trainer's own process then owns Ctrl-C and the exit code."""
    import os

    from kubetitan import cli

    f = str(REPO / "examples" / "debug-cpu.yaml")
    calls = []

    def execv(path, args):
        calls.append((path, args))
        raise _Exec

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(_Exec):
        cli.main([a.format(f=f) for a in argv])
    assert calls == [(sys.executable, [sys.executable] + [a.format(f=f) for a in handed])]


def test_run_refuses_an_invalid_file_before_handing_over(tmp_path, monkeypatch):
    import os

    from kubetitan import cli

    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("handed an invalid file to the trainer"))
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                 "metadata": {"name": "bad"}, "spec": {"checkpoint": {"keepLatestK": 1}}}))
    assert cli.main(["run", str(f)]) == 1


def test_the_trainers_local_entry_point_refuses_an_invalid_file(tmp_path):
    """`python -m kubetitan_trainer.local FILE` (what `kubetitan run` execs) checks the file itself too."""
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: kubetitan.io/v1alpha1\nkind: LlamaPretrain\nmetadata: {name: bad}\n"
                 "spec: {training: {steps: 0}}\n")
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan_trainer.local", str(f)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 1
    assert "spec.training.steps" in r.stderr and "kubetitan validate" in r.stderr


def test_validate_names_the_failed_saves_budget_and_its_bounds(tmp_path, capsys):
    """In process (no interpreter start): spec.checkpoint.maxFailedSaves out of its bounds is one error naming the
    field, the bound and where the bounds are documented; in bounds it is valid."""
    from kubetitan import cli

    def doc(n):
        return yaml.safe_dump(make_lpt({"checkpoint": {"storage": {"hostPath": "/ck"}, "maxFailedSaves": n},
                                        "resources": {"gpusPerNode": 0}, "model": {"flavor": "debug"}}, name="b"))
    (tmp_path / "zero.yaml").write_text(doc(0))
    (tmp_path / "ten.yaml").write_text(doc(10))
    assert cli.main(["validate", str(tmp_path / "zero.yaml")]) == 1
    err = capsys.readouterr().err
    assert "(1 error(s))" in err and "spec.checkpoint.maxFailedSaves: must be greater than or equal to 1 (got 0)" in err
    assert cli.main(["validate", str(tmp_path / "ten.yaml")]) == 0
    assert "LlamaPretrain b is valid" in capsys.readouterr().out
