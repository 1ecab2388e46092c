"""The warning table (kubetitan_core.warning_rules): each warning, table-tested on a spec that should get it and on
one that should not; the CLI lists warnings and exits 0; docs/api.md lists the table."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetitan import cli
from support.specs import make_lpt
from kubetitan_core import warning_rules as wr
from kubetitan_core.validation import parse

REPO = Path(__file__).resolve().parents[2]

# A spec a careful user would write: it gets no warning at all (each case below changes one thing).
CLEAN: dict[str, Any] = {
    "model": {"flavor": "8B"},
    "training": {"steps": 1000, "warmupSteps": 50},
    "resources": {"nodes": 2, "instanceType": "p5.48xlarge", "gpusPerNode": 8},
    "data": {"source": "shards", "shards": {"path": "/data/c4"}},
    "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "fsx"}}, "intervalSteps": 100},
    "tokenizer": {"source": "huggingface", "repo": "meta-llama/Meta-Llama-3.1-8B",
                  "tokenSecretRef": {"name": "hf"}},
}


def obj(spec: dict[str, Any], labels: dict[str, str] | None = None, name: str = "run") -> dict[str, Any]:
    o = make_lpt(spec, name=name)
    if labels:
        o["metadata"]["labels"] = labels
    return o


def merged(patch: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    out = copy.deepcopy(CLEAN if base is None else base)
    for k, v in patch.items():
        if v is None:  # None removes the key
            out.pop(k, None)
        else:  # {} replaces, a non-empty mapping merges
            out[k] = merged(v, out[k]) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


def warnings_of(o: dict[str, Any]) -> list[wr.FieldWarning]:
    lpt, errors = parse(o)
    assert lpt is not None and not errors, errors
    return wr.warnings_for(lpt)


# warning id -> (a spec patch on CLEAN that should get it, the field path it is reported at, extra labels)
CASES: dict[str, tuple[dict[str, Any], str, dict[str, str] | None]] = {
    "resources.unknown-instance-type": ({"resources": {"instanceType": "p9.huge"}}, "spec.resources.instanceType",
                                        None),
    "checkpoint.interval-beyond-run": ({"checkpoint": {"intervalSteps": 5000}}, "spec.checkpoint.intervalSteps",
                                       None),
    "checkpoint.no-volume": ({"resources": {"nodes": 1}, "checkpoint": {"storage": {}}}, "spec.checkpoint.storage",
                             None),
    "checkpoint.host-path": ({"resources": {"nodes": 1}, "checkpoint": {"storage": {"hostPath": "/mnt/ck",
                                                                      "persistentVolumeClaim": None}}},
                             "spec.checkpoint.storage.hostPath", None),
    "checkpoint.keep-all": ({"checkpoint": {"keepLatestK": 0}}, "spec.checkpoint.keepLatestK", None),
    "training.warmup-most-of-run": ({"training": {"warmupSteps": 800}}, "spec.training.warmupSteps", None),
    "training.learning-rate-high": ({"training": {"learningRate": 0.01}}, "spec.training.learningRate", None),
    "training.data-synthetic-at-scale": ({"data": {"source": "synthetic", "shards": None}}, "spec.data.source",
                                         None),
    "tokenizer.smaller-than-model": ({"tokenizer": {"repo": "gpt2"}}, "spec.tokenizer.repo", None),
    "precision.float8-without-compile": ({"precision": {"compile": False, "float8": {"enabled": True}}},
                                         "spec.precision.compile", None),
    "precision.no-compile-on-gpu": ({"precision": {"compile": False}}, "spec.precision.compile", None),
    "run-policy.fixed-hang-short": ({"model": {"flavor": "70B"}, "resources": {"nodes": 4},
                                     "runPolicy": {"hangTimeoutPolicy": "Fixed", "hangTimeoutSeconds": 10}},
                                    "spec.runPolicy.hangTimeoutSeconds", None),
    "run-policy.startup-short": ({"model": {"flavor": "70B"}, "resources": {"nodes": 4},
                                  "runPolicy": {"startupTimeoutSeconds": 10}},
                                 "spec.runPolicy.startupTimeoutSeconds", None),
    "run-policy.in-place-beyond-budget": ({"runPolicy": {"maxInPlaceRestarts": 50, "maxRestarts": 5}},
                                          "spec.runPolicy.maxInPlaceRestarts", None),
    "precision.loss-chunks-fp8-head": ({"precision": {"lossChunks": 4, "float8": {"enabled": True, "filterFqns": []}}},
                                       "spec.precision.lossChunks", None),
    "run-policy.in-process-async-on-cpu": ({"model": {"flavor": "debug"}, "tokenizer": {"source": "builtin"},
                                            "resources": {"gpusPerNode": 0},
                                            "runPolicy": {"inProcessRestarts": 2}, "checkpoint": {"asyncMode": "async"}},
                                           "spec.checkpoint.asyncMode", None),
    "run-policy.in-process-gpu-hang-undetected": ({"runPolicy": {"inProcessRestarts": 2}},
                                                  "spec.runPolicy.inProcessHangSeconds", None),
    "run-policy.no-restarts": ({"runPolicy": {"maxRestarts": 0, "maxInPlaceRestarts": 0}},
                               "spec.runPolicy.maxRestarts", None),
    "run-policy.deadline-before-startup": ({"runPolicy": {"activeDeadlineSeconds": 600}},
                                           "spec.runPolicy.activeDeadlineSeconds", None),
    "run-policy.ttl-zero": ({"runPolicy": {"ttlSecondsAfterFinished": 0}}, "spec.runPolicy.ttlSecondsAfterFinished",
                            None),
    "run-policy.unschedulable-fail-at-once": ({"runPolicy": {"unschedulableAction": "Fail",
                                                             "unschedulableTimeoutSeconds": 0}},
                                              "spec.runPolicy.unschedulableTimeoutSeconds", None),
    "monitoring.log-frequency-beyond-run": ({"monitoring": {"logFrequencySteps": 2000}},
                                            "spec.monitoring.logFrequencySteps", None),
    "pod.image-unpinned": ({"resources": {"image": "my-registry/trainer:latest"}}, "spec.resources.image", None),
    "metadata.kueue-label": ({}, "metadata.labels.kueue.x-k8s.io/queue-name", {"kueue.x-k8s.io/queue-name": "q"}),
}

# Near misses: the same field, set so that the warning must not fire.
NEAR_MISSES: dict[str, dict[str, Any]] = {
    "checkpoint.interval-beyond-run": {"checkpoint": {"intervalSteps": 1000}},
    "training.warmup-most-of-run": {"training": {"warmupSteps": 500}},
    "training.learning-rate-high": {"training": {"learningRate": 0.003}},
    "training.data-synthetic-at-scale": {"data": {"source": "synthetic", "shards": None},
                                         "resources": {"nodes": 1, "gpusPerNode": 1},
                                         "checkpoint": {"storage": {"hostPath": "/x", "persistentVolumeClaim": None}}},
    "run-policy.fixed-hang-short": {"runPolicy": {"hangTimeoutPolicy": "Fixed", "hangTimeoutSeconds": 60}},
    "run-policy.startup-short": {"runPolicy": {"startupTimeoutSeconds": 300}},
    "run-policy.in-place-beyond-budget": {"runPolicy": {"maxInPlaceRestarts": 5, "maxRestarts": 5}},
    "run-policy.in-process-gpu-hang-undetected": {"runPolicy": {"inProcessRestarts": 2, "inProcessHangSeconds": 60}},
    "precision.loss-chunks-fp8-head": {"precision": {"lossChunks": 4, "float8": {"enabled": True,
                                                                                "filterFqns": ["output"]}}},
    "run-policy.in-process-async-on-cpu": {"model": {"flavor": "debug"}, "tokenizer": {"source": "builtin"},
                                           "resources": {"gpusPerNode": 0},
                                           "runPolicy": {"inProcessRestarts": 2}, "checkpoint": {"asyncMode": "disabled"}},
    "run-policy.deadline-before-startup": {"runPolicy": {"activeDeadlineSeconds": 1801}},
    "run-policy.ttl-zero": {"runPolicy": {"ttlSecondsAfterFinished": 60}},
    "pod.image-unpinned": {"resources": {"image": "registry.local:5000/trainer@sha256:" + "a" * 64}},
    "monitoring.log-frequency-beyond-run": {"monitoring": {"logFrequencySteps": 1000}},
    "tokenizer.smaller-than-model": {"tokenizer": {"repo": "meta-llama/Llama-3.2-1B"}},
}


def test_the_table_has_at_least_15_warnings_each_with_a_predicate_and_a_case():
    ids = [w.id for w in wr.WARNINGS]
    assert len(ids) == len(set(ids)) >= 15
    assert set(wr.WARNING_CHECKS) == set(ids)
    object_ids = {w.id for w in wr.WARNINGS if w.scope == "object"}
    assert set(CASES) == object_ids, "every object warning needs a case in CASES"


def test_a_careful_spec_gets_no_warning():
    assert warnings_of(obj(CLEAN)) == []


@pytest.mark.parametrize("rule", CASES)
def test_each_warning_fires_on_its_case_at_its_path_with_a_fix(rule):
    patch, path, labels = CASES[rule]
    got = [w for w in warnings_of(obj(merged(patch), labels)) if w.rule == rule]
    assert [w.path for w in got] == [path]
    msg = got[0].message
    assert len(msg) > 40 and any(word in msg for word in ("set ", "use ", "give ", "keep ", "pin ", "lower ",
                                                          "raise ", "allow ")), msg


@pytest.mark.parametrize("rule", NEAR_MISSES)
def test_each_warning_stays_quiet_on_a_near_miss(rule):
    assert rule not in {w.rule for w in warnings_of(obj(merged(NEAR_MISSES[rule])))}


def test_a_predicate_reports_only_its_own_rule():
    """The registry stamps the rule id: a case triggers its own warning, and no other warning's predicate is
    the one that fires for it (each case differs from CLEAN in one respect)."""
    for rule, (patch, _, labels) in CASES.items():
        fired = {w.rule for w in warnings_of(obj(merged(patch), labels))}
        assert rule in fired
        # cases that by nature also trip a neighbour: in-place budget vs no-restarts is exclusive, etc.
        assert len(fired) <= 2, (rule, fired)


def test_registering_an_unknown_or_second_predicate_is_refused():
    with pytest.raises(ValueError, match="not a warning"):
        wr.warns("no.such-warning")(lambda f: iter(()))
    with pytest.raises(ValueError, match="already has a predicate"):
        wr.warns("run-policy.ttl-zero")(lambda f: iter(()))


def test_duplicate_names_in_one_file_are_a_file_warning(tmp_path, capsys):
    f = tmp_path / "two.yaml"
    f.write_text(yaml.safe_dump_all([obj(CLEAN), obj(CLEAN), obj(CLEAN, name="other")]))
    rc = cli.main(["validate", str(f)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("is valid") == 3
    assert "warning [file.duplicate-name]" in err and "document 1" in err
    assert err.count("file.duplicate-name") == 1


def test_validate_lists_warnings_and_exits_0(tmp_path, capsys):
    f = tmp_path / "w.yaml"
    f.write_text(yaml.safe_dump(obj(merged({"runPolicy": {"ttlSecondsAfterFinished": 0},
                                            "training": {"learningRate": 0.05}}))))
    rc = cli.main(["validate", str(f)])
    out, err = capsys.readouterr()
    assert rc == 0 and "is valid" in out
    assert f"{f}: warning [run-policy.ttl-zero] spec.runPolicy.ttlSecondsAfterFinished: 0 deletes" in err
    assert "warning [training.learning-rate-high] spec.training.learningRate: 0.05" in err


def test_an_invalid_spec_gets_errors_not_warnings(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(obj(merged({"runPolicy": {"ttlSecondsAfterFinished": 0},
                                            "parallelism": {"tensorParallelDegree": 3}}))))
    rc = cli.main(["validate", str(f)])
    err = capsys.readouterr().err
    assert rc != 0 and "warning [" not in err


def test_docs_api_lists_every_warning():
    text = (REPO / "docs" / "api.md").read_text()
    assert "## Warnings" in text
    for w in wr.WARNINGS:
        assert f"| {w.id} |" in text, w.id
