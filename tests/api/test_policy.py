"""The admin policy (kubetitan.policy): one table row per knob and case, the file/flag forms, and the CLI."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.paths import EXAMPLES, load_example
from support.specs import make_lpt
from kubetitan import policy
from kubetitan.policy import ANY, KNOBS, Policy, PolicyError
from kubetitan_core.validation import parse

PVC = {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}}


def _lpt(resources=None, checkpoint=None, namespace="ml"):
    lpt, errors = parse(make_lpt({"resources": {"gpusPerNode": 8, **(resources or {})},
                                  "checkpoint": checkpoint or PVC}, namespace=namespace))
    # validation refuses a '..' hostPath too (rule path.no-dot-dot); the policy must refuse it on its own as well
    assert lpt is not None and [e.rule for e in errors] in ([], ["path.no-dot-dot"]), errors
    return lpt


# (id, policy, spec parts, expected violation paths)
CASES = [
    # hostPathPrefixes: none by default
    ("host-path-default-refused", Policy(), {"checkpoint": {"storage": {"hostPath": "/var/lib/kubetitan/r"}}},
     ["spec.checkpoint.storage.hostPath"]),
    ("host-path-under-prefix", Policy(host_path_prefixes=("/var/lib/kubetitan",)),
     {"checkpoint": {"storage": {"hostPath": "/var/lib/kubetitan/r"}}}, []),
    ("host-path-is-prefix", Policy(host_path_prefixes=("/var/lib/kubetitan/",)),
     {"checkpoint": {"storage": {"hostPath": "/var/lib/kubetitan"}}}, []),
    ("host-path-sibling-refused", Policy(host_path_prefixes=("/var/lib/kubetitan",)),
     {"checkpoint": {"storage": {"hostPath": "/var/lib/kubetitan-other/r"}}}, ["spec.checkpoint.storage.hostPath"]),
    ("host-path-root-refused", Policy(host_path_prefixes=("/data",)),
     {"checkpoint": {"storage": {"hostPath": "/"}}}, ["spec.checkpoint.storage.hostPath"]),
    ("host-path-dotdot-escape", Policy(host_path_prefixes=("/data",)),
     {"checkpoint": {"storage": {"hostPath": "/data/../etc"}}}, ["spec.checkpoint.storage.hostPath"]),
    ("host-path-any", Policy(host_path_prefixes=(ANY,)), {"checkpoint": {"storage": {"hostPath": "/x"}}}, []),
    ("pvc-needs-no-host-path", Policy(), {}, []),
    # serviceAccounts: only "default" by default
    ("sa-unset-is-default", Policy(), {}, []),
    ("sa-default-refuses-others", Policy(), {"resources": {"serviceAccountName": "s3-writer"}},
     ["spec.resources.serviceAccountName"]),
    ("sa-by-name", Policy(service_accounts=("s3-writer",)), {"resources": {"serviceAccountName": "s3-writer"}}, []),
    ("sa-by-namespace", Policy(service_accounts=("ml/s3-writer",)),
     {"resources": {"serviceAccountName": "s3-writer"}}, []),
    ("sa-other-namespace", Policy(service_accounts=("team-b/s3-writer",)),
     {"resources": {"serviceAccountName": "s3-writer"}}, ["spec.resources.serviceAccountName"]),
    ("sa-unset-when-default-not-allowed", Policy(service_accounts=("trainer",)), {},
     ["spec.resources.serviceAccountName"]),
    ("sa-any", Policy(service_accounts=(ANY,)), {"resources": {"serviceAccountName": "anything"}}, []),
    # priorityClasses: any by default
    ("priority-any-default", Policy(), {"resources": {"priorityClassName": "system-node-critical"}}, []),
    ("priority-listed", Policy(priority_classes=("training-high",)),
     {"resources": {"priorityClassName": "training-high"}}, []),
    ("priority-system-refused", Policy(priority_classes=("training-high",)),
     {"resources": {"priorityClassName": "system-node-critical"}}, ["spec.resources.priorityClassName"]),
    ("priority-unset-ok", Policy(priority_classes=()), {}, []),
    # imagePrefixes: any by default
    ("image-any-default", Policy(), {"resources": {"image": "anywhere/evil:1"}}, []),
    ("image-prefix", Policy(image_prefixes=("registry.invalid/ml/",)),
     {"resources": {"image": "registry.invalid/ml/trainer:0.1.0"}}, []),
    ("image-other-repo", Policy(image_prefixes=("registry.invalid/ml/",)),
     {"resources": {"image": "registry.invalid/mlx/trainer:0.1.0"}}, ["spec.resources.image"]),
    ("image-none", Policy(image_prefixes=()), {}, ["spec.resources.image"]),
    # tolerationKeys: any by default
    ("toleration-any-default", Policy(), {"resources": {"tolerations": [{"operator": "Exists"}]}}, []),
    ("toleration-listed", Policy(toleration_keys=("dedicated",)),
     {"resources": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}]}}, []),
    ("toleration-keyless-refused", Policy(toleration_keys=("dedicated",)),
     {"resources": {"tolerations": [{"key": "dedicated", "operator": "Exists"}, {"operator": "Exists"}]}},
     ["spec.resources.tolerations[1]"]),
    ("toleration-unlisted", Policy(toleration_keys=("dedicated",)),
     {"resources": {"tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}},
     ["spec.resources.tolerations[0]"]),
    ("toleration-operator-own-gpu-not-checked", Policy(toleration_keys=()), {}, []),
]


@pytest.mark.parametrize("pol, spec, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_policy_table(pol, spec, want):
    lpt = _lpt(spec.get("resources"), spec.get("checkpoint"))
    got = policy.check(lpt, pol)
    assert [v.path for v in got] == want
    for v in got:
        assert v.rule.startswith("policy.") and "policy" in v.message
        # what was refused, what is allowed, and what to do
        assert "allow" in v.message and ("ask the cluster admin" in v.message)


def test_every_knob_has_a_refusing_and_an_accepting_row():
    refused = {c[0] for c in CASES if c[3]}
    accepted = {c[0] for c in CASES if not c[3]}
    for prefix in ("host-path", "sa-", "priority", "image", "toleration"):
        assert any(r.startswith(prefix) for r in refused) and any(a.startswith(prefix) for a in accepted), prefix
    assert [k.attr for k in KNOBS] == [f for f in Policy.__dataclass_fields__]
    assert all(getattr(Policy(), k.attr) == k.default for k in KNOBS)


def test_messages_name_the_value_and_the_allowed_ones():
    (v,) = policy.check(_lpt({"image": "other/trainer:1"}), Policy(image_prefixes=("mine/",)))
    assert str(v) == ("spec.resources.image: image other/trainer:1 does not start with a prefix this cluster's "
                      "kubetitan policy allows (mine/); push the trainer image there, or ask the cluster admin to "
                      "add it to the kubetitan chart's policy.imagePrefixes")


def test_default_policy_refuses_only_the_hostpath_examples():
    refused = {p.stem for p in EXAMPLES if policy.check(parse(load_example(p))[0], Policy())}
    assert refused == {"debug-cpu", "llama3-1b-h200", "llama3-3b-h200"}
    allow = Policy(host_path_prefixes=("/var/lib/kubetitan",))
    assert not [p for p in EXAMPLES if policy.check(parse(load_example(p))[0], allow)]


@pytest.mark.parametrize("data, want", [
    (None, Policy()),
    ({}, Policy()),
    ({"hostPathPrefixes": ["/data"]}, Policy(host_path_prefixes=("/data",))),
    ({"policy": {"serviceAccounts": ["a", "ml/b"]}, "replicaCount": 2}, Policy(service_accounts=("a", "ml/b"))),
    ({"imagePrefixes": None}, Policy()),
    ({"tolerationKeys": []}, Policy(toleration_keys=())),
])
def test_load_reads_the_policy_block_or_a_values_file(data, want):
    assert policy.load(data) == want


@pytest.mark.parametrize("data, message", [
    ({"hostPathPrefix": ["/x"]}, "unknown key 'hostPathPrefix'"),
    ({"hostPathPrefixes": "/x"}, "policy.hostPathPrefixes: expected a list"),
    ({"hostPathPrefixes": ["data"]}, "'data' is not an absolute path"),
    ({"hostPathPrefixes": ["/data/../etc"]}, "without '..'"),
    ({"serviceAccounts": [""]}, "expected a list of non-empty strings"),
    ([1, 2], "expected a mapping"),
])
def test_malformed_policies_say_which_key(data, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        policy.load(data)


def test_flags_round_trip_and_an_empty_flag_allows_nothing():
    p = argparse.ArgumentParser()
    policy.add_flags(p)
    pol = Policy(host_path_prefixes=("/a", "/b"), service_accounts=("x", "ml/y"), priority_classes=(),
                 image_prefixes=("r/",), toleration_keys=(ANY,))
    assert policy.from_flags(p.parse_args(policy.flag_args(pol))) == pol
    assert policy.from_flags(p.parse_args([])) == Policy()
    assert policy.from_flags(p.parse_args(["--policy-service-accounts="])).service_accounts == ()


def test_operator_flags_are_the_policy_flags():
    from kubetitan import handlers

    a = handlers.build_parser().parse_args(["-A", "--policy-host-path-prefixes=/var/lib/kubetitan",
                                            "--policy-image-prefixes=r/,s/"])
    opts = handlers.options_from_args(a)
    assert opts.policy == Policy(host_path_prefixes=("/var/lib/kubetitan",), image_prefixes=("r/", "s/"))
    assert handlers.options_from_args(handlers.build_parser().parse_args(["-A"])).policy == Policy()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kubetitan.cli", *args], capture_output=True, text=True, timeout=60)


def test_validate_with_policy_refuses_with_the_field_and_the_fix(tmp_path: Path):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(make_lpt({"resources": {"serviceAccountName": "s3-writer"}, "checkpoint": {
        "storage": {"hostPath": "/"}}})))
    pol = tmp_path / "policy.yaml"
    pol.write_text("hostPathPrefixes: [/var/lib/kubetitan]\n")
    plain = _cli("validate", str(run))
    assert plain.returncode == 0 and "is valid" in plain.stdout
    r = _cli("validate", "--policy", str(pol), str(run))
    assert r.returncode == 1, r
    assert f"{run}: LlamaPretrain run is valid but the policy {pol} refuses it (2 error(s)):" in r.stderr
    assert "  - spec.checkpoint.storage.hostPath: hostPath / is outside the directories" in r.stderr
    assert "  - spec.resources.serviceAccountName: service account ml/s3-writer is not one" in r.stderr
    assert "Traceback" not in r.stderr
    pol.write_text("policy:\n  hostPathPrefixes: ['/']\n  serviceAccounts: [s3-writer]\n")  # a values file
    ok = _cli("validate", "--policy", str(pol), str(run))
    assert ok.returncode == 0 and "is valid" in ok.stdout, ok


def test_validate_with_a_malformed_policy_is_a_usage_error(tmp_path: Path):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(make_lpt({"checkpoint": PVC})))
    pol = tmp_path / "policy.yaml"
    pol.write_text("imagePrefix: [x/]\n")
    r = _cli("validate", "--policy", str(pol), str(run))
    assert r.returncode == 2 and f"error: {pol}: policy: unknown key 'imagePrefix'" in r.stderr, r
