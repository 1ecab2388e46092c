"""The admin policy (kubetitan.policy): one table row per knob and case, the file/flag forms, and the CLI."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from support import forkrun
from support.paths import EXAMPLES, load_example
from support.specs import make_lpt
from kubetitan import policy
from kubetitan.policy import ANY, KNOBS, Policy, PolicyError, node_labels
from kubetitan_core.validation import parse

PVC = {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}}


def _lpt(resources=None, checkpoint=None, namespace="ml", scheduling=None):
    lpt, errors = parse(make_lpt({"resources": {"gpusPerNode": 8, **(resources or {})},
                                  "checkpoint": checkpoint or PVC, **({"scheduling": scheduling} if scheduling else {})},
                                 namespace=namespace))
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
    # priorityClasses: none by default (only the cluster's default priority)
    ("priority-system-refused-by-default", Policy(), {"resources": {"priorityClassName": "system-node-critical"}},
     ["spec.resources.priorityClassName"]),
    ("priority-any-class-refused-by-default", Policy(), {"resources": {"priorityClassName": "training-high"}},
     ["spec.resources.priorityClassName"]),
    ("priority-unset-is-cluster-default", Policy(), {}, []),
    ("priority-listed", Policy(priority_classes=("training-high",)),
     {"resources": {"priorityClassName": "training-high"}}, []),
    ("priority-system-refused", Policy(priority_classes=("training-high",)),
     {"resources": {"priorityClassName": "system-node-critical"}}, ["spec.resources.priorityClassName"]),
    ("priority-any", Policy(priority_classes=(ANY,)), {"resources": {"priorityClassName": "system-node-critical"}}, []),
    # imagePrefixes: any by default
    ("image-any-default", Policy(), {"resources": {"image": "anywhere/evil:1"}}, []),
    ("image-prefix", Policy(image_prefixes=("registry.invalid/ml/",)),
     {"resources": {"image": "registry.invalid/ml/trainer:0.1.0"}}, []),
    ("image-other-repo", Policy(image_prefixes=("registry.invalid/ml/",)),
     {"resources": {"image": "registry.invalid/mlx/trainer:0.1.0"}}, ["spec.resources.image"]),
    ("image-none", Policy(image_prefixes=()), {}, ["spec.resources.image"]),
    # tolerationKeys: any key by default
    ("toleration-any-key-default", Policy(),
     {"resources": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}]}}, []),
    ("toleration-listed", Policy(toleration_keys=("dedicated",)),
     {"resources": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}]}}, []),
    ("toleration-unlisted", Policy(toleration_keys=("dedicated",)),
     {"resources": {"tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]}},
     ["spec.resources.tolerations[0]"]),
    ("toleration-operator-own-gpu-not-checked", Policy(toleration_keys=()), {}, []),
    # keylessTolerations: refused by default, even where any key is allowed
    ("keyless-toleration-refused-by-default", Policy(), {"resources": {"tolerations": [{"operator": "Exists"}]}},
     ["spec.resources.tolerations[0]"]),
    ("keyless-toleration-with-effect-refused", Policy(),
     {"resources": {"tolerations": [{"key": "dedicated", "operator": "Exists"},
                                    {"operator": "Exists", "effect": "NoSchedule"}]}},
     ["spec.resources.tolerations[1]"]),
    ("keyless-toleration-allowed", Policy(keyless_tolerations=True),
     {"resources": {"tolerations": [{"operator": "Exists"}]}}, []),
    # nodeLabels: any value of the well-known hardware/topology labels by default, nothing else
    ("labels-zone-default", Policy(), {"resources": {"nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a"}}},
     []),
    ("labels-instance-type-default", Policy(), {"resources": {"instanceType": "p5.48xlarge"}}, []),
    ("labels-team-refused-by-default", Policy(), {"resources": {"nodeSelector": {"dedicated": "team-b"}}},
     ["spec.resources.nodeSelector[dedicated]"]),
    ("labels-hostname-refused-by-default", Policy(),
     {"resources": {"nodeSelector": {"kubernetes.io/hostname": "ip-10-0-0-1"}}},
     ["spec.resources.nodeSelector[kubernetes.io/hostname]"]),
    ("labels-namespace-entry", Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-a"}}}, []),
    ("labels-other-teams-value", Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-b"}}}, ["spec.resources.nodeSelector[dedicated]"]),
    ("labels-other-namespaces-entry", Policy(node_labels=node_labels({"team-b": {"dedicated": ["team-b"]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-b"}}}, ["spec.resources.nodeSelector[dedicated]"]),
    ("labels-namespace-adds-to-star", Policy(node_labels=node_labels({ANY: {"kubernetes.io/arch": [ANY]},
                                                                       "ml": {"dedicated": ["team-a"]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-a", "kubernetes.io/arch": "arm64"}}}, []),
    ("labels-instance-type-restricted", Policy(node_labels=node_labels({ANY: {"node.kubernetes.io/instance-type":
                                                                               ["p4d.24xlarge"]}})),
     {"resources": {"instanceType": "p5.48xlarge"}}, ["spec.resources.instanceType"]),
    ("labels-affinity-required-in", Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [{"key": "dedicated", "operator": "In",
                                                       "values": ["team-a", "team-b"]}]}]}}}}},
     ["spec.resources.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
      ".matchExpressions[0]"]),
    ("labels-affinity-exists-needs-any", Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [{"key": "dedicated", "operator": "Exists"}]}]}}}}},
     ["spec.resources.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
      ".matchExpressions[0]"]),
    ("labels-affinity-notin-allowed-value", Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
         "weight": 1, "preference": {"matchExpressions": [{"key": "dedicated", "operator": "NotIn",
                                                           "values": ["team-a"]}]}}]}}}}, []),
    ("labels-affinity-preferred-refused", Policy(),
     {"resources": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
         "weight": 1, "preference": {"matchExpressions": [{"key": "dedicated", "operator": "In",
                                                           "values": ["team-b"]}]}}]}}}},
     ["spec.resources.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
      ".matchExpressions[0]"]),
    ("labels-affinity-match-fields-node-name", Policy(),
     {"resources": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                  "values": ["ip-10-0-0-1"]}]}]}}}}},
     ["spec.resources.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
      ".matchFields[0]"]),
    ("labels-pod-anti-affinity-not-checked", Policy(),
     {"resources": {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
         "weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                          "labelSelector": {"matchLabels": {"app": "x"}}}}]}}}}, []),
    ("labels-any", Policy(node_labels=node_labels({ANY: {ANY: [ANY]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-b", "kubernetes.io/hostname": "n1"}}}, []),
    ("labels-none", Policy(node_labels=()), {"resources": {"nodeSelector": {"kubernetes.io/arch": "amd64"}}},
     ["spec.resources.nodeSelector[kubernetes.io/arch]"]),
    # schedulerNames: default-scheduler only by default
    ("scheduler-unset", Policy(), {}, []),
    ("scheduler-default-named", Policy(), {"scheduling": {"schedulerName": "default-scheduler"}}, []),
    ("scheduler-volcano-refused-by-default", Policy(), {"scheduling": {"schedulerName": "volcano"}},
     ["spec.scheduling.schedulerName"]),
    ("scheduler-volcano-listed", Policy(scheduler_names=("default-scheduler", "volcano")),
     {"scheduling": {"schedulerName": "volcano"}}, []),
    ("scheduler-any", Policy(scheduler_names=(ANY,)), {"scheduling": {"schedulerName": "my-scheduler"}}, []),
    # s3EndpointPrefixes: any https endpoint by default; AWS's own (no endpoint) always
    ("s3-endpoint-https-default", Policy(), {"checkpoint": {"storage": {"s3": {
        "uri": "s3://ck-bucket/run", "endpoint": "https://minio.storage:9000"}}}}, []),
    ("s3-endpoint-http-refused", Policy(), {"checkpoint": {"storage": {"s3": {
        "uri": "s3://ck-bucket/run", "endpoint": "http://minio.storage:9000"}}}}, ["spec.checkpoint.storage.s3.endpoint"]),
    ("s3-endpoint-http-allowed", Policy(s3_endpoint_prefixes=("https://", "http://minio.storage:9000")),
     {"checkpoint": {"storage": {"s3": {"uri": "s3://ck-bucket/run", "endpoint": "http://minio.storage:9000"}}}}, []),
    ("s3-endpoint-aws-always", Policy(s3_endpoint_prefixes=()), {"checkpoint": {"storage": {"s3": {
        "uri": "s3://ck-bucket/run"}}}}, []),
]


@pytest.mark.parametrize("pol, spec, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_policy_table(pol, spec, want):
    lpt = _lpt(spec.get("resources"), spec.get("checkpoint"), scheduling=spec.get("scheduling"))
    got = policy.check(lpt, pol)
    assert [v.path for v in got] == want
    for v in got:
        assert v.rule.startswith("policy.") and "policy" in v.message
        # what was refused, what is allowed, and what to do: the knob the admin would change is named
        assert "allow" in v.message and "ask the cluster admin" in v.message
        assert f"kubetitan chart's {v.rule}" in v.message


def test_every_knob_has_a_refusing_and_an_accepting_row():
    refused = {c[0] for c in CASES if c[3]}
    accepted = {c[0] for c in CASES if not c[3]}
    for prefix in ("host-path", "sa-", "priority", "image", "toleration", "keyless", "labels", "scheduler",
                   "s3-endpoint"):
        assert any(r.startswith(prefix) for r in refused) and any(a.startswith(prefix) for a in accepted), prefix
    assert [k.attr for k in KNOBS] == [f for f in Policy.__dataclass_fields__]
    assert all(getattr(Policy(), k.attr) == k.default for k in KNOBS)
    # every knob has a check that names it (keylessTolerations shares the toleration check)
    assert {k.key for k in KNOBS} == {name for name, _ in policy.CHECKS} | {"keylessTolerations"}


@pytest.mark.parametrize("pol, spec, want", [
    (Policy(), {"resources": {"priorityClassName": "system-node-critical"}},
     "spec.resources.priorityClassName: priority class system-node-critical is not one this cluster's kubetitan "
     "policy allows (none); use an allowed one or leave it unset (the cluster's default priority), or ask the "
     "cluster admin to add it to the kubetitan chart's policy.priorityClasses"),
    (Policy(), {"resources": {"tolerations": [{"operator": "Exists"}]}},
     "spec.resources.tolerations[0]: a toleration without a key tolerates every taint (any team's nodes, "
     "control-plane nodes, nodes being drained), which this cluster's kubetitan policy does not allow; name the "
     "taint's key (e.g. key: dedicated, operator: Equal, value: <your team>), or ask the cluster admin to set the "
     "kubetitan chart's policy.keylessTolerations: true"),
    (Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"nodeSelector": {"dedicated": "team-b"}}},
     "spec.resources.nodeSelector[dedicated]: node label dedicated=team-b is not one this cluster's kubetitan "
     "policy allows runs in namespace ml to select (allowed: dedicated: team-a); remove it, or ask the cluster "
     "admin to add it to the kubetitan chart's policy.nodeLabels"),
    (Policy(node_labels=node_labels({"ml": {"dedicated": ["team-a"]}})),
     {"resources": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [{"key": "dedicated", "operator": "Exists"}]}]}}}}},
     "spec.resources.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]."
     "matchExpressions[0]: Exists on node label dedicated (it matches every value, and only team-a are allowed) "
     "is not one this cluster's kubetitan policy allows runs in namespace ml to select (allowed: dedicated: "
     "team-a); remove it, or ask the cluster admin to add it to the kubetitan chart's policy.nodeLabels"),
    (Policy(), {"scheduling": {"schedulerName": "volcano"}},
     "spec.scheduling.schedulerName: scheduler volcano is not one this cluster's kubetitan policy allows "
     "(default-scheduler); leave it unset (the default scheduler), or ask the cluster admin to add it to the "
     "kubetitan chart's policy.schedulerNames"),
], ids=["priority", "keyless-toleration", "node-label", "exists", "scheduler"])
def test_refusals_say_what_and_how_to_fix(pol, spec, want):
    (v,) = policy.check(_lpt(spec.get("resources"), scheduling=spec.get("scheduling")), pol)
    assert str(v) == want


def test_messages_name_the_value_and_the_allowed_ones():
    (v,) = policy.check(_lpt({"image": "other/trainer:1"}), Policy(image_prefixes=("mine/",)))
    assert str(v) == ("spec.resources.image: image other/trainer:1 does not start with a prefix this cluster's "
                      "kubetitan policy allows (mine/); push the trainer image there, or ask the cluster admin to "
                      "add it to the kubetitan chart's policy.imagePrefixes")


def test_default_policy_refuses_only_the_hostpath_priority_and_service_account_examples():
    refused = {p.stem: [v.rule for v in policy.check(parse(load_example(p))[0], Policy())] for p in EXAMPLES}
    # the hostPath examples, the 70B one's priority class, and the S3 one, whose pods run as the service account of
    # its IAM role (Pod Identity)
    assert {k: v for k, v in refused.items() if v} == {
        "debug-cpu": ["policy.hostPathPrefixes"], "llama3-1b-h200": ["policy.hostPathPrefixes"],
        "llama3-3b-h200": ["policy.hostPathPrefixes"], "llama3-70b-p5": ["policy.priorityClasses"],
        "llama3-8b-p5-4node-s3": ["policy.serviceAccounts"]}
    allow = Policy(host_path_prefixes=("/var/lib/kubetitan",), priority_classes=("training-high",),
                   service_accounts=("default", "training/llama-training"))
    assert not [p for p in EXAMPLES if policy.check(parse(load_example(p))[0], allow)]


@pytest.mark.parametrize("data, want", [
    (None, Policy()),
    ({}, Policy()),
    ({"hostPathPrefixes": ["/data"]}, Policy(host_path_prefixes=("/data",))),
    ({"policy": {"serviceAccounts": ["a", "ml/b"]}, "replicaCount": 2}, Policy(service_accounts=("a", "ml/b"))),
    ({"imagePrefixes": None}, Policy()),
    ({"tolerationKeys": []}, Policy(toleration_keys=())),
    ({"keylessTolerations": True, "schedulerNames": ["volcano"]},
     Policy(keyless_tolerations=True, scheduler_names=("volcano",))),
    ({"nodeLabels": {"team-a": {"dedicated": ["team-a"]}}}, Policy(node_labels=node_labels({"team-a": {
        "dedicated": ["team-a"]}}))),
    ({"nodeLabels": None}, Policy()),
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
    ({"keylessTolerations": "yes"}, "policy.keylessTolerations: expected true or false"),
    ({"nodeLabels": ["dedicated"]}, "policy.nodeLabels: expected a mapping of namespace"),
    ({"nodeLabels": {"Team_A": {}}}, "'Team_A' is not a namespace name"),
    ({"nodeLabels": {"*": ["dedicated"]}}, "policy.nodeLabels.*: expected a mapping of label key"),
    ({"nodeLabels": {"*": {"bad key!": ["*"]}}}, "'bad key!' is not a label key"),
    ({"nodeLabels": {"*": {"dedicated": "team-a"}}}, "policy.nodeLabels.*.dedicated: expected a list of values"),
])
def test_malformed_policies_say_which_key(data, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        policy.load(data)


def test_flags_round_trip_and_an_empty_flag_allows_nothing():
    p = argparse.ArgumentParser()
    policy.add_flags(p)
    pol = Policy(host_path_prefixes=("/a", "/b"), service_accounts=("x", "ml/y"), priority_classes=(),
                 image_prefixes=("r/",), toleration_keys=(ANY,), keyless_tolerations=True,
                 node_labels=node_labels({ANY: {"kubernetes.io/arch": [ANY]}, "ml": {"dedicated": ["a", "b"]}}),
                 scheduler_names=("default-scheduler", "volcano"))
    assert policy.from_flags(p.parse_args(policy.flag_args(pol))) == pol
    assert policy.from_flags(p.parse_args([])) == Policy()
    assert policy.from_flags(p.parse_args(["--policy-service-accounts="])).service_accounts == ()
    assert policy.from_flags(p.parse_args(["--policy-node-labels={}"])).node_labels == ()


@pytest.mark.parametrize("flag, message", [
    ("--policy-keyless-tolerations=maybe", "--policy-keyless-tolerations: expected true or false"),
    ("--policy-node-labels=dedicated=a", "--policy-node-labels: not JSON"),
    ("--policy-node-labels=[1]", "policy.nodeLabels: expected a mapping"),
])
def test_malformed_flags_say_which_flag(flag, message):
    p = argparse.ArgumentParser()
    policy.add_flags(p)
    with pytest.raises(PolicyError) as e:
        policy.from_flags(p.parse_args([flag]))
    assert message in str(e.value)


def test_operator_flags_are_the_policy_flags():
    from kubetitan import runner

    a = runner.build_parser().parse_args(["-A", "--policy-host-path-prefixes=/var/lib/kubetitan",
                                            "--policy-image-prefixes=r/,s/"])
    opts = runner.options_from_args(a)
    assert opts.policy == Policy(host_path_prefixes=("/var/lib/kubetitan",), image_prefixes=("r/", "s/"))
    assert runner.options_from_args(runner.build_parser().parse_args(["-A"])).policy == Policy()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", *args], capture_output=True, text=True, timeout=60)


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


def test_each_knob_is_checked_by_one_row():
    """One CHECKS row per knob (a row listed twice reports every violation twice)."""
    names = [name for name, _ in policy.CHECKS]
    assert len(names) == len(set(names)), names
