"""Trainer pods pass Pod Security ``restricted`` (the strict API double's PSA table, tests/kmockx/psa.py).

Every example's rendered pods are checked. The one documented allowance is the hostPath checkpoint volume of
the single-node examples (debug-cpu and the H200 ones): Pod Security forbids hostPath from ``baseline`` up, so
those examples need a namespace without baseline/restricted enforcement and an admin policy that allows the
prefix (docs/install.md, "Admin policy"). EFA needs no allowance: no capability is added (plan.py says why).
"""

from __future__ import annotations

import re

import pytest

from support.paths import EXAMPLES, REPO, load_example
from support.specs import make_lpt
from kmockx import psa
from kubetitan import plan
from kubetitan.plan import attempt_children
from kubetitan_core.validation import parse

HOSTPATH_ALLOWANCE = {
    'hostPath volumes (volume "checkpoints")',
    'restricted volume types (volume "checkpoints" uses restricted volume type "hostPath")',
}


def _pods(obj):
    obj["metadata"].setdefault("namespace", "default")
    obj["metadata"]["uid"] = "6f1c2d1e-0000-4000-8000-000000000001"
    lpt, errors = parse(obj)
    assert not errors, errors
    return lpt, [c for c in attempt_children(lpt, attempt=1, avoid_nodes=["n1"]) if c["kind"] == "Pod"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_examples_pods_pass_pod_security_restricted(path):
    lpt, pods = _pods(load_example(path))
    assert pods
    for pod in pods:
        found = set(psa.violations(pod, "restricted"))
        if lpt.spec.checkpoint.storage.host_path:
            assert found == HOSTPATH_ALLOWANCE, found  # the documented allowance, and nothing else
        else:
            assert found == set(), found


def test_the_hostpath_examples_are_exactly_the_documented_single_node_ones():
    """The allowance above is not a blanket one: docs/install.md names these examples."""
    host_path = {p.stem for p in EXAMPLES if parse(load_example(p))[0].spec.checkpoint.storage.host_path}
    assert host_path == {"debug-cpu", "llama3-1b-h200", "llama3-3b-h200"}
    install = (REPO / "docs" / "install.md").read_text()
    for stem in host_path:
        assert f"examples/{stem}.yaml" in install


def test_the_check_is_real_a_pod_without_the_security_context_fails_restricted():
    _, pods = _pods(make_lpt({"resources": {"instanceType": "p5.48xlarge", "platform": "eks"},
                              "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}}}))
    pod = pods[0]
    assert psa.violations(pod, "restricted") == []
    del pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    titles = {v.split(" (")[0] for v in psa.violations(pod, "restricted")}
    assert titles == {"allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                      "seccompProfile"}


def test_efa_pods_add_no_capability_and_run_as_the_images_user():
    _, pods = _pods(make_lpt({"resources": {"instanceType": "p5.48xlarge", "platform": "eks", "nodes": 2},
                              "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}}}))
    for pod in pods:
        c = pod["spec"]["containers"][0]
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"]}}
        sc = pod["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == sc["runAsGroup"] == sc["fsGroup"] == 10001
        assert sc["fsGroupChangePolicy"] == "OnRootMismatch" and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_pods_uid_is_the_trainer_images_uid():
    """runAsUser/fsGroup must be the user the image creates and chowns its caches to, or the trainer cannot
    write its Hugging Face and compile caches."""
    dockerfile = (REPO / "images" / "trainer.Dockerfile").read_text()
    m = re.search(r"^ARG TRAINER_UID=(\d+)$", dockerfile, re.M)
    assert m, "images/trainer.Dockerfile declares ARG TRAINER_UID=<uid>"
    assert int(m.group(1)) == plan.TRAINER_UID
