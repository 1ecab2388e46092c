"""Fields that become pod fields: valid edge values are accepted and make pods the API server admits;
typos and malformed values are refused up front with the spec path (the refusals are in invalid_specs.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.paths import REPO
from support.specs import make_lpt
from support import yamlio
from kmockx.validation import builtin_errors
from kubetitan_core import contract
from kubetitan import plan
from kubetitan_core.validation import parse

CORPUS = yamlio.load((Path(__file__).parent / "invalid_specs.yaml").read_text())

EDGE = {
    "env-field-and-secret-refs": {"resources": {"env": [
        {"name": "NCCL_DEBUG", "value": "INFO"},  # replaces the operator's default: allowed
        {"name": "MY.VAR-1", "value": ""},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "S", "valueFrom": {"secretKeyRef": {"name": "a.b-c", "key": "x_1.y", "optional": True}}},
        {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "containerName": "trainer"}}},
    ]}},
    "hf-token-from-env-without-token-secret-ref": {"tokenizer": {"source": "huggingface", "repo": "a/b"},
                                                  "resources": {"env": [{"name": "HF_TOKEN", "valueFrom": {
                                                      "secretKeyRef": {"name": "hf", "key": "token"}}}]}},
    "tolerations-every-form": {"resources": {"tolerations": [
        {"operator": "Exists"},
        {"key": "example.com/pool", "operator": "Equal", "value": "a", "effect": "NoSchedule"},
        {"key": "k", "value": "v"},
        {"key": "k2", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
    ]}},
    "affinity-full": {"resources": {"affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]},
                {"key": "gpu-count", "operator": "Gt", "values": ["3"]},
                {"key": "spot", "operator": "DoesNotExist"}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["b"]}]}}]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "other"}}}}]},
    }}},
    "names-at-their-limits": {
        "resources": {"nodeSelector": {"example.com/" + "p" * 63: "v" * 63, "plain": ""},
                      "image": "registry.example.com:5000/org/kubetitan-trainer:0.1.0-rc1@sha256:" + "a" * 64,
                      "imagePullSecrets": ["a" * 253], "serviceAccountName": "trainer.sa",
                      "priorityClassName": "high-priority"},
        "scheduling": {"schedulerName": "volcano", "queueName": "team_a.q-1"},
        "tokenizer": {"source": "huggingface", "repo": "a/b", "tokenSecretRef": {"name": "hf", "key": ".token"}},
        "checkpoint": {"mountPath": "/ckpt", "storage": {"persistentVolumeClaim": {"claimName": "c" * 253}}},
        "data": {"volume": {"claimName": "d"}, "mountPath": "/data/"},
    },
    "mounts-side-by-side": {"checkpoint": {"mountPath": "/dev/shm2", "storage": {"hostPath": "/var/lib/kubetitan"}},
                            "data": {"volume": {"claimName": "d"}, "mountPath": "/etc/kubetitan-data"}},
    "custom-vocab-1024-builtin-tokenizer": {"model": {"flavor": "custom", "custom": {
        "dim": 256, "nLayers": 2, "nHeads": 4, "vocabSize": 1024}}, "tokenizer": {"source": "builtin"},
        "resources": {"gpusPerNode": 0}},
    "custom-vocab-exactly-the-builtin-tokenizer": {"model": {"flavor": "custom", "custom": {
        "dim": 256, "nLayers": 2, "nHeads": 4, "vocabSize": contract.BUILTIN_TOKENIZER_VOCAB}},
        "resources": {"gpusPerNode": 0}},
}


@pytest.mark.parametrize("spec", EDGE.values(), ids=EDGE.keys())
def test_edge_values_are_accepted_and_their_pods_admitted(spec):
    lpt, errors = parse(make_lpt(spec))
    assert errors == [], "\n".join(map(str, errors))
    for child in plan.attempt_children(lpt, 0):
        causes, unknown = builtin_errors(child)
        assert causes == [] and unknown == [], (child["kind"], causes, unknown)


SCHEMA_CASES = [c for c in CORPUS if c["errors"][0]["rule"] in ("pod.env", "pod.tolerations", "pod.affinity")
                and c["name"] not in ("env-bad-name", "env-value-and-value-from", "env-secret-bad-name",
                                      "env-secret-bad-key", "toleration-exists-with-value", "toleration-bad-effect",
                                      "affinity-bad-operator", "env-field-path-unsupported", "env-resource-unsupported",
                                      "affinity-no-node-selector-terms", "affinity-match-fields-label")]


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=[c["name"] for c in SCHEMA_CASES])
def test_schema_refusals_are_what_the_api_server_would_refuse_at_pod_create(case):
    """Without the check the operator would create a pod that the (strict) API server refuses or prunes."""
    lpt = parse(make_lpt({}))[0]
    raw = make_lpt(case["spec"])["spec"]["resources"]
    pod = plan.pod(lpt, 0, 0)
    if "env" in raw:
        pod["spec"]["containers"][0]["env"] += raw["env"]
    if "tolerations" in raw:
        pod["spec"]["tolerations"] = raw["tolerations"]
    if "affinity" in raw:
        pod["spec"]["affinity"] = raw["affinity"]
    causes, unknown = builtin_errors(pod)
    assert causes or unknown


def test_builtin_tokenizer_size_is_the_contract_number():
    data = json.loads((REPO / "trainer/kubetitan_trainer/assets/tokenizer/tokenizer.json").read_text())
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
    assert len(ids) == contract.BUILTIN_TOKENIZER_VOCAB


def test_reserved_env_names_cover_the_operators_own_variables():
    lpt = parse(make_lpt({"resources": {"platform": "eks", "instanceType": "p5.48xlarge"}}))[0]
    names = {e["name"] for e in plan.pod(lpt, 0, 0)["spec"]["containers"][0]["env"]}
    kubetitan = {n for n in names if n.startswith("KUBETITAN_")}
    assert kubetitan and all(contract.env_reserved(n) for n in kubetitan)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NPROC_PER_NODE",
                 "TORCHELASTIC_RESTART_COUNT", contract.ENV_RESTART_GENERATION):
        assert contract.env_reserved(name)
    assert not contract.env_reserved("NCCL_DEBUG")  # an operator default the user may replace
