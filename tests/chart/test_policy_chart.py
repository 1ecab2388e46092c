"""The chart's ``policy`` values become the operator's ``--policy-*`` flags, parsed by the operator itself."""

from __future__ import annotations

import pytest
import yaml

from chartlib import CHART, by_kind, helm, render, values_args
from kubetitan import handlers
from kubetitan.policy import ANY, Policy


def _operator_policy(files=(), sets=()) -> Policy:
    (c,) = by_kind(render(list(files), list(sets)), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    return handlers.options_from_args(handlers.build_parser().parse_args(c["args"])).policy


def test_chart_defaults_are_the_policy_defaults():
    assert _operator_policy() == Policy()
    values = yaml.safe_load((CHART / "values.yaml").read_text())["policy"]
    assert values == {"hostPathPrefixes": [], "serviceAccounts": ["default"], "priorityClasses": [ANY],
                      "imagePrefixes": [ANY], "tolerationKeys": [ANY], "s3EndpointPrefixes": ["https://"]}


@pytest.mark.parametrize("sets, want", [
    (["policy.hostPathPrefixes={/var/lib/kubetitan,/data}"], Policy(host_path_prefixes=("/var/lib/kubetitan", "/data"))),
    (["policy.serviceAccounts={default,ml/s3-writer}"], Policy(service_accounts=("default", "ml/s3-writer"))),
    (["policy.priorityClasses={training-high,training-low}"],
     Policy(priority_classes=("training-high", "training-low"))),
    (["policy.priorityClasses=null"], Policy()),
    (["policy.imagePrefixes={my-registry.invalid/ml/}"], Policy(image_prefixes=("my-registry.invalid/ml/",))),
    (["policy.tolerationKeys={dedicated,nvidia.com/gpu}"], Policy(toleration_keys=("dedicated", "nvidia.com/gpu"))),
    (["policy.s3EndpointPrefixes={https://,http://minio.storage:9000}"],
     Policy(s3_endpoint_prefixes=("https://", "http://minio.storage:9000"))),
], ids=["host-path", "service-accounts", "priority-classes", "priority-null-is-default", "images", "tolerations", "s3-endpoints"])
def test_each_policy_value_reaches_the_operator(sets, want):
    assert _operator_policy(sets=sets) == want


def test_an_empty_list_allows_nothing(tmp_path):
    values = tmp_path / "v.yaml"
    values.write_text("policy:\n  serviceAccounts: []\n  imagePrefixes: []\n")
    docs = [d for d in yaml.safe_load_all(helm("template", "kt", str(CHART), "-f", str(values)).stdout) if d]
    (c,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert "--policy-service-accounts=" in c["args"] and "--policy-image-prefixes=" in c["args"]
    pol = handlers.options_from_args(handlers.build_parser().parse_args(c["args"])).policy
    assert pol == Policy(service_accounts=(), image_prefixes=())


@pytest.mark.parametrize("sets, message", [
    (["policy.hostPathPrefixes={relative/dir}"], "policy.hostPathPrefixes.0: Does not match pattern"),
    (["policy.serviceAccounts={Bad_SA}"], "policy.serviceAccounts.0: Does not match pattern"),
    (["policy.imagePrefixes={a b}"], "policy.imagePrefixes.0: Does not match pattern"),
    (["policy.hostPathPrefix={/x}"], "Additional property hostPathPrefix is not allowed"),
], ids=["relative-host-path", "bad-sa", "space-in-image", "typo"])
def test_bad_policy_values_fail_helm_with_the_path(sets, message):
    proc = helm("template", "kt", str(CHART), *values_args([], sets), check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
