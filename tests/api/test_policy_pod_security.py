"""The security context of trainer pods: what Pod Security ``restricted`` asks for, set by the planner. Whether
every example's pods pass ``restricted`` is asked of the real API server's PodSecurity admission
(tests/cluster/test_real_api.py); here, what the planner writes. EFA needs no allowance: no capability is added
(plan.py says why).
"""

from __future__ import annotations

import re

from support.paths import REPO
from support.specs import make_lpt
from kubetitan import plan
from kubetitan.plan import attempt_children
from kubetitan_core.validation import parse

def _pods(obj):
    obj["metadata"].setdefault("namespace", "default")
    obj["metadata"]["uid"] = "6f1c2d1e-0000-4000-8000-000000000001"
    lpt, errors = parse(obj)
    assert not errors, errors
    return lpt, [c for c in attempt_children(lpt, attempt=1, avoid_nodes=["n1"]) if c["kind"] == "Pod"]


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
