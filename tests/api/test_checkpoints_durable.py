"""The ``checkpoint.no-volume`` and unknown-instance-type rows of the warning table (``kubetitan_core.warning_rules``)
and the ``CheckpointsDurable`` condition computed from the spec: one row per case, with the warning's rule, Event
reason and the fix in its message. The whole table is tested in test_warnings.py."""

from __future__ import annotations

import pytest

from kubetitan import conditions as C
from kubetitan_core import warning_rules
from kubetitan_core.validation import parse
from support import forkrun
from support.specs import make_lpt

SHOWN = {"checkpoint.no-volume", "resources.unknown-instance-type"}
"""The rows this file is about (a spec here may trip others, e.g. a pinned-image rule, which test_warnings covers)."""


def _warnings(lpt):
    return [(w, warning_rules.RULE_BY_ID[w.rule].reason) for w in warning_rules.warnings_for(lpt) if w.rule in SHOWN]

PVC = {"persistentVolumeClaim": {"claimName": "ck"}}
S3 = {"s3": {"uri": "s3://my-bucket/run-1", "region": "us-west-2"}}


def _spec(checkpoint=None, resources=None, run_policy=None):
    spec = {"model": {"flavor": "debug"}, "training": {"steps": 100, "warmupSteps": 10}, "parallelism": {"dataParallelShardDegree": -1},
            "data": {"source": "synthetic"}, "tokenizer": {"source": "builtin"},
            "resources": {"gpusPerNode": 0, "processesPerNode": 1, **(resources or {})},
            "checkpoint": checkpoint if checkpoint is not None else {"storage": PVC}}
    if run_policy is not None:
        spec["runPolicy"] = run_policy
    lpt, errors = parse(make_lpt(spec))
    assert lpt is not None and not errors, errors
    return lpt


# (id, spec parts, expected (rule, reason, path) of each warning, CheckpointsDurable (status, reason))
CASES = [
    ("single-node-no-volume", {"checkpoint": {}},
     [("checkpoint.no-volume", "NoCheckpointVolume", "spec.checkpoint.storage")], ("False", "NoCheckpointVolume")),
    ("single-node-no-volume-no-restarts", {"checkpoint": {}, "run_policy": {"maxRestarts": 0}},
     [("checkpoint.no-volume", "NoCheckpointVolume", "spec.checkpoint.storage")], ("False", "NoCheckpointVolume")),
    ("single-node-pvc", {}, [], ("True", "CheckpointVolume")),
    ("single-node-host-path", {"checkpoint": {"storage": {"hostPath": "/var/lib/kubetitan/run"}}}, [],
     ("True", "CheckpointVolume")),
    ("checkpoints-off", {"checkpoint": {"enabled": False}, "run_policy": {"maxRestarts": 0}}, [],
     ("False", "CheckpointsDisabled")),
    ("multi-node-pvc", {"resources": {"nodes": 2}}, [], ("True", "CheckpointVolume")),
    ("single-node-s3", {"checkpoint": {"storage": S3}}, [], ("True", "CheckpointObjectStore")),
    ("multi-node-s3", {"checkpoint": {"storage": S3}, "resources": {"nodes": 2}}, [], ("True", "CheckpointObjectStore")),
    ("unknown-instance-type", {"resources": {"instanceType": "x9.fake"}},
     [("resources.unknown-instance-type", "UnknownInstanceType", "spec.resources.instanceType")],
     ("True", "CheckpointVolume")),
    ("both", {"checkpoint": {}, "resources": {"instanceType": "x9.fake"}},
     [("resources.unknown-instance-type", "UnknownInstanceType", "spec.resources.instanceType"),
      ("checkpoint.no-volume", "NoCheckpointVolume", "spec.checkpoint.storage")], ("False", "NoCheckpointVolume")),
]


@pytest.mark.parametrize("parts, want, durable", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_warning_table(parts, want, durable):
    lpt = _spec(parts.get("checkpoint"), parts.get("resources"), parts.get("run_policy"))
    got = _warnings(lpt)
    assert [(w.rule, reason, w.path) for w, reason in got] == want
    status, reason, message = C.checkpoints_durable(lpt.spec)
    assert (status, reason) == durable
    assert message


def test_both_rows_have_a_case_and_a_predicate():
    fired = {rule for c in CASES for rule, _, _ in c[2]}
    assert fired == SHOWN <= set(warning_rules.WARNING_CHECKS)
    assert all(r.reason[0].isupper() and " " not in r.reason for r in warning_rules.WARNINGS)


def test_no_volume_warning_says_what_is_lost_and_how_to_fix_it():
    ((w, _),) = _warnings(_spec({}))
    assert str(w) == (
        "spec.checkpoint.storage: checkpoints are saved into the pod's own filesystem at /checkpoints: they survive "
        "an in-place restart, but a re-created pod (node failure, eviction, a restart that re-creates the gang) "
        "starts again from step 0 (runPolicy.maxRestarts is 10), and large saves fill the node's ephemeral storage "
        "(the kubelet evicts the pod); set checkpoint.storage.persistentVolumeClaim (or hostPath where the admin "
        "policy allows it), or checkpoint.enabled: false and runPolicy.maxRestarts: 0 for a throw-away run")
    assert C.checkpoints_durable(_spec({}).spec) == ("False", "NoCheckpointVolume", w.message)


def test_validate_prints_the_warning_and_still_accepts_the_run(tmp_path):
    import subprocess
    import sys

    import yaml

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                   "metadata": {"name": "run"}, "spec": {"model": {"flavor": "debug"},
                                   "training": {"steps": 100, "warmupSteps": 10}, "data": {"source": "synthetic"},
                                   "tokenizer": {"source": "builtin"}, "resources": {"gpusPerNode": 0}}}))
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "validate", str(run)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "is valid" in r.stdout, r
    assert f"{run}: warning [checkpoint.no-volume] spec.checkpoint.storage: checkpoints are saved into the pod's own filesystem at /checkpoints" in r.stderr


def test_validate_does_not_warn_about_the_pods_filesystem_for_checkpoints_in_s3(tmp_path):
    import subprocess
    import sys

    import yaml

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                   "metadata": {"name": "run"}, "spec": {"model": {"flavor": "debug"},
                                   "training": {"steps": 100, "warmupSteps": 10}, "data": {"source": "synthetic"},
                                   "tokenizer": {"source": "builtin"}, "resources": {"gpusPerNode": 0},
                                   "checkpoint": {"storage": S3}}}))
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "validate", str(run)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "is valid" in r.stdout, r
    assert "checkpoint.no-volume" not in r.stderr and "pod's own filesystem" not in r.stderr, r.stderr
