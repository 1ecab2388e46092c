"""Writable volumes (issue 16, item 2): the trainer pods' securityContext lets a non-root trainer write fresh,
root-owned volume roots, checked with real processes running as uid 10001 under the e2e kubelet double in its
``run_as_pod_user`` mode (which applies ``fsGroup`` the way a kubelet does: claims of a CSI driver with
``fsGroupPolicy: File`` yes, hostPath never). Needs root to change user (the suite's container runs as root);
the write checks on a real cluster are the manual ones in docs/install.md, "Which volumes the trainer can write".

The pods here run a one-line Python probe, not the trainer, with the planner's own security contexts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from support.specs import NS
from kubelet import Kubelet

from kmockx.harness import PODS, Cluster, wait_for
from kubetitan import plan

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changing the process user needs root")

PROBE = """
import os, sys
print("ids", os.getuid(), os.getgid(), sorted(os.getgroups()), flush=True)
bad = []
for d in sys.argv[1:]:
    try:
        with open(os.path.join(d, "probe"), "w") as f:
            f.write("ok")
        os.makedirs(os.path.join(d, "step-10"), exist_ok=True)
    except OSError as e:
        bad.append(f"{d}: {e.strerror}")
print("denied", bad, flush=True)
sys.exit(1 if bad else 0)
"""


@pytest.fixture
def world():
    """A work dir every user can traverse (pytest's tmp_path is root-only), like a node's filesystem."""
    d = Path(tempfile.mkdtemp(prefix="kubetitan-volumes-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _pod(name: str, mounts: dict[str, dict]) -> dict:
    """A pod with the planner's pod and container securityContext, mounting ``mounts`` (path -> volume source)."""
    vols = [{"name": f"v{i}", **src} for i, src in enumerate(mounts.values())]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"kubetitan.io/name": name}},
            "spec": {"restartPolicy": "Never", "hostname": name, "subdomain": name,
                     "securityContext": plan.pod_security_context(), "volumes": vols,
                     "containers": [{"name": "trainer", "image": "x", "securityContext": plan.container_security_context(),
                                     "command": ["python", "-c", PROBE, *mounts],
                                     "volumeMounts": [{"name": f"v{i}", "mountPath": path}
                                                      for i, path in enumerate(mounts)]}]}}


def _finish(c: Cluster, k: Kubelet, name: str) -> tuple[int, str]:
    def done():
        st = (c.get(PODS, NS, name) or {}).get("status") or {}
        return st if st.get("phase") in ("Succeeded", "Failed") else None
    st = wait_for(done, 30, f"pod {name} to finish")
    return st["containerStatuses"][0]["state"]["terminated"]["exitCode"], k.log(NS, name)


def test_fresh_root_owned_claim_is_writable_and_hostpath_needs_the_admin(world: Path) -> None:
    uid = plan.TRAINER_UID
    claim, fsx = world / "claim", world / "fsx"
    claim.mkdir(mode=0o755), fsx.mkdir(mode=0o755)  # a fresh volume root: root:root 0755, as provisioners make it
    assert claim.stat().st_uid == 0 and not claim.stat().st_mode & 0o020
    new_host, prepared = world / "node" / "kubetitan" / "run", world / "node" / "prepared"
    prepared.mkdir(parents=True)
    os.chown(prepared, uid, uid)  # the admin's step from docs/install.md (install -d -o 10001 -g 10001)
    with Cluster() as c, Kubelet(c, world / "kubelet", claims={"ck": claim}, run_as_pod_user=True) as k:
        c.call(c.k.put(PODS, _pod("pvc", {str(claim): {"persistentVolumeClaim": {"claimName": "ck"}}})))
        code, log = _finish(c, k, "pvc")
        assert f"ids {uid} {uid} [{uid}]" in log and code == 0, log  # non-root, and the write worked
        assert claim.stat().st_gid == uid and claim.stat().st_mode & 0o2070 == 0o2070  # fsGroup + setgid
        assert (claim / "probe").stat().st_uid == uid and (claim / "step-10").stat().st_gid == uid

        c.call(c.k.put(PODS, _pod("host", {
            str(new_host): {"hostPath": {"path": str(new_host), "type": "DirectoryOrCreate"}},
            str(prepared): {"hostPath": {"path": str(prepared), "type": "DirectoryOrCreate"}}})))
        code, log = _finish(c, k, "host")
        # the kubelet-created directory is root-owned and gets no fsGroup: the first write fails
        assert code == 1 and f"denied ['{new_host}: Permission denied']" in log, log
        assert new_host.stat().st_uid == 0 and (prepared / "probe").stat().st_uid == uid
        k.kill_all()
    # A claim whose CSI driver leaves ownership alone (FSx's default fsGroupPolicy for ReadWriteMany claims).
    with Cluster() as c, Kubelet(c, world / "kubelet2", claims={"fsx": fsx}, run_as_pod_user=True,
                                 fs_group_policy="None") as k:
        c.call(c.k.put(PODS, _pod("fsx", {str(fsx): {"persistentVolumeClaim": {"claimName": "fsx"}}})))
        code, log = _finish(c, k, "fsx")
        assert code == 1 and "Permission denied" in log and fsx.stat().st_gid == 0, log


def test_on_root_mismatch_leaves_a_prepared_tree_alone(world: Path) -> None:
    """A second pod on the same claim: the root already has the group, so files inside keep theirs."""
    from kubelet import _apply_fs_group

    root = world / "ck"
    (root / "old").mkdir(parents=True)
    (root / "old" / "f").write_text("x")
    _apply_fs_group(root, 4242, "OnRootMismatch")
    assert (root / "old" / "f").stat().st_gid == 4242 and root.stat().st_mode & 0o2070 == 0o2070
    os.chown(root / "old" / "f", -1, 0)
    _apply_fs_group(root, 4242, "OnRootMismatch")  # root matches: no walk
    assert (root / "old" / "f").stat().st_gid == 0
    _apply_fs_group(root, 4242, "Always")
    assert (root / "old" / "f").stat().st_gid == 4242


@pytest.mark.xdist_group("e2e")  # runs the trainer; the probes above are one-line programs
def test_the_trainer_runs_as_uid_10001_and_checkpoints_to_a_fresh_claim(world: Path) -> None:
    """The real thing: the operator's pod, the real trainer (the test model on CPU) as uid 10001, writing
    its checkpoints, step log and NCCL-trace folder into a fresh root-owned claim, to the end of the run."""
    from common import CLAIM, complete_checkpoints, e2e_spec, free_port, lpt, step_log

    from kmockx.harness import Operator

    ckpt = world / "ckpt"
    ckpt.mkdir(mode=0o755)
    spec = e2e_spec(ckpt, steps=4, interval=2, metrics_port=free_port())
    spec["resources"]["nodes"], spec["parallelism"]["dataParallelShardDegree"] = 1, 1
    with Cluster() as c, Kubelet(c, world / "kubelet", claims={CLAIM: ckpt}, run_as_pod_user=True) as k, \
            Operator(c, namespaces=(NS,), scan_interval=0.2, scrape_interval=0.5):
        c.apply(lpt("asuser", spec))
        wait_for(lambda: (c.status(NS, "asuser") or {}).get("phase") in ("Succeeded", "Failed"), 300, "the run to end")
        assert c.status(NS, "asuser")["phase"] == "Succeeded", "\n".join(l for l in k.log(NS, "asuser-a0-0").splitlines() if "rror" in l or "denied" in l or "Traceback" in l)[:4000]
        assert not k.errors
    assert complete_checkpoints(ckpt) == [2, 4] and [r["step"] for r in step_log(ckpt)] == [1, 2, 3, 4]
    owners = {p.stat().st_uid for p in (ckpt / "checkpoint").rglob("*")}
    assert owners == {plan.TRAINER_UID}, owners  # written by the trainer's user, not root
