"""The instance catalog (kubetitan_core.catalog): every NVIDIA GPU type of EKS / HyperPod, what a pod requests on
it, and the warning for a type the catalog does not know."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from support import forkrun
from support.specs import make_lpt
from kubetitan_core.catalog import ACCELERATORS, INSTANCE_TYPES, pod_resources
from kubetitan_core.warning_rules import warnings_for
from kubetitan.plan import attempt_children
from kubetitan_core.validation import parse

SIZES = ["xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge"]
REQUIRED = ["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge",
            *(f"{fam}.{size}" for fam in ("g5", "g6", "g6e") for size in SIZES)]


def test_every_required_type_and_its_hyperpod_name_is_known():
    for name in REQUIRED:
        it, ml = INSTANCE_TYPES[name], INSTANCE_TYPES[f"ml.{name}"]
        assert not it.hyperpod and ml.hyperpod
        assert (it.gpu, it.gpus, it.efa, it.vcpus, it.memory_gib, it.gpu_memory_gib) == (
            ml.gpu, ml.gpus, ml.efa, ml.vcpus, ml.memory_gib, ml.gpu_memory_gib)
    assert len(INSTANCE_TYPES) == 2 * len(REQUIRED)


@pytest.mark.parametrize("name", REQUIRED)
def test_catalog_invariants(name):
    it = INSTANCE_TYPES[name]
    acc = ACCELERATORS[it.gpu]
    assert it.gpus in (1, 4, 8) and 0 <= it.efa <= 32
    assert 0 < it.gpu_memory_gib <= acc.memory_gib
    assert it.vcpus >= 4 * it.gpus and it.memory_gib >= 4 * it.vcpus


@pytest.mark.parametrize("name, want", [
    # (GPU, GPUs, EFA, vCPUs, memory GiB, GPU memory GiB) from the EC2 accelerated-computing specifications
    ("p4d.24xlarge", ("A100", 8, 4, 96, 1152, 40)),
    ("p4de.24xlarge", ("A100", 8, 4, 96, 1152, 80)),
    ("p5.48xlarge", ("H100", 8, 32, 192, 2048, 80)),
    ("p5e.48xlarge", ("H200", 8, 32, 192, 2048, 141)),
    ("p5en.48xlarge", ("H200", 8, 16, 192, 2048, 141)),
    ("p6-b200.48xlarge", ("B200", 8, 8, 192, 2048, 179)),
    ("g5.xlarge", ("A10G", 1, 0, 4, 16, 24)),
    ("g5.12xlarge", ("A10G", 4, 1, 48, 192, 24)),
    ("g5.48xlarge", ("A10G", 8, 1, 192, 768, 24)),
    ("g6.16xlarge", ("L4", 1, 1, 64, 256, 24)),
    ("g6.48xlarge", ("L4", 8, 1, 192, 768, 24)),
    ("g6e.2xlarge", ("L40S", 1, 0, 8, 64, 48)),
    ("g6e.24xlarge", ("L40S", 4, 2, 96, 768, 48)),
    ("g6e.48xlarge", ("L40S", 8, 4, 192, 1536, 48)),
])
def test_known_facts(name, want):
    it = INSTANCE_TYPES[name]
    assert (it.gpu, it.gpus, it.efa, it.vcpus, it.memory_gib, it.gpu_memory_gib) == want


@pytest.mark.parametrize("args, want", [
    (("p5.48xlarge", 8, 8), ("172", "1740Gi", None, "1740Gi")),
    (("p5.48xlarge", 4, 4), ("86", "870Gi", None, "870Gi")),          # half the GPUs: half the node
    (("ml.p5en.48xlarge", 8, 8), ("172", "1740Gi", None, "1740Gi")),
    (("g5.xlarge", 1, 1), ("3", "13Gi", None, "13Gi")),
    (("g6e.48xlarge", 8, 8), ("172", "1305Gi", None, "1305Gi")),
    ((None, 0, 2), ("2", "4Gi", None, None)),                          # no instance type: a floor, no limit
    (("x9.unknown", 8, 8), ("8", "16Gi", None, None)),
    (("p5.48xlarge", 8, 8, "100", "1000Gi"), ("100", "1000Gi", "100", "1000Gi")),  # the spec wins
    (("p5.48xlarge", 8, 8, "100"), ("100", "1740Gi", "100", "1740Gi")),
])
def test_pod_resources(args, want):
    r = pod_resources(*args)
    assert (r.cpu, r.memory, r.cpu_limit, r.memory_limit) == want


def test_pods_are_never_best_effort():
    for spec in ({"resources": {"gpusPerNode": 0, "processesPerNode": 2}, "model": {"flavor": "debug"},
                  "precision": {"compile": False}},
                 {"resources": {"instanceType": "g6.12xlarge", "gpusPerNode": 4}}):
        lpt, errors = parse(make_lpt({**spec, "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}}}}))
        assert not errors, errors
        pod = attempt_children(lpt, 0)[2]
        req = pod["spec"]["containers"][0]["resources"]["requests"]
        assert req["cpu"] and req["memory"]


def test_gpus_beyond_a_known_g_type_are_refused():
    """gpusPerNode: 8 on a 4-GPU type used to pass (the catalog did not know g6.12xlarge)."""
    _, errors = parse(make_lpt({"resources": {"instanceType": "g6.12xlarge", "gpusPerNode": 8}}))
    assert [e.path for e in errors] == ["spec.resources.gpusPerNode"]
    assert "exceeds the 4 GPUs of g6.12xlarge" in errors[0].message


def instance_type_warning(lpt) -> str | None:
    """The message of the unknown-instance-type warning rule for a run (None: no such warning)."""
    return next((w.message for w in warnings_for(lpt) if w.rule == "resources.unknown-instance-type"), None)


def test_unknown_type_warning_says_what_is_assumed():
    lpt, errors = parse(make_lpt({"resources": {"instanceType": "p7.96xlarge", "gpusPerNode": 8, "platform": "eks"},
                                  "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}}}}))
    assert not errors
    w = instance_type_warning(lpt)
    assert w == ("instance type p7.96xlarge is not in kubetitan's catalog (operator/core/kubetitan_core/catalog.py); assuming 8 "
                 "GPUs per node (spec.resources.gpusPerNode, not checked), no EFA interfaces (set "
                 "spec.resources.efaPerNode), an unknown GPU model (no FP8 hardware check, no MFU; set "
                 "spec.resources.gpuProduct), and requests of cpu 8 and memory 16Gi per pod (1 CPU and 2Gi per "
                 "process, no limit; set spec.resources.cpu and memory)")
    pod = attempt_children(lpt, 0)[2]
    assert "vpc.amazonaws.com/efa" not in pod["spec"]["containers"][0]["resources"]["limits"]
    lpt2, _ = parse(make_lpt({"resources": {"instanceType": "p7.96xlarge", "efaPerNode": 16, "gpuProduct": "H200",
                                            "cpu": "100", "memory": "1Ti"}}))
    w2 = instance_type_warning(lpt2)
    assert "16 EFA interfaces (spec.resources.efaPerNode)" in w2 and "GPU model H200" in w2
    assert "cpu 100 and memory 1Ti per pod from the spec" in w2
    for known in ({"instanceType": "ml.g6e.12xlarge", "gpusPerNode": 4, "platform": "hyperpod"}, {}):
        assert instance_type_warning(parse(make_lpt({"resources": known}))[0]) is None


def test_validate_prints_the_warning_and_still_exits_0(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(make_lpt({"resources": {"instanceType": "p7.96xlarge"},
                                          "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}}}})))
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "validate", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "is valid" in r.stdout
    assert f"{f}: warning [resources.unknown-instance-type] spec.resources.instanceType: instance type p7.96xlarge is not in kubetitan's catalog" in r.stderr


@pytest.mark.parametrize("instance_type, efa, rdma, hugepages", [
    ("p5.48xlarge", 32, True, "5120Mi"), ("p6-b200.48xlarge", 8, True, "5120Mi"),
    ("g6e.48xlarge", 4, False, None), ("g5.xlarge", 0, False, None),
])
def test_efa_pods_get_rdma_and_huge_pages_only_where_the_instance_has_them(instance_type, efa, rdma, hugepages):
    lpt, errors = parse(make_lpt({"resources": {"instanceType": instance_type, "platform": "eks",
                                                "gpusPerNode": INSTANCE_TYPES[instance_type].gpus},
                                  "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}}}}))
    assert not errors, errors
    c = attempt_children(lpt, 0)[2]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["resources"]["limits"].get("vpc.amazonaws.com/efa", 0) == efa
    assert ("FI_EFA_USE_DEVICE_RDMA" in env) == rdma and ("FI_PROVIDER" in env) == (efa > 0)
    assert c["resources"]["limits"].get("hugepages-2Mi") == hugepages
