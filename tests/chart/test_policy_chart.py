"""The chart's ``policy`` values become the operator's ``--policy-*`` flags, parsed by the operator itself."""

from __future__ import annotations

import pytest

from chartlib import CHART, by_kind, helm, render, values_args
from kubetitan import runner
from kubetitan import policy
from kubetitan.policy import ANY, KNOBS, Policy, node_labels
from support import yamlio


def _operator_policy(files=(), sets=()) -> Policy:
    (c,) = by_kind(render(list(files), list(sets)), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    return runner.options_from_args(runner.build_parser().parse_args(c["args"])).policy


def _args() -> list[str]:
    (c,) = by_kind(render(), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    return c["args"]


def test_the_chart_passes_every_knob_as_its_flag():
    assert sorted(a.split("=", 1)[0] for a in _args() if a.startswith("--policy-")) == sorted(k.flag for k in KNOBS)


OPEN_DEFAULTS_OF_ISSUE_30 = [
    ({"resources": {"priorityClassName": "system-node-critical"}}, "policy.priorityClasses"),
    ({"resources": {"tolerations": [{"operator": "Exists"}]}}, "policy.keylessTolerations"),
    ({"resources": {"nodeSelector": {"dedicated": "team-b"}}}, "policy.nodeLabels"),
    ({"scheduling": {"schedulerName": "my-scheduler"}}, "policy.schedulerNames"),
]


@pytest.mark.parametrize("spec, rule", OPEN_DEFAULTS_OF_ISSUE_30, ids=[r for _, r in OPEN_DEFAULTS_OF_ISSUE_30])
def test_the_chart_defaults_refuse_what_was_open(spec, rule):
    """With `helm install`'s defaults, the operator's policy (from the rendered flags) refuses each of these."""
    from kubetitan_core.validation import parse

    pol = runner.options_from_args(runner.build_parser().parse_args(_args())).policy
    obj = {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", "metadata": {"name": "r", "namespace": "ml"},
           "spec": {"model": {"flavor": "debug"}, "training": {"steps": 100, "warmupSteps": 10},
                    "data": {"source": "synthetic"}, "tokenizer": {"source": "builtin"},
                    "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}},
                    "resources": {"gpusPerNode": 0}, **spec}}
    obj["spec"]["resources"] = {"gpusPerNode": 0, **spec.get("resources", {})}
    lpt, errors = parse(obj)
    assert lpt is not None and not errors, errors
    assert [v.rule for v in policy.check(lpt, pol)] == [rule]
    assert not policy.check(lpt, Policy(priority_classes=(ANY,), keyless_tolerations=True,
                                        node_labels=node_labels({ANY: {ANY: [ANY]}}), scheduler_names=(ANY,)))


def test_chart_defaults_are_the_policy_defaults():
    assert _operator_policy() == Policy()
    values = yamlio.load((CHART / "values.yaml").read_text())["policy"]
    assert values == policy.default_values()
    assert {k: v for k, v in values.items() if k != "nodeLabels"} == {
        "hostPathPrefixes": [], "serviceAccounts": ["default"], "priorityClasses": [], "imagePrefixes": [ANY],
        "tolerationKeys": [ANY], "keylessTolerations": False, "schedulerNames": ["default-scheduler"],
        "s3EndpointPrefixes": ["https://"],
        "codeLoadingEnv": []}
    assert set(values["nodeLabels"]) == {ANY} and all(v == [ANY] for v in values["nodeLabels"][ANY].values())


@pytest.mark.parametrize("sets, want", [
    (["policy.hostPathPrefixes={/var/lib/kubetitan,/data}"], Policy(host_path_prefixes=("/var/lib/kubetitan", "/data"))),
    (["policy.serviceAccounts={default,ml/s3-writer}"], Policy(service_accounts=("default", "ml/s3-writer"))),
    (["policy.priorityClasses={training-high,training-low}"],
     Policy(priority_classes=("training-high", "training-low"))),
    (["policy.priorityClasses=null"], Policy()),
    (["policy.imagePrefixes={my-registry.invalid/ml/}"], Policy(image_prefixes=("my-registry.invalid/ml/",))),
    (["policy.tolerationKeys={dedicated,nvidia.com/gpu}"], Policy(toleration_keys=("dedicated", "nvidia.com/gpu"))),
    (["policy.keylessTolerations=true"], Policy(keyless_tolerations=True)),
    (["policy.schedulerNames={default-scheduler,volcano}"], Policy(scheduler_names=("default-scheduler", "volcano"))),
], ids=["host-path", "service-accounts", "priority-classes", "priority-null-is-default", "images", "tolerations",
        "keyless-tolerations", "schedulers"])
def test_each_policy_value_reaches_the_operator(sets, want):
    assert _operator_policy(sets=sets) == want


def test_an_empty_list_allows_nothing(tmp_path):
    values = tmp_path / "v.yaml"
    values.write_text("policy:\n  serviceAccounts: []\n  imagePrefixes: []\n")
    docs = [d for d in yamlio.load_all(helm("template", "kt", str(CHART), "-f", str(values)).stdout) if d]
    (c,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert "--policy-service-accounts=" in c["args"] and "--policy-image-prefixes=" in c["args"]
    pol = runner.options_from_args(runner.build_parser().parse_args(c["args"])).policy
    assert pol == Policy(service_accounts=(), image_prefixes=())


def test_node_labels_per_namespace_add_to_the_defaults(tmp_path):
    """Helm merges maps: a namespace's entry adds to the default "*" entry; "*": null drops the defaults."""
    values = tmp_path / "v.yaml"
    values.write_text("policy:\n  nodeLabels:\n    team-a:\n      dedicated: [team-a]\n"
                      "    team-b:\n      dedicated: [team-b, shared]\n")
    want = {**policy.node_labels_dict(policy.DEFAULT_NODE_LABELS),
            "team-a": {"dedicated": ["team-a"]}, "team-b": {"dedicated": ["team-b", "shared"]}}
    assert _operator_policy(files=[str(values)]) == Policy(node_labels=node_labels(want))
    only = tmp_path / "only.yaml"  # another file: chartlib caches a rendering by its arguments
    only.write_text("policy:\n  nodeLabels:\n    '*': null\n    team-a:\n      dedicated: [team-a]\n")
    assert _operator_policy(files=[str(only)]) == Policy(node_labels=node_labels({"team-a": {"dedicated": ["team-a"]}}))


@pytest.mark.parametrize("sets, message", [
    (["policy.hostPathPrefixes={relative/dir}"], "policy.hostPathPrefixes.0: Does not match pattern"),
    (["policy.serviceAccounts={Bad_SA}"], "policy.serviceAccounts.0: Does not match pattern"),
    (["policy.imagePrefixes={a b}"], "policy.imagePrefixes.0: Does not match pattern"),
    (["policy.hostPathPrefix={/x}"], "Additional property hostPathPrefix is not allowed"),
    (["policy.keylessTolerations=yes"], "policy.keylessTolerations: Invalid type. Expected: boolean"),
    (["policy.schedulerNames={Volcano_X}"], "policy.schedulerNames.0: Does not match pattern"),
    (["policy.nodeLabels.team-a=x"], "policy.nodeLabels.team-a: Invalid type. Expected: object"),
    (["policy.nodeLabels.team-a.dedicated=x"], "policy.nodeLabels.team-a.dedicated: Invalid type. Expected: array"),
], ids=["relative-host-path", "bad-sa", "space-in-image", "typo", "keyless-not-bool", "bad-scheduler",
        "labels-not-a-map", "label-values-not-a-list"])
def test_bad_policy_values_fail_helm_with_the_path(sets, message):
    proc = helm("template", "kt", str(CHART), *values_args([], sets), check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
