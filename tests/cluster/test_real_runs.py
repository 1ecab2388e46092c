"""Runs on the real control plane: the operator (the chart's arguments and ServiceAccount) creates the gang, the real
kube-scheduler places it on the e2e kubelet's nodes (tests/e2e/kubelet.py, each node with its own identity and
Lease), the controller-manager garbage-collects, counts quota and turns a silent node NotReady; real trainers train.

- children pass PodSecurity ``restricted`` in an enforcing namespace and are garbage-collected through their
  ownerReferences when the run is deleted;
- a ResourceQuota refusing the gang's second pod gives one aggregated Warning Event;
- a node deleted while its pod is bound: the controller-manager's pod garbage collector deletes the orphaned pod
  before the operator's own grace runs out, and the restart is a ``NodeFailure`` naming the node;
- gang scheduling by the cluster: a 4-pod gang with room for 3 gets its PodGroup and kube-scheduler binds none of
  its pods (the same run with ``scheduling.podGroup: Disabled`` gets 3 of 4 bound), and all 4 once a node joins;
- an elastic run: a node lost with no replacement shrinks the gang 2 -> 1 (kube-scheduler places attempt 1 on
  the Ready node); the broken node is then deleted and a new one registers (what the cluster autoscaler or
  HyperPod's node recovery does): the gang grows back to 2 onto it at a checkpoint, no pod of the run is left on
  the deleted node, then Succeeded;
- one CPU run: start -> a rank's container killed -> the gang re-created -> its node stops renewing its Lease
  (NotReady after the controller-manager's grace period) -> NodeFailure restart on the other nodes -> etcd
  compacted and kube-apiserver restarted while the gang's workers are frozen (every watch expires) -> no further
  restart -> Succeeded.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the kubelet double's folder
from kubelet import Kubelet  # noqa: E402

from kmockx.harness import OperatorProcess, free_port  # noqa: E402
from support.cluster import (LPT, NODES, PODS, POLL_SECONDS, ApiError, ControlPlane, KubeCluster,  # noqa: E402
                             wait_for)
from support import hold  # noqa: E402
from support.faultproxy import FaultProxy  # noqa: E402
from support.release import Release, described_condition, kubectl  # noqa: E402
from support.specs import CLAIM, cpu_spec, e2e_elastic_spec, e2e_spec, lpt  # noqa: E402
from common import complete_checkpoints, step_log  # noqa: E402 - tests/e2e's readers of the run's files
from kubetitan import conditions as C  # noqa: E402

pytestmark = [pytest.mark.xdist_group("real-cluster"), pytest.mark.timeout(900)]
OPERATOR_FLAGS = ("--scan-interval=0.2", "--scrape-interval=0.5", "--resize-min-interval-seconds=1",
                  "--leader-elect-lease-duration=3", "--leader-elect-renew-deadline=2", "--leader-elect-retry-period=0.5")
"""Quicker cycles than the chart's defaults (10 s / 15 s, a resize at most every 600 s), as the e2e suite on the
double runs them, and the Lease's terms scaled down 5x (a replica that creates the Lease waits a lease duration
before it acts)."""
START = 300.0
ZONE = "topology.kubernetes.io/zone"


@pytest.fixture(scope="module")
def api_proxy(control_plane: ControlPlane) -> Iterator[FaultProxy]:
    """The fault proxy (support.faultproxy) the module's operator talks to the API server through: transparent
    until a test injects faults."""
    serving = control_plane.pki.issue("fault-proxy", "fault-proxy", server_names=("127.0.0.1",), client=False)
    with FaultProxy(control_plane.server, control_plane.pki.ca_file, serving) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def fast_operator(release: Release, control_plane: ControlPlane, api_proxy: FaultProxy,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    d = tmp_path_factory.mktemp("webhook")
    kubeconfig = api_proxy.kubeconfig(release.operator_kubeconfig(), d / "operator-via-proxy.kubeconfig")
    with OperatorProcess(str(kubeconfig), *release.operator_args(cert_dir=str(d), extra=OPERATOR_FLAGS)) as op:
        wait_for(release.webhook_serving, 60, "the webhook served", every=0.1)
        yield op


def _claim(cp: ControlPlane, ns: str, name: str, path: Path) -> None:
    """A ReadWriteMany claim bound to a hostPath PersistentVolume at ``path`` (what the e2e kubelet mounts)."""
    pv = f"{ns}-{name}"
    cp.admin.create("v1/persistentvolumes", None, {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)},
                 "claimRef": {"namespace": ns, "name": name}}})
    cp.admin.create("v1/persistentvolumeclaims", ns, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                 "resources": {"requests": {"storage": "10Gi"}}}})
    wait_for(lambda: (cp.admin.get("v1/persistentvolumeclaims", ns, name) or {}).get("status", {}).get("phase")
             == "Bound", 30, f"claim {name} bound by the controller-manager")


@contextlib.contextmanager
def _explained(diagnosis: Callable[[], str]) -> Iterator[None]:
    """An AssertionError inside carries ``diagnosis()`` (the state of the run when a wait failed)."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- diagnosis ---\n{diagnosis()}") from None


def _checkpoint_claim(cp: ControlPlane, ns: str, tmp_path: Path) -> Path:
    """The e2e specs' checkpoint claim, bound to a folder of the test's own."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _claim(cp, ns, CLAIM, ckpt)
    return ckpt


def _events(kube: KubeCluster, ns: str, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in kube.list("v1/events", ns) if e["involvedObject"].get("name") == name
            and (reason is None or e["reason"] == reason)]


def test_children_pass_pod_security_restricted_and_are_garbage_collected(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str) -> None:
    kube.patch("v1/namespaces", None, namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    # the namespace enforces: a pod breaking `restricted` is refused by the server
    with pytest.raises(ApiError) as refused:
        kube.api.create(PODS, namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root"},
                                          "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    assert refused.value.status == 403 and "violates PodSecurity" in str(refused.value)
    kube.apply(lpt("gc", cpu_spec(nodes=2), namespace=namespace))
    wait_for(lambda: len(kube.pods(namespace, "gc")) == 2, 60, "the gang's 2 pods admitted under restricted")
    run = kube.lpt(namespace, "gc")
    children = [("v1/configmaps", c["metadata"]["name"]) for c in kube.list("v1/configmaps", namespace)
                if any(o["uid"] == run["metadata"]["uid"] for o in c["metadata"].get("ownerReferences") or [])]
    children += [("v1/services", s["metadata"]["name"]) for s in kube.list("v1/services", namespace)]
    children += [(PODS, p["metadata"]["name"]) for p in kube.pods(namespace, "gc")]
    assert len(children) >= 4, children
    for res, name in children:
        refs = kube.get(res, namespace, name)["metadata"]["ownerReferences"]
        assert [(r["kind"], r["uid"], r.get("controller")) for r in refs] == [
            ("LlamaPretrain", run["metadata"]["uid"], True)], (res, name, refs)
    kube.delete(LPT, namespace, "gc")
    wait_for(lambda: all(kube.get(res, namespace, name) is None for res, name in children), 60,
             "every child gone after the run's deletion (garbage collector)")


def test_a_quota_refusing_the_second_pod_is_one_aggregated_event(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str) -> None:
    kube.api.create("v1/resourcequotas", namespace, {"apiVersion": "v1", "kind": "ResourceQuota",
                                                     "metadata": {"name": "team-quota"}, "spec": {"hard": {"pods": "1"}}})
    wait_for(lambda: (kube.get("v1/resourcequotas", namespace, "team-quota") or {}).get("status", {}).get("hard"),
             30, "the quota's status from the resource quota controller")
    kube.apply(lpt("q", cpu_spec(nodes=2), namespace=namespace))
    ev = wait_for(lambda: (e := _events(kube, namespace, "q", "FailedCreate"))
                  and (e[0].get("count") or e[0].get("series", {}).get("count") or 1) >= 2 and e,
                  90, "the refused creates counted on one Event")
    assert len(ev) == 1 and ev[0]["type"] == "Warning", ev
    assert "exceeded quota: team-quota" in ev[0]["message"], ev[0]["message"]
    children = kube.condition(namespace, "q", "ChildrenCreated")
    assert children["status"] == "False" and children["reason"] == "Forbidden", children
    assert len(kube.pods(namespace, "q")) == 1


READS, WRITES = frozenset({"get", "list", "watch"}), frozenset({"create", "patch", "update", "delete"})
RUN_RESOURCES = ("pods", "llamapretrains", "llamapretrains/status", "configmaps", "services", "podgroups", "events",
                 "nodes")
"""What the operator reads and writes for a run: the proxy's 429/503 answer these (not its Lease: a leader that
cannot renew steps down, which tests/cluster/test_real_ha.py and the double's HA suite cover)."""
WATCHED = ("pods", "llamapretrains", "configmaps", "services", "nodes")
"""The operator's watches, each dropped and then expired by the scenario."""
QUOTA = 'pods "faulty-a0-1" is forbidden: exceeded quota: team-quota, requested: pods=1, used: pods=8, limited: pods=8'
PSA = ('pods "faulty-a0-1" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != '
       'false (container "trainer" must set securityContext.allowPrivilegeEscalation=false)')


def test_api_faults_through_a_proxy_leave_the_run_untouched(
        kube: KubeCluster, control_plane: ControlPlane, api_proxy: FaultProxy, fast_operator: OperatorProcess,
        namespace: str, tmp_path: Path) -> None:
    """The real operator talks to the real API server through the fault proxy, which answers 20 % of its requests
    for the run with 429 (Retry-After 1) or 503, refuses its pod creates with 403 (a quota) and then 422 (Pod
    Security) for a while, and drops and then expires every watch while the gang (real trainers, 2 nodes) is
    mid-run (its workers frozen meanwhile). The operator resumes each dropped watch from its resourceVersion and
    re-lists after each expired one; the run trains to Succeeded with no restart, each child is created exactly
    once (the proxy's log), and the refusals are a ``ChildrenCreated`` condition and ``FailedCreate`` Events that
    the stock kubectl describes."""
    ckpt = _checkpoint_claim(control_plane, namespace, tmp_path)
    proxy, name, steps = api_proxy, "faulty", 40
    # the gang is frozen a while: 120 s as it is (Auto would make it max(10 median steps, 30 s), and the launchers'
    # watchdogs stopped the frozen workers once, on a slow run, while the watches were being cut)
    spec = e2e_spec(ckpt, steps, steps // 2, free_port(), hangTimeoutSeconds=120, hangTimeoutPolicy="Fixed")
    describe = lambda: kubectl("describe", "lpt", name, "-n", namespace,  # noqa: E731
                               kubeconfig=control_plane.admin_kubeconfig).stdout
    condition = lambda: kube.condition(namespace, name, "ChildrenCreated") or {}  # noqa: E731
    try:
        with Kubelet(kube, tmp_path / "kubelet", nodes=2, claims={CLAIM: ckpt}, node_prefix=f"{namespace}-n",
                     poll=POLL_SECONDS) as k, _explained(lambda: _diagnosis(kube, k, namespace, name)):
            quota = proxy.inject(verbs={"create"}, resource="pods", namespace=namespace, code=403, message=QUOTA)
            for resource in RUN_RESOURCES:
                proxy.inject(verbs=READS | WRITES, resource=resource, code=429, rate=0.1, retry_after=1)
                proxy.inject(verbs=READS | WRITES, resource=resource, code=503, rate=0.1 / 0.9)  # 20 % together
            # the operator reads little once its watches run: two of each code on its next reads make sure
            burst = [proxy.inject(verbs=READS, resource="pods", code=429, count=2, retry_after=1),  # (cluster-wide:
                     proxy.inject(verbs=READS, resource="pods", code=503, count=2)]  # the operator watches all)
            start = len(proxy.log)
            kube.apply(lpt(name, spec, namespace=namespace))

            # ---- pod creates refused by a quota: a condition and an Event, no pod, the run Pending
            wait_for(lambda: condition().get("reason") == "Forbidden", 60, "ChildrenCreated=False/Forbidden")
            described = wait_for(lambda: (lambda d: d if re.search(r"Warning\s+FailedCreate\s+.*exceeded quota", d)
                                          else None)(describe()), 60, "the FailedCreate Event", every=0.5)
            cond = described_condition(described, "ChildrenCreated")
            assert (cond["Status"], cond["Reason"]) == ("False", "Forbidden") and "exceeded quota" in cond["Message"]
            assert not kube.pods(namespace, name) and kube.status(namespace, name)["phase"] == "Pending"
            # ---- then refused by Pod Security (422) for a while
            wait_for(lambda: quota.hits >= 2, 60, "the refused pod create retried")
            psa = proxy.inject(verbs={"create"}, resource="pods", namespace=namespace, code=422, message=PSA)
            proxy.end(quota)  # the quota is raised
            wait_for(lambda: condition().get("reason") == "Invalid", 60, "ChildrenCreated=False/Invalid")
            assert not kube.pods(namespace, name)
            wait_for(lambda: psa.hits >= 2, 60, "the refused pod create retried")
            proxy.end(psa)  # the namespace's policy is fixed
            wait_for(lambda: len(kube.pods(namespace, name)) == 2, 120, "both pods once the API accepts")
            wait_for(lambda: condition().get("status") == "True", 60, "ChildrenCreated=True")

            # ---- every watch dropped, then expired (410 Gone), while the gang is mid-run (frozen meanwhile)
            wait_for(lambda: kube.status(namespace, name).get("training", {}).get("step", 0) >= 1, START,
                     "the gang training")
            frozen = [pid for p in kube.pods(namespace, name) for pid in k.freeze(namespace, p["metadata"]["name"])]
            assert len(frozen) == 2, frozen  # one worker per pod
            for cut, again in ((proxy.drop_watches, "watch"), (proxy.expire_watches, "list")):
                mark = len(proxy.log)
                assert set(WATCHED) <= set(cut()), cut.__name__
                for plural in WATCHED:  # a dropped watch resumes from its resourceVersion; an expired one re-lists
                    wait_for(lambda plural=plural: any(
                        e.verb == again and e.resource == plural and e.code == 200
                        and (again == "list" or "resourceVersion=" in e.path) for e in proxy.entries(mark)),
                        60, f"the operator's {again} of {plural} after {cut.__name__}")
                    wait_for(lambda plural=plural: any(e.verb == "watch" and e.resource == plural and e.code == 200
                                                       for e in proxy.entries(mark)),
                             60, f"the operator watching {plural} again after {cut.__name__}")
            st = kube.status(namespace, name)
            assert st["phase"] == "Running" and st["training"]["step"] < steps, st  # still mid-run
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            assert kube.status(namespace, name).get("restartCount", 0) == 0
            wait_for(lambda: kube.status(namespace, name).get("phase") == "Succeeded", START,
                     "Succeeded despite the faults")
            described = describe()  # (kubectl as the admin, straight to the API server)
        assert not k.errors, k.errors
    finally:
        proxy.clear_faults()
    st = kube.status(namespace, name)
    assert st["restartCount"] == 0 and not st.get("restarts") and st["attempt"] == 0, st
    assert st["training"]["step"] == steps
    log = step_log(ckpt)
    assert {r["attempt"] for r in log} == {0} and log[-1]["step"] == steps
    # no duplicate children: one accepted create per child, the refused ones before it
    since = proxy.entries(start)
    mine = [e for e in since if e.namespace == namespace]  # (an earlier test's run may still be retried elsewhere)
    created: dict[str, list[int]] = {}
    for e in mine:
        if e.verb == "create" and e.resource in ("pods", "configmaps", "services", "podgroups"):
            created.setdefault(e.created or "?", []).append(e.code)
    pods = {c: codes for c, codes in created.items() if c.startswith("Pod/")}
    assert set(pods) == {f"Pod/{name}-a0-0", f"Pod/{name}-a0-1"}, created
    for child, codes in created.items():
        assert codes.count(201) == 1 and codes[-1] == 201, (child, codes)
        assert set(codes) <= {201, 403, 422, 429, 503}, (child, codes)
    refused = [code for codes in pods.values() for code in codes]
    assert refused.count(403) == quota.hits >= 2 and refused.count(422) == psa.hits >= 2, pods
    # 429 and 503 answered reads (the run's own, and the cluster-wide lists and watches) and writes: about 20 %
    assert [f.hits for f in burst] == [2, 2], "the operator's reads met fewer faults than injected"
    for code in (429, 503):
        for verbs in (READS, WRITES):
            assert any(e.fault and e.code == code and e.verb in verbs for e in since), (code, sorted(verbs))
    run_requests = [e for e in since if e.resource in RUN_RESOURCES and e.namespace in (namespace, None)]
    share = sum(e.fault and e.code in (429, 503) for e in run_requests) / len(run_requests)
    assert len(run_requests) >= 50 and 0.08 <= share <= 0.4, (share, len(run_requests))  # 20 % drawn at random
    # what a user sees: the condition (now True: every child exists) and both refusals as Warning Events
    cond = described_condition(described, "ChildrenCreated")
    assert (cond["Status"], cond["Reason"]) == ("True", "Created"), cond
    assert re.search(r"Warning\s+FailedCreate\s+.*Forbidden: .*exceeded quota", described), described
    assert re.search(r"Warning\s+FailedCreate\s+.*Invalid: .*PodSecurity", described), described
    assert not _events(kube, namespace, name, "Restart"), "a restart Event"


def _diagnosis(kube: KubeCluster, k: Kubelet, ns: str, name: str) -> str:
    """What a failing wait shows: the run's status, its pods (node, phase, container state), its Events and the
    tail of each container's log."""
    lines = [f"status: {kube.status(ns, name)}"]
    for p in kube.pods(ns, name):
        cs = (p.get("status", {}).get("containerStatuses") or [{}])[0].get("state")
        lines.append(f"pod {p['metadata']['name']} node={p['spec'].get('nodeName')} "
                     f"phase={p.get('status', {}).get('phase')} state={cs}")
        lines.append("  log: " + k.log(ns, p["metadata"]["name"])[-1500:].replace("\n", "\n  "))
    lines += [f"event {e['reason']}: {e['message'][:300]}" for e in _events(kube, ns, name)]
    return "\n".join(lines)


def _attempt_pods(kube: KubeCluster, ns: str, name: str, attempt: int) -> list[dict[str, Any]]:
    return [p for p in kube.pods(ns, name) if f"-a{attempt}-" in p["metadata"]["name"]]


CPU_RUN_STEPS = 80
"""Attempt 0 is killed past its first checkpoint (step 10), attempt 1 is frozen by its silent node a few steps after
it resumed, and attempt 2's workers are frozen (SIGSTOP) while etcd is compacted and kube-apiserver restarts, so the
run still trains when kube-apiserver is back however long the restart takes (no window to outlast: until now 260
steps, 160 of them only there to outlast the restart). After the thaw at step ~25-50 the run trains its last 30+
steps (4+ s) under the re-listed watches."""


def test_a_cpu_run_survives_a_killed_rank_and_a_lost_node_then_succeeds(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str,
        tmp_path: Path) -> None:
    ckpt = _checkpoint_claim(control_plane, namespace, tmp_path)
    # hangTimeoutSeconds above the node lifecycle controller's grace: the silent node must be seen NotReady
    # (NodeFailure) before the frozen gang counts as hung (a Hang restart is the right answer once the hang timeout
    # is the shorter; on a loaded machine the node took over 10 s to turn NotReady and Hang came first)
    spec = e2e_spec(ckpt, steps=CPU_RUN_STEPS, interval=10, metrics_port=free_port(), maxInPlaceRestarts=0,
                    hangTimeoutSeconds=60)
    with Kubelet(kube, tmp_path / "kubelet", nodes=3, claims={CLAIM: ckpt}, node_prefix=f"{namespace}-n", poll=POLL_SECONDS) as k, \
            _explained(lambda: _diagnosis(kube, k, namespace, "cpu")):
        kube.apply(lpt("cpu", spec, namespace=namespace))
        # attempt 0 trains: kill rank 1's container (every process of the pod)
        wait_for(lambda: kube.status(namespace, "cpu").get("training", {}).get("step", 0) >= 12, START,
                 "attempt 0 past its first checkpoint")
        a0 = _attempt_pods(kube, namespace, "cpu", 0)
        assert {p["spec"]["nodeName"] for p in a0} <= set(k.nodes)  # placed by kube-scheduler (a CPU gang may share)
        k.kill(namespace, sorted(p["metadata"]["name"] for p in a0)[1], signal.SIGKILL)
        wait_for(lambda: len(kube.status(namespace, "cpu").get("restarts") or []) >= 1, 120, "the first restart")
        first = kube.status(namespace, "cpu")["restarts"][0]
        assert first["cause"] == "ContainerFailed", first
        # attempt 1 trains: its rank 1's node goes silent (no Lease renewal, processes frozen)
        wait_for(lambda: kube.status(namespace, "cpu").get("attempt") == 1 and kube.status(
            namespace, "cpu").get("training", {}).get("step", 0) > first.get("resumedFromStep", 0) + 2, START,
            "attempt 1 training")
        a1 = sorted(_attempt_pods(kube, namespace, "cpu", 1), key=lambda p: p["metadata"]["name"])
        lost = a1[1]["spec"]["nodeName"]
        k.fail_node(lost)
        wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "Unknown"
                             for c in kube.get(NODES, None, lost)["status"]["conditions"]), 60,
                 "the node lifecycle controller marks the silent node NotReady")
        wait_for(lambda: len(kube.status(namespace, "cpu").get("restarts") or []) >= 2, 120, "the second restart")
        second = kube.status(namespace, "cpu")["restarts"][1]
        assert second["cause"] == "NodeFailure", second
        a2 = _attempt_pods(kube, namespace, "cpu", 2)
        wait_for(lambda: len(_attempt_pods(kube, namespace, "cpu", 2)) == 2 and all(
            p["spec"].get("nodeName") for p in _attempt_pods(kube, namespace, "cpu", 2)), 60, "attempt 2 bound")
        a2 = _attempt_pods(kube, namespace, "cpu", 2)
        assert lost not in {p["spec"]["nodeName"] for p in a2}, (lost, [p["spec"]["nodeName"] for p in a2])
        # attempt 2 trains: etcd compacted and kube-apiserver restarted, so every watch ends and resumes from a
        # resourceVersion that is gone (410): the operator re-lists, and the run goes on without another restart
        wait_for(lambda: kube.status(namespace, "cpu").get("attempt") == 2 and kube.status(
            namespace, "cpu").get("training", {}).get("step", 0) > second.get("resumedFromStep", 0) + 2, START,
            "attempt 2 training")
        # the gang frozen (both pods' workers stopped, hangTimeoutSeconds 60 above any restart) until kube-apiserver
        # is back, so that the run is still training, not done, when the operator's watches resume
        frozen = [pid for p in a2 for pid in k.freeze(namespace, p["metadata"]["name"])]
        assert len(frozen) == 2, frozen  # one worker per pod
        control_plane.compact()
        down = control_plane.restart_apiserver()
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        at = kube.status(namespace, "cpu")["training"]["step"]
        print(f"kube-apiserver restarted in {down:.1f} s, the gang frozen at step {at} of {CPU_RUN_STEPS}")
        assert kube.status(namespace, "cpu").get("phase") == "Running" and at < CPU_RUN_STEPS
        wait_for(lambda: kube.status(namespace, "cpu").get("phase") == "Succeeded", START, "Succeeded")
        status = kube.status(namespace, "cpu")
        assert status["training"]["step"] == CPU_RUN_STEPS and len(status["restarts"]) == 2, status
        k.restore_node(lost)
    assert not k.errors, k.errors


@contextlib.contextmanager
def _ready_nodes(kube: KubeCluster, names: list[str]) -> Iterator[list[str]]:
    """Nodes that register and renew their Leases but run nothing (scheduling tests need no containers); ``names``
    may grow while it runs. Deleted at the end."""
    stop = threading.Event()
    for n in names:
        kube.add_node(n)

    def beat() -> None:
        while not stop.wait(1.0):
            for n in list(names):
                kube.renew_node(n)

    t = threading.Thread(target=beat, daemon=True, name="node-leases")
    t.start()
    try:
        yield names
    finally:
        stop.set()
        t.join(10)
        for n in names:
            kube.delete(NODES, None, n)


def _whole_node_spec(nodes: int, zone: str) -> dict[str, Any]:
    """``nodes`` pods of 8 GPUs each (a p5.48xlarge apiece: one pod per node), on the nodes labelled ``zone``."""
    spec = cpu_spec(nodes=nodes)
    spec["resources"].update(gpusPerNode=8, nodeSelector={ZONE: zone})
    spec["resources"].pop("processesPerNode")
    spec["parallelism"] = {"dataParallelShardDegree": -1}
    return spec


def _pod_scheduled(p: dict[str, Any]) -> str | None:
    return next((c["status"] for c in p.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"),
                None)


def test_a_gang_with_room_for_three_of_four_binds_none_then_all_once_a_node_joins(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str,
        tmp_path: Path) -> None:
    _claim(control_plane, namespace, "ckpt", tmp_path)  # cpu_spec's claim: a pod naming a missing one never binds
    gang_zone, plain_zone = f"{namespace}-a", f"{namespace}-b"
    nodes = [f"{gang_zone}{i}" for i in range(3)] + [f"{plain_zone}{i}" for i in range(3)]
    with _ready_nodes(kube, nodes):
        for n in nodes:
            kube.patch(NODES, None, n, {"metadata": {"labels": {ZONE: n[:-1]}}})
        # without a PodGroup (the opt-out): kube-scheduler binds what fits, 3 of 4
        plain = _whole_node_spec(4, plain_zone)
        plain["scheduling"] = {"podGroup": "Disabled"}
        kube.apply(lpt("plain", plain, namespace=namespace))
        wait_for(lambda: sum(bool(p["spec"].get("nodeName")) for p in kube.pods(namespace, "plain")) == 3
                 and any(_pod_scheduled(p) == "False" for p in kube.pods(namespace, "plain")), 60,
                 "without a PodGroup: 3 of 4 pods bound, the 4th unschedulable")
        assert kube.get("scheduling.k8s.io/v1beta1/podgroups", namespace, "plain-a0") is None
        # with the attempt's PodGroup (the default where the server serves them): all or nothing
        kube.apply(lpt("gang", _whole_node_spec(4, gang_zone), namespace=namespace))
        pg = wait_for(lambda: kube.get("scheduling.k8s.io/v1beta1/podgroups", namespace, "gang-a0"), 30,
                      "the attempt's PodGroup")
        assert pg["spec"]["schedulingPolicy"]["gang"]["minCount"] == 4, pg
        wait_for(lambda: len(kube.pods(namespace, "gang")) == 4 and all(
            _pod_scheduled(p) == "False" for p in kube.pods(namespace, "gang")), 60,
            "every pod of the gang tried by kube-scheduler and left unscheduled")
        pods = kube.pods(namespace, "gang")
        assert [p["spec"].get("nodeName") for p in pods] == [None] * 4, pods
        assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {"gang-a0"}
        joined = f"{gang_zone}3"
        nodes.append(joined)
        kube.add_node(joined)
        kube.patch(NODES, None, joined, {"metadata": {"labels": {ZONE: gang_zone}}})
        wait_for(lambda: all(p["spec"].get("nodeName") for p in kube.pods(namespace, "gang")), 60,
                 "all 4 pods of the gang bound once a fourth node joined")
        assert len({p["spec"]["nodeName"] for p in kube.pods(namespace, "gang")}) == 4


def test_a_deleted_nodes_pod_garbage_collected_by_the_cluster_is_a_node_failure(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str,
        tmp_path: Path) -> None:
    """A node of a placed gang is deleted (the cluster autoscaler or HyperPod's node recovery removing a broken
    machine) while ``nodeFailureGraceSeconds`` (600 s) is still running: kube-controller-manager's pod garbage
    collector deletes the orphaned pod first (its quarantine is 40 s). The restart is a ``NodeFailure`` naming the
    deleted node, not a ``PodDeleted`` blamed on a person (the collector's ``DisruptionTarget`` where the operator
    read the pod before it went; ``status.observation.nodesMissingSince`` where it did not: test_decide_failure)."""
    _claim(control_plane, namespace, "ckpt", tmp_path)
    zone = f"{namespace}-z"
    nodes = [f"{zone}{i}" for i in range(2)]
    with _ready_nodes(kube, nodes):
        for n in nodes:
            kube.patch(NODES, None, n, {"metadata": {"labels": {ZONE: zone}}})
        spec = _whole_node_spec(2, zone)
        spec["runPolicy"].update(nodeFailureGraceSeconds=600, maxRestarts=3)
        kube.apply(lpt("gone", spec, namespace=namespace))
        wait_for(lambda: len(kube.pods(namespace, "gone")) == 2 and all(
            p["spec"].get("nodeName") for p in kube.pods(namespace, "gone")), 60, "the gang bound, a pod per node")
        pods = {p["spec"]["nodeName"]: p["metadata"]["name"] for p in kube.pods(namespace, "gone")}
        lost = nodes[1]
        nodes.remove(lost)  # its heartbeat stops
        kube.delete(NODES, None, lost)
        wait_for(lambda: kube.get(PODS, namespace, pods[lost]) is None, 150,
                 f"the pod garbage collector deletes pod {pods[lost]} of the deleted node {lost}")
        record = wait_for(lambda: (kube.status(namespace, "gone").get("restarts") or [None])[0], 60,
                          "the restart recorded")
        assert record["cause"] == "NodeFailure" and record.get("nodeName") == lost, record
        # the collector marks the pod (DisruptionTarget DeletionByPodGC) and deletes it: a cycle that reads the pod
        # in between names the condition; one that finds it gone already puts the disappearance down to the node
        assert lost in record["message"] and ("DeletionByPodGC" in record["message"]
                                              or "pod garbage collector" in record["message"]), record
        assert kube.status(namespace, "gone")["restartCount"] == 1
        kube.delete(LPT, namespace, "gone")


ELASTIC_NODES, ELASTIC_STEPS, ELASTIC_INTERVAL, GLOBAL_BATCH = 2, 30, 5, 4
ELASTIC_HOLDS = (6, 11, 16)
"""The steps after which the trainers are held (``support.hold``) while the elastic scenario's node changes land:
attempt 0 after its step-5 checkpoint (its rank 1's node goes silent there); attempt 1 (one rank, resumed from
step 5) after its step-10 checkpoint until the grow is planned (a replacement node joined and has been Ready for
``growCheckSeconds``), and after its step-15 checkpoint until the grow's SIGTERM has reached it (else it could train
to the end first); attempt 2 trains the rest at 2 nodes. Until now attempt 1 trained ~60 steps between its first
step and the grow (140 steps in all) only to outlast the node's registration and the grow check. 2 -> 1 -> 2 nodes,
not 3 -> 2 -> 3: every assertion holds at either size (a gang of several pods shrinks and grows, gradient
accumulation 2 at 2 nodes and 4 at 1), with 5 pod starts instead of 8."""


def _ledger(ckpt: Path) -> list[tuple[int, ...]]:
    """Every distinct (step, global position, source, window, epoch) any rank of any attempt trained, by position.
    A step trained again after a lost attempt is the same rows (the same samples at the same step): one row."""
    rows: set[tuple[int, ...]] = set()
    for f in (ckpt / "kubetitan" / "ledger").glob("rank-*.txt"):
        rows |= {tuple(int(v) for v in line.split()) for line in f.read_text().splitlines() if line.strip()}
    return sorted(rows, key=lambda r: (r[1], r[0]))


def test_an_elastic_run_shrinks_when_a_node_is_lost_and_grows_when_a_replacement_joins(
        kube: KubeCluster, control_plane: ControlPlane, fast_operator: OperatorProcess, namespace: str,
        tmp_path: Path) -> None:
    """2 nodes, ``elastic {minNodes: 1}``, global batch 4 (gradient accumulation 2 at 2 nodes, 4 at 1). At attempt
    0's first checkpoint rank 1's node goes silent: NotReady by the node lifecycle controller, the run waits for a
    replacement (``Ready=False/WaitingForReplacement``), then after ``shrinkAfterSeconds`` shrinks 2 -> 1 (cause
    ``Shrink``, no ``NodeFailure`` record) and kube-scheduler places attempt 1 on the Ready node. The broken
    node is then deleted and a new one registers: at attempt 1's next checkpoint the gang grows back to 2 onto it
    (cause ``Grow``, no step lost: the old gang saved on SIGTERM). Every rank's sample ledger shows each global
    sample trained exactly once, at the step its position says, across 2 -> 1 -> 2; every step trained the same
    number of tokens at both sizes."""
    ckpt = _checkpoint_claim(control_plane, namespace, tmp_path)
    spec = e2e_elastic_spec(ckpt, ELASTIC_STEPS, ELASTIC_INTERVAL, free_port(), GLOBAL_BATCH,
                            {"shrinkAfterSeconds": 2, "growCheckSeconds": 2}, nodes=ELASTIC_NODES)
    # hangTimeoutSeconds above the node lifecycle controller's grace, as in the CPU run: the silent node must be
    # seen NotReady (WaitingForReplacement, then Shrink) before the frozen gang counts as hung (at load 10-14 the
    # node took over 10 s to turn NotReady and a Hang restart came first)
    # (and Fixed: the launchers' Auto watchdog would stop a worker held longer than 30 s, on a loaded machine)
    spec["runPolicy"].update(hangTimeoutSeconds=60, hangTimeoutPolicy="Fixed")
    st = lambda: kube.status(namespace, "el")  # noqa: E731
    cond = lambda t: next((c for c in st().get("conditions") or [] if c["type"] == t), None)  # noqa: E731
    held = tmp_path / "held"
    with Kubelet(kube, tmp_path / "kubelet", nodes=ELASTIC_NODES, claims={CLAIM: ckpt}, node_prefix=f"{namespace}-n",
                 poll=POLL_SECONDS, ledger=True) as k, _explained(lambda: _diagnosis(kube, k, namespace, "el")):
        k.env.update(hold.env(held, *ELASTIC_HOLDS))
        kube.apply(lpt("el", spec, namespace=namespace))
        running = lambda: st().get("phase") not in ("Succeeded", "Failed")  # noqa: E731
        hold.wait_held(held, ELASTIC_HOLDS[0], ranks=2, alive=running, timeout=START)
        wait_for(lambda: complete_checkpoints(ckpt) == [ELASTIC_INTERVAL], 60, "attempt 0's step-5 checkpoint")
        a0 = _attempt_pods(kube, namespace, "el", 0)
        assert len({p["spec"]["nodeName"] for p in a0}) == 2  # elastic: one pod per node (anti-affinity)
        lost = next(p["spec"]["nodeName"] for p in a0 if p["metadata"]["name"].endswith("-1"))
        k.fail_node(lost)
        hold.go(held, ELASTIC_HOLDS[0])  # rank 0 goes on into a collective its frozen peer never joins
        waiting = wait_for(lambda: (c := cond(C.READY)) and c["reason"] == C.WAITING_FOR_REPLACEMENT and c, 60,
                           "Ready=False/WaitingForReplacement once the node is NotReady")
        assert f"node {lost} of pod el-a0-1 is lost" in waiting["message"], waiting
        wait_for(lambda: st().get("resizeCount") == 1, 120, "the shrink")
        wait_for(lambda: len(_attempt_pods(kube, namespace, "el", 1)) == 1 and all(
            p["spec"].get("nodeName") for p in _attempt_pods(kube, namespace, "el", 1)), 60, "attempt 1 bound")
        a1 = _attempt_pods(kube, namespace, "el", 1)
        assert lost not in {p["spec"]["nodeName"] for p in a1}
        assert all("--nnodes=1" in p["spec"]["containers"][0]["args"] for p in a1), a1
        assert (cond(C.FULL_SIZE)["status"], cond(C.FULL_SIZE)["reason"]) == ("False", C.SHRUNK)
        hold.wait_held(held, ELASTIC_HOLDS[1], ranks=1, alive=running, timeout=START)
        assert [r["attempt"] for r in step_log(ckpt) if r["step"] == ELASTIC_HOLDS[1]] == [1]
        # the broken machine is replaced (its Node deleted, a new one registers): the grow is planned for attempt
        # 1's next checkpoint, and the gang grows onto the new node there
        new = k.replace_node(lost)
        planned = wait_for(lambda: (c := cond(C.FULL_SIZE)) and c["reason"] == C.GROW_PLANNED and c, 120,
                           "FullSize=False/GrowPlanned once the replacement node has been Ready for growCheckSeconds")
        assert st().get("resizeCount") == 1 and "it grows to 2 right after" in planned["message"], planned
        hold.go(held, ELASTIC_HOLDS[1])
        hold.wait_held(held, ELASTIC_HOLDS[2], ranks=1, alive=running, timeout=START)
        wait_for(lambda: st().get("resizeCount") == 2, 120, "the grow at attempt 1's next checkpoint")
        wait_for(lambda: (stops := hold.stop_files(held, ELASTIC_HOLDS[2])) and all(f.exists() for f in stops), 60,
                 "the grow's SIGTERM at attempt 1's launcher")
        hold.go(held, ELASTIC_HOLDS[2])  # it saves step 16 and stops; attempt 2 resumes there at 2 nodes
        wait_for(lambda: len({p["spec"].get("nodeName") for p in _attempt_pods(kube, namespace, "el", 2)} - {None})
                 == 2, 60, "attempt 2 bound on 2 nodes")
        assert new in {p["spec"]["nodeName"] for p in _attempt_pods(kube, namespace, "el", 2)}
        assert kube.get(NODES, None, lost) is None
        assert not [p["metadata"]["name"] for p in kube.pods(namespace, "el") if p["spec"].get("nodeName") == lost]
        wait_for(lambda: st().get("phase") == "Succeeded", START, "Succeeded")
        s = st()
        shrink, grow = s["restarts"]
        assert (shrink["cause"], shrink["fromNodes"], shrink["toNodes"], shrink["attempt"]) == ("Shrink", 2, 1, 0)
        assert (grow["cause"], grow["fromNodes"], grow["toNodes"], grow["attempt"]) == ("Grow", 1, 2, 1), grow
        assert grow["lostSteps"] == 0, grow  # the planned grow saved (SIGTERM) before the new gang started
        assert (s["attempt"], s["nodes"], s["restartCount"], s["resizeCount"]) == (2, 2, 0, 2), s
        assert cond(C.FULL_SIZE)["status"] == "True"
    assert not k.errors, k.errors
    # the step log: every attempt trains the global batch each step, at both sizes
    log = step_log(ckpt)
    assert {r["attempt"] for r in log} == {0, 1, 2}
    assert len({b["tokens"] - a["tokens"] for a, b in zip(log, log[1:]) if b["step"] == a["step"] + 1}) == 1
    assert max(r["step"] for r in log) == ELASTIC_STEPS and ELASTIC_STEPS in complete_checkpoints(ckpt)
    # the ledger: each global sample once, at the step its position says, across 2 -> 1 -> 2
    rows = _ledger(ckpt)
    assert [r[1] for r in rows] == list(range(ELASTIC_STEPS * GLOBAL_BATCH)), "a sample skipped or trained twice"
    assert all(step == pos // GLOBAL_BATCH + 1 for step, pos, *_ in rows), "a sample trained at another step"
    files = {f.name for f in (ckpt / "kubetitan" / "ledger").glob("rank-*.txt")}
    assert {"rank-0-of-2.txt", "rank-1-of-2.txt", "rank-0-of-1.txt"} <= files, files
