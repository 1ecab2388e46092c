"""The real operator (kopf, in-process) against kmockx: the lifecycle scenarios of issue 4.

Tests play the kubelet by patching pod status and serve rank 0's metrics from a real exporter on
127.0.0.1. They share ports and CPU, so they run in one xdist group.
"""

from __future__ import annotations

import copy
import json

import pytest

from kmockx.harness import CMS, LPT, PODS, SVCS, Cluster, Operator, ScaledClock, free_port, wait_for
from support.specs import NS, cpu_spec, lpt
from kubetitan_core import validation
from kubetitan import plan
from kubetitan.timestamps import parse_time

pytestmark = pytest.mark.xdist_group("operator-kmock")


def _phase(c: Cluster, name: str) -> str | None:
    return c.status(NS, name).get("phase")


def _running(c: Cluster, name: str, attempt: int, nodes: int = 2) -> None:
    for r in range(nodes):
        c.run_pod(NS, f"{name}-a{attempt}-{r}", f"node-{r}")


def test_apply_creates_children_as_rendered(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r1", cpu_spec(nodes=3)))
        wait_for(lambda: len(cluster.pod_names(NS, "r1")) == 3, 20, "3 pods")
        obj = cluster.lpt(NS, "r1")
        parsed, errs = validation.parse(obj)
        assert not errs and parsed is not None
        start = parse_time(obj["status"]["startTime"])
        want = plan.attempt_children(parsed, 0, job_start_time=start)
        for child in want:
            res = {"Pod": PODS, "ConfigMap": CMS, "Service": SVCS}[child["kind"]]
            got = cluster.get(res, NS, child["metadata"]["name"])
            assert got is not None, child["metadata"]["name"]
            assert got["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
            assert got["metadata"]["labels"] == child["metadata"]["labels"]
            if child["kind"] == "ConfigMap":  # the rendered trainer config, and the spec the attempt came from
                assert got["data"] == {**child["data"], "applied-spec.json": json.dumps(
                    parsed.spec.model_dump(by_alias=True, exclude_none=True, mode="json"), sort_keys=True,
                    separators=(",", ":"))}
            else:  # the whole rendered spec, exactly
                assert got["spec"] == child["spec"]
        assert cluster.pod_names(NS, "r1") == ["r1-a0-0", "r1-a0-1", "r1-a0-2"]
        wait_for(lambda: _phase(cluster, "r1") == "Starting", 5, "phase Starting")


def test_running_with_metrics_fills_training_status(cluster: Cluster, rank0) -> None:
    with Operator(cluster) as op:
        cluster.apply(lpt("r2", cpu_spec(), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "r2")) == 2, 20, "pods")
        _running(cluster, "r2", 0)
        rank0.step(42, checkpoint=40, loss=2.25)
        t = wait_for(lambda: (cluster.status(NS, "r2").get("training") or {}).get("step") == 42
                     and cluster.status(NS, "r2")["training"], 20, "training status")
        assert t["loss"] == 2.25 and t["lastCheckpointStep"] == 40 and t["progress"] == "42/100"
        assert t["tokensPerSecond"] == 8192.0 and t["mfu"] == 0.4 and t["tflopsPerGpu"] == 400.0
        assert 0 < t["goodput"] <= 1 and t["eta"]
        wait_for(lambda: _phase(cluster, "r2") == "Running", 5, "phase Running")
        assert cluster.condition(NS, "r2", "Ready")["status"] == "True"
        wait_for(lambda: op.metric("kubetitan_operator_job_step", {"namespace": NS, "name": "r2"}) == 42, 5,
                 "per-job gauge")


@pytest.mark.parametrize(
    ("exit_code", "reason", "cause"),
    [(1, "Error", "ContainerFailed"), (137, "OOMKilled", "OOMKilled"), (3, "Error", "NonFiniteLoss")],
    ids=["exit-1", "oom", "nan-loss"],
)
def test_pod_failure_restarts_whole_gang(cluster: Cluster, rank0, exit_code: int, reason: str, cause: str) -> None:
    with Operator(cluster) as op:
        cluster.apply(lpt("r3", cpu_spec(), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "r3")) == 2, 20, "pods")
        _running(cluster, "r3", 0)
        rank0.step(15, checkpoint=10)
        wait_for(lambda: _phase(cluster, "r3") == "Running", 20, "Running")
        cluster.terminate_pod(NS, "r3-a0-1", exit_code, reason)
        wait_for(lambda: cluster.pod_names(NS, "r3") == ["r3-a1-0", "r3-a1-1"], 20, "attempt 1 pods only")
        st = cluster.status(NS, "r3")
        assert st["attempt"] == 1 and st["restartCount"] == 1
        rec = st["restarts"][0]
        assert rec["cause"] == cause and rec["attempt"] == 0 and rec["resumedFromStep"] == 10
        assert rec["lostSteps"] == 5 and "r3-a0-1" in rec["message"]
        assert op.metric("kubetitan_operator_restarts_total", {"namespace": NS, "name": "r3", "cause": cause,
                                                                 "mode": "Recreate"}) == 1
        wait_for(lambda: op.metric("kubetitan_operator_recovery_duration_seconds_count") == 1, 5, "recovery histogram")
        wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == f"Restart{cause}"], 5,
                 "restart event")


def test_hang_restarts(cluster: Cluster, rank0) -> None:
    # Real time until the gang trains (a fast clock would also age the operator's other grace periods
    # while a loaded machine delivers pod events late), then 10x: hangTimeoutSeconds=10 passes in ~1 s.
    # Not faster: the scaled clock runs ahead of the API server's timestamps by what it skipped, and past
    # decide.MISSING_POD_GRACE_SECONDS (30 s) a new pod that the index has not shown yet counts as
    # disappeared (hangTimeoutSeconds=30 at 60x put the clock 32 s ahead: attempt 1 was restarted at once).
    clock = ScaledClock(rate=1.0)
    rank0.clock = clock
    with Operator(cluster, clock=clock):
        cluster.apply(lpt("r4", cpu_spec(hangTimeoutSeconds=10), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "r4")) == 2, 20, "pods")
        _running(cluster, "r4", 0)
        rank0.step(5)  # then never again
        wait_for(lambda: (cluster.status(NS, "r4").get("training") or {}).get("step") == 5, 20, "step 5 seen")
        clock.set_rate(10.0)
        wait_for(lambda: cluster.status(NS, "r4").get("restartCount") == 1, 20, "hang restart")
        clock.set_rate(1.0)  # back to real time: the new attempt's pods are not hung, only not yet running
        assert cluster.status(NS, "r4")["restarts"][0]["cause"] == "Hang"
        try:
            wait_for(lambda: cluster.pod_names(NS, "r4") == ["r4-a1-0", "r4-a1-1"], 20, "attempt 1")
        except AssertionError as e:  # say what was there instead
            st = cluster.status(NS, "r4")
            raise AssertionError(f"{e}; pods {cluster.pod_names(NS, 'r4')}, attempt {st.get('attempt')}, "
                                 f"restarts {st.get('restarts')}, conditions {st.get('conditions')}") from None


def test_node_not_ready_force_deletes_and_restarts(cluster: Cluster) -> None:
    cluster.add_node("node-0")
    cluster.add_node("node-1")
    with Operator(cluster):
        cluster.apply(lpt("r5", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "r5")) == 2, 20, "pods")
        _running(cluster, "r5", 0)
        # The pod on node-1 is stuck terminating (a finalizer stands in for the dead kubelet).
        cluster.patch(PODS, NS, "r5-a0-1", {"metadata": {"finalizers": ["test/stuck"]}})
        cluster.set_node_ready("node-1", False)
        wait_for(lambda: cluster.status(NS, "r5").get("restartCount") == 1, 20, "restart")
        rec = cluster.status(NS, "r5")["restarts"][0]
        assert rec["cause"] == "NodeFailure" and rec["nodeName"] == "node-1"
        wait_for(lambda: {"r5-a1-0", "r5-a1-1"} <= set(cluster.pod_names(NS, "r5")), 20, "attempt 1")
        deletes = [r for r in list(cluster.k) if r.method.value == "DELETE" and r.name == "r5-a0-1"]
        assert any((r.data or {}).get("gracePeriodSeconds") == 0 for r in deletes), "no force delete"


def test_image_pull_error_fails_without_retry(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r6", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "r6")) == 2, 20, "pods")
        cluster.wait_pod(NS, "r6-a0-0", "ImagePullBackOff", 'Back-off pulling image "nope"')
        wait_for(lambda: _phase(cluster, "r6") == "Failed", 20, "Failed")
        failed = cluster.condition(NS, "r6", "Failed")
        assert failed["reason"] == "ImagePullFailed" and "spec.resources.image" in failed["message"]
        st = cluster.status(NS, "r6")
        assert st.get("restartCount", 0) == 0 and st["attempt"] == 0
        wait_for(lambda: cluster.pod_names(NS, "r6") == [], 20, "cleanup of pending pods")


def test_max_restarts_exhausted_fails_with_message(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r7", cpu_spec(maxRestarts=1)))
        for attempt in (0, 1):
            wait_for(lambda a=attempt: f"r7-a{a}-0" in cluster.pod_names(NS, "r7"), 10, f"attempt {attempt}")
            cluster.terminate_pod(NS, f"r7-a{attempt}-0", 1, "Error", "RuntimeError: boom")
        wait_for(lambda: _phase(cluster, "r7") == "Failed", 20, "Failed")
        failed = cluster.condition(NS, "r7", "Failed")
        assert failed["reason"] == "MaxRestartsExceeded"
        assert "maxRestarts=1" in failed["message"] and "boom" in failed["message"]
        assert cluster.status(NS, "r7")["restartCount"] == 1


def test_suspend_and_resume(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r8", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "r8")) == 2, 20, "pods")
        _running(cluster, "r8", 0)
        cluster.patch(LPT, NS, "r8", {"spec": {"runPolicy": {"suspend": True}}})
        wait_for(lambda: _phase(cluster, "r8") == "Suspended", 20, "Suspended")
        wait_for(lambda: cluster.pod_names(NS, "r8") == [], 20, "pods stopped")
        graceful = [r for r in list(cluster.k) if r.method.value == "DELETE" and (r.name or "").startswith("r8-a0")]
        assert graceful and all("gracePeriodSeconds" not in (r.data or {}) for r in graceful)
        cluster.patch(LPT, NS, "r8", {"spec": {"runPolicy": {"suspend": False}}})
        wait_for(lambda: cluster.pod_names(NS, "r8") == ["r8-a1-0", "r8-a1-1"], 20, "resumed as attempt 1")
        st = cluster.status(NS, "r8")
        assert st.get("restartCount", 0) == 0 and cluster.condition(NS, "r8", "Suspended")["status"] == "False"


def test_success_on_rank0_exit_0_cleans_up(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r9", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "r9")) == 2, 20, "pods")
        _running(cluster, "r9", 0)
        cluster.terminate_pod(NS, "r9-a0-0", 0, "Completed")
        wait_for(lambda: _phase(cluster, "r9") == "Succeeded", 20, "Succeeded")
        # cleanupPolicy Running (default): the still-running rank goes, the finished rank 0 stays
        wait_for(lambda: cluster.pod_names(NS, "r9") == ["r9-a0-0"], 20, "cleanup")
        assert cluster.status(NS, "r9")["completionTime"]


def test_delete_removes_every_child(cluster: Cluster) -> None:
    with Operator(cluster):
        cluster.apply(lpt("r10", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "r10")) == 2, 20, "pods")
        cluster.delete(LPT, NS, "r10")
        wait_for(lambda: cluster.lpt(NS, "r10") is None, 20, "finalizer released")
        # The (emulated) garbage collector removes the children after their owner is gone.
        wait_for(lambda: cluster.pod_names(NS, "r10") == [], 20, "pods collected")
        wait_for(lambda: cluster.get(CMS, NS, "r10-config") is None and cluster.get(SVCS, NS, "r10") is None, 20,
                 "config map and service collected")


def test_operator_killed_mid_reconcile_no_duplicates(cluster: Cluster) -> None:
    import asyncio

    gate = asyncio.Event()

    async def hold_rank2(request):  # the API server stalls while the operator creates rank 2
        if request.method.value == "POST" and (request.data or {}).get("metadata", {}).get("name") == "r11-a0-2":
            await gate.wait()

    cluster.k.hooks.append(hold_rank2)
    op = Operator(cluster).__enter__()
    cluster.apply(lpt("r11", cpu_spec(nodes=4)))
    wait_for(lambda: len(cluster.pod_names(NS, "r11")) >= 2, 20, "some pods")
    op.stop_flag.set()  # "kill": the in-flight cycle is cancelled mid-creation
    op.thread.join(20)
    cluster.k.hooks.clear()
    cluster.loop.call_soon_threadsafe(gate.set)
    with Operator(cluster):
        wait_for(lambda: len(cluster.pod_names(NS, "r11")) == 4, 20, "all 4 pods")
        import time
        time.sleep(0.5)  # a few more cycles: nothing new may appear
        assert cluster.pod_names(NS, "r11") == [f"r11-a0-{r}" for r in range(4)]
        assert cluster.status(NS, "r11")["attempt"] == 0
        assert len(cluster.list(CMS, NS)) == 1 and len(cluster.list(SVCS, NS)) == 1


def test_invalid_spec_sets_condition_and_creates_nothing(cluster: Cluster) -> None:
    bad = cpu_spec()
    bad["checkpoint"]["storage"] = {"hostPath": "/ckpt"}  # per node: invalid for 2 nodes
    with Operator(cluster):
        cluster.apply(lpt("r12", bad))
        cond = wait_for(lambda: cluster.condition(NS, "r12", "Ready"), 20, "Ready condition")
        assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert "spec.checkpoint.storage.hostPath" in cond["message"]
        assert cluster.pod_names(NS, "r12") == [] and cluster.list(CMS, NS) == []


# ------------------------------------------------------------------ the cluster edge (issue 14)
class Faults:
    """A kmockx hook on the operator's writes: a scripted burst of refusals on pod creates, then a seeded share
    of 429 (Retry-After 0) / 503 answers on every write. Raised aiohttp HTTP errors become the API's answer."""

    def __init__(self, share: float = 0.2, refusals: tuple[tuple[int, str], ...] = (), seed: int = 14) -> None:
        import random

        self.rng, self.share, self.refusals = random.Random(seed), share, list(refusals)
        self.injected: dict[int, int] = {}
        self.status_writes: list[dict] = []
        self.pod_creates: list[str] = []

    async def __call__(self, request) -> None:
        import aiohttp.web

        res = request.resource
        method = request.method.value if request.method else ""
        if res is None or res.plural == "namespaces":
            return
        if res.plural == "pods" and method == "POST":
            self.pod_creates.append(((request.data or {}).get("metadata") or {}).get("name", ""))
            if self.refusals:
                code, msg = self.refusals.pop(0)
                self._count(code)
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                        "reason": "Forbidden" if code == 403 else "Invalid", "message": msg}
                raise (aiohttp.web.HTTPForbidden if code == 403 else aiohttp.web.HTTPUnprocessableEntity)(
                    text=json.dumps(body), content_type="application/json")
        if self.rng.random() < self.share:
            if self.rng.random() < 0.5:
                self._count(429)
                raise aiohttp.web.HTTPTooManyRequests(headers={"Retry-After": "0"})
            self._count(503)
            raise aiohttp.web.HTTPServiceUnavailable()
        if request.subresource == "status" and res.plural == "llamapretrains":
            self.status_writes.append(copy.deepcopy(request.data or {}))

    def _count(self, code: int) -> None:
        self.injected[code] = self.injected.get(code, 0) + 1


QUOTA = 'pods "r-a0-1" is forbidden: exceeded quota: team-quota, requested: cpu=8, used: cpu=8, limited: cpu=8'
PSA = 'pods "r-a0-1" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false'


def _conditions_written(f: Faults, type_: str) -> list[tuple[str, str]]:
    return [(c["status"], c["reason"]) for w in f.status_writes for c in (w.get("status") or {}).get("conditions") or []
            if c.get("type") == type_]


def test_api_faults_no_restart_no_duplicates(cluster: Cluster, rank0) -> None:
    """429/503 on 20% of the operator's writes and a burst of 403/422 on pod create: the run starts and succeeds
    with no restart, each child exists once, and the refusal is a condition and an Event (kubectl describe)."""
    from test_kubectl import kubectl

    faults = Faults(0.2, refusals=((403, QUOTA),) * 3 + ((422, PSA),) * 2)
    assert cluster.k is not None
    cluster.k.hooks.append(faults)
    with Operator(cluster):
        cluster.apply(lpt("r", cpu_spec(), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "r")) == 2, 60, "both pods despite the refusals")
        assert cluster.pod_names(NS, "r") == ["r-a0-0", "r-a0-1"]
        written = _conditions_written(faults, "ChildrenCreated")
        assert ("False", "Forbidden") in written or ("False", "Invalid") in written, written
        events = wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == "FailedCreate"],
                          20, "FailedCreate event")
        assert any("exceeded quota" in e["message"] or "PodSecurity" in e["message"] for e in events), events
        out = kubectl(cluster, "describe", "lpt", "r", "-n", NS)
        assert "Children Created" in out or "ChildrenCreated" in out, out
        assert "FailedCreate" in out, out
        _running(cluster, "r", 0)
        rank0.step(100, checkpoint=100)
        wait_for(lambda: (cluster.condition(NS, "r", "ChildrenCreated") or {}).get("status") == "True", 30,
                 "ChildrenCreated=True once both pods exist")
        cluster.terminate_pod(NS, "r-a0-1", 0, "Completed")
        cluster.terminate_pod(NS, "r-a0-0", 0, "Completed")
        wait_for(lambda: _phase(cluster, "r") == "Succeeded", 60, "Succeeded")
    st = cluster.status(NS, "r")
    assert st["restartCount"] == 0 and not st.get("restarts")
    assert set(faults.pod_creates) == {"r-a0-0", "r-a0-1"}, "no pod of another attempt was ever created"
    assert faults.injected.get(403) == 3 and faults.injected.get(422) == 2
    assert faults.injected.get(429, 0) + faults.injected.get(503, 0) > 0
    phases = [p for w in faults.status_writes if (p := (w.get("status") or {}).get("phase"))]
    assert set(phases) <= {"Pending", "Starting", "Running", "Succeeded"}, phases  # never Restarting or Failed


def test_metrics_unreachable_for_a_whole_run_succeeds_without_restart(cluster: Cluster) -> None:
    """rank 0's /metrics never answers (the trainer binds elsewhere / a NetworkPolicy drops the scrape) and the
    clock runs 300x, far past startupTimeoutSeconds and hangTimeoutSeconds: no restart, MetricsAvailable=False,
    and the operator restarted mid-run goes on from the status. (300x: 10 clock minutes are 2 s, about 20 of the
    harness operator's 0.1 s cycles, each of which would restart a run it took for hung or never started.)"""
    clock = ScaledClock(rate=1.0)  # real time until the pods run: pod timestamps come from the server's clock
    spec = cpu_spec(startupTimeoutSeconds=10, hangTimeoutSeconds=10)
    with Operator(cluster, clock=clock):
        cluster.apply(lpt("mu", spec, metrics_port=free_port()))  # nothing listens there: every scrape is refused
        wait_for(lambda: len(cluster.pod_names(NS, "mu")) == 2, 20, "pods")
        _running(cluster, "mu", 0)
        c = wait_for(lambda: (m := cluster.condition(NS, "mu", "MetricsAvailable")) and m["status"] == "False" and m,
                     20, "MetricsAvailable=False")
        assert c["reason"] == "ScrapeFailed" and "/metrics" in c["message"] and "Cannot connect" in c["message"], c
        first = clock()
        clock.set_rate(300.0)
        wait_for(lambda: clock() - first > 600, 30, "10 clock minutes")  # 300x: ~2 s
    # a new operator process state: only the API's status
    with Operator(cluster, clock=clock):
        wait_for(lambda: clock() - first > 1200, 30, "another 10 clock minutes under the new operator")
        assert cluster.pod_names(NS, "mu") == ["mu-a0-0", "mu-a0-1"]
        cluster.terminate_pod(NS, "mu-a0-1", 0, "Completed")
        cluster.terminate_pod(NS, "mu-a0-0", 0, "Completed")
        wait_for(lambda: _phase(cluster, "mu") == "Succeeded", 20, "Succeeded")
    st = cluster.status(NS, "mu")
    assert st["restartCount"] == 0 and not st.get("restarts") and st["attempt"] == 0
    assert (cluster.condition(NS, "mu", "MetricsAvailable") or {}).get("status") == "False"


def _requests(c: Cluster, verb: str, path_part: str) -> list[str]:
    """Paths of the operator's requests (the double's request log) with this verb whose path has ``path_part``."""
    assert c.k is not None
    return [e.path for e in c.k.log if e.verb == verb and path_part in e.path and e.user != "system:admin"]


def test_children_deleted_by_hand_are_recreated_within_one_cycle_without_a_restart(cluster: Cluster) -> None:
    """The ConfigMap and the Service of a running attempt deleted by hand: the deletion's watch event wakes the
    run (scan interval 1 h: no periodic cycle comes), both are created again from the attempt's spec, and the
    gang goes on (same pods, attempt 0, no restart, no pod deleted). Its pods run, waiting for the first step (no
    rank 0 answers here: MetricsUnavailable)."""
    with Operator(cluster, scan_interval=3600.0):
        cluster.apply(lpt("rc", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "rc")) == 2, 20, "pods")
        _running(cluster, "rc", 0)
        wait_for(lambda: (cluster.condition(NS, "rc", "Ready") or {}).get("reason") in ("WaitingForFirstStep", "MetricsUnavailable"), 20,
                 "both pods seen running")
        cm, svc = cluster.get(CMS, NS, "rc-config"), cluster.get(SVCS, NS, "rc")
        cluster.delete(CMS, NS, "rc-config")
        cluster.delete(SVCS, NS, "rc")
        # (the ConfigMap may already be back before the Service is deleted: the operator is woken by each deletion)
        def again(res: str, name: str, old: dict) -> dict | None:
            new = cluster.get(res, NS, name)
            return new if new and new["metadata"]["uid"] != old["metadata"]["uid"] else None

        cm2 = wait_for(lambda: again(CMS, "rc-config", cm), 20, "the ConfigMap created again")
        svc2 = wait_for(lambda: again(SVCS, "rc", svc), 20, "the Service created again")
        assert cm2["data"] == cm["data"] and cm2["metadata"].get("annotations") == cm["metadata"].get("annotations")
        assert svc2["spec"]["ports"] == svc["spec"]["ports"]
        assert cm2["metadata"]["ownerReferences"] == cm["metadata"]["ownerReferences"]
        wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == "RecreatedChildren"], 20,
                 "the RecreatedChildren Event")
    st = cluster.status(NS, "rc")
    assert st["attempt"] == 0 and st["restartCount"] == 0 and st["phase"] == "Starting" and not st.get("restarts")
    assert cluster.pod_names(NS, "rc") == ["rc-a0-0", "rc-a0-1"]
    assert not _requests(cluster, "delete", "/pods/"), "a pod was deleted"
    assert len(_requests(cluster, "create", "/configmaps")) == 2 and len(_requests(cluster, "create", "/services")) == 2


def test_pod_deleted_by_hand_after_being_seen_restarts_the_gang_as_pod_deleted(cluster: Cluster) -> None:
    """A rank's pod that the operator has seen, deleted by someone else: the attempt has lost a rank, so the gang
    is re-created (attempt 1, cause PodDeleted, counted in the restart metric); a rank never seen is created."""
    with Operator(cluster) as op:
        cluster.apply(lpt("pd", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "pd")) == 2, 20, "pods")
        _running(cluster, "pd", 0)
        wait_for(lambda: cluster.status(NS, "pd").get("observation", {}).get("ranksSeen") == [0, 1], 20,
                 "both ranks seen (status.observation)")
        cluster.delete(PODS, NS, "pd-a0-1")
        wait_for(lambda: cluster.pod_names(NS, "pd") == ["pd-a1-0", "pd-a1-1"], 30, "attempt 1's pods")
        st = cluster.status(NS, "pd")
        assert st["restartCount"] == 1 and [r["cause"] for r in st["restarts"]] == ["PodDeleted"], st["restarts"]
        assert "rank 1" in st["restarts"][0]["message"] and "disappeared" in st["restarts"][0]["message"]
        assert op.metric("kubetitan_operator_restarts_total",
                         {"namespace": NS, "name": "pd", "cause": "PodDeleted", "mode": "Recreate"}) == 1.0
        events = [e for e in cluster.list("v1/events", NS) if e.get("reason") == "RestartPodDeleted"]
        assert len(events) == 1, events


def test_cleanup_policy_none_keeps_every_pod_when_the_run_fails(cluster: Cluster) -> None:
    """runPolicy.cleanupPolicy None: a run that fails (a configuration error, exit 2) keeps the failed pod and the
    still-running one for ``kubectl logs``: the operator sends no pod DELETE (request log)."""
    with Operator(cluster):
        cluster.apply(lpt("cn", cpu_spec(cleanupPolicy="None")))
        wait_for(lambda: len(cluster.pod_names(NS, "cn")) == 2, 20, "pods")
        _running(cluster, "cn", 0)
        cluster.terminate_pod(NS, "cn-a0-1", 2, "Error", "bad flavour")
        wait_for(lambda: _phase(cluster, "cn") == "Failed", 20, "Failed")
        assert cluster.condition(NS, "cn", "Failed")["reason"] == "ConfigError"
    assert cluster.pod_names(NS, "cn") == ["cn-a0-0", "cn-a0-1"]
    assert not _requests(cluster, "delete", "/pods/"), "a pod was deleted despite cleanupPolicy None"


def _status_writes(c: Cluster, name: str) -> list[dict]:
    """The status the operator held after each of its status writes (its merge patches applied in order)."""
    assert c.k is not None
    out, cur = [], {}
    for r in list(c.k):
        if r.method == "PATCH" and r.subresource == "status" and r.name == name and isinstance(r.data, dict):
            cur = {**cur, **{k: v for k, v in (r.data.get("status") or {}).items() if v is not None}}
            out.append(cur)
    return out


def test_raising_steps_mid_run_trains_on_in_a_new_attempt(cluster: Cluster, rank0) -> None:
    """spec.training.steps raised from 100 to 150 while attempt 0 trains: its trainer (created with 100) exits 0
    at step 100, and the run is NOT Succeeded there: attempt 1 is created from the raised spec (its ConfigMap's
    trainer config and applied-spec.json say 150) with no restart counted, a Normal Event StepsRaised says
    why, and only attempt 1's exit 0 at step 150 ends the run."""
    with Operator(cluster):
        cluster.apply(lpt("sr", cpu_spec(), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "sr")) == 2, 20, "pods")
        _running(cluster, "sr", 0)
        rank0.step(60, checkpoint=60)
        wait_for(lambda: (cluster.status(NS, "sr").get("training") or {}).get("step") == 60, 20, "step 60")
        cluster.patch(LPT, NS, "sr", {"spec": {"training": {"steps": 150}}})
        wait_for(lambda: cluster.status(NS, "sr")["training"].get("totalSteps") == 150, 20, "the new total shown")
        rank0.step(100, checkpoint=100)
        wait_for(lambda: cluster.status(NS, "sr")["training"].get("step") == 100, 20, "step 100")
        cluster.terminate_pod(NS, "sr-a0-1", 0, "Completed")
        cluster.terminate_pod(NS, "sr-a0-0", 0, "Completed")  # attempt 0's trainer is done: its 100 steps
        wait_for(lambda: cluster.pod_names(NS, "sr") == ["sr-a1-0", "sr-a1-1"], 30, "attempt 1's pods")
        st = cluster.status(NS, "sr")
        assert st["phase"] != "Succeeded" and st["attempt"] == 1 and st["restartCount"] == 0 and not st.get("restarts")
        cm = cluster.get(CMS, NS, "sr-config")
        applied = json.loads(cm["data"]["applied-spec.json"])
        assert applied["training"]["steps"] == 150 and "steps = 150" in cm["data"]["trainer.toml"]
        events = [e for e in cluster.list("v1/events", NS) if e.get("reason") == "StepsRaised"]
        assert len(events) == 1 and events[0]["type"] == "Normal" and "raised to 150" in events[0]["message"], events
        _running(cluster, "sr", 1)
        rank0.step(150, attempt=1, checkpoint=150)
        wait_for(lambda: cluster.status(NS, "sr")["training"].get("step") == 150, 20, "attempt 1 at step 150")
        cluster.terminate_pod(NS, "sr-a1-1", 0, "Completed")
        cluster.terminate_pod(NS, "sr-a1-0", 0, "Completed")
        wait_for(lambda: _phase(cluster, "sr") == "Succeeded", 20, "Succeeded")
    st = cluster.status(NS, "sr")
    assert st["restartCount"] == 0 and st["attempt"] == 1 and st["training"]["step"] == 150
    assert "reached step 150" in cluster.condition(NS, "sr", "Succeeded")["message"]
    written = _status_writes(cluster, "sr")
    assert not [w for w in written if w.get("phase") == "Succeeded" and w.get("attempt") == 0], \
        "attempt 0 (trained to the old 100 steps) was written as Succeeded"


def _still_while_busy(op: Operator, name: str) -> float:
    """``name``'s cycle count, checked not to move while the run "busy" (pods never scheduled: its daemon loops every
    scan interval, 0.1 s) cycles 30 more times: the operator's own cycles are the clock, not a sleep."""
    base = op.run_cycles("busy")
    wait_for(lambda: op.run_cycles("busy") >= base + 10, 30, "10 cycles of the busy run")
    before = op.run_cycles(name)
    wait_for(lambda: op.run_cycles("busy") >= base + 40, 30, "30 more cycles of the busy run")
    assert op.run_cycles(name) == before, f"{name} cycled {op.run_cycles(name) - before} times after it finished"
    return before


def test_a_finished_runs_daemon_ends(cluster: Cluster) -> None:
    """After Succeeded (and its clean-up) the run's daemon ends: its cycle count stands still while another run's
    daemon cycles on; after an operator restart the finished run gets the resume's cycles, then none."""
    with Operator(cluster) as op:
        cluster.apply(lpt("busy", cpu_spec()))
        cluster.apply(lpt("fin", cpu_spec()))
        wait_for(lambda: len(cluster.pod_names(NS, "fin")) == 2, 20, "pods")
        _running(cluster, "fin", 0)
        cluster.terminate_pod(NS, "fin-a0-1", 0, "Completed")
        cluster.terminate_pod(NS, "fin-a0-0", 0, "Completed")
        wait_for(lambda: _phase(cluster, "fin") == "Succeeded", 20, "Succeeded")
        assert _still_while_busy(op, "fin") >= 3  # create, pods, success (at least)
    with Operator(cluster) as op:
        assert _still_while_busy(op, "fin") <= 2  # kopf's resume handler and the daemon's first cycle
    assert cluster.status(NS, "fin")["phase"] == "Succeeded"


def test_lowering_steps_mid_run_succeeds_at_the_first_checkpoint_past_it(cluster: Cluster, rank0) -> None:
    """spec.training.steps lowered from 100 to 80 while attempt 0 (created with 100) trains: the run goes on while
    its newest checkpoint is below 80, and succeeds once rank 0 reports a checkpoint at or past 80: the pods
    (whose trainer would train on to 100) are deleted, once each, no restart, the message says why."""
    with Operator(cluster) as op:
        cluster.apply(lpt("busy-sl", cpu_spec()))  # never scheduled: its daemon cycles every scan interval (a clock)
        cluster.apply(lpt("sl", cpu_spec(), metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "sl")) == 2, 20, "pods")
        _running(cluster, "sl", 0)
        rank0.step(60, checkpoint=60)
        wait_for(lambda: (cluster.status(NS, "sl").get("training") or {}).get("step") == 60, 20, "step 60")
        cluster.patch(LPT, NS, "sl", {"spec": {"training": {"steps": 80}}})
        wait_for(lambda: cluster.status(NS, "sl")["training"].get("totalSteps") == 80, 20, "the new total shown")
        rank0.step(79, checkpoint=70)  # the newest checkpoint is below 80: train on
        wait_for(lambda: cluster.status(NS, "sl")["training"].get("step") == 79, 20, "step 79")
        assert _phase(cluster, "sl") == "Running" and not _requests(cluster, "delete", "/pods/")
        rank0.step(81, checkpoint=80)
        wait_for(lambda: _phase(cluster, "sl") == "Succeeded", 20, "Succeeded at the checkpoint past 80")
        # The status is written before the pods are deleted: stopping the operator as soon as Succeeded shows could
        # cancel the cycle before its DELETEs (seen: none sent). Wait for them; then the cycles that follow, in which
        # the pod index may still show a deleted pod, must not send a second DELETE (delete expectations). The run's
        # daemon may also end at once, with nothing left to do (with a fast API it often had before the pods were
        # seen gone, and "one more cycle of sl" never came), so another run's cycles are the clock, not sl's.
        wait_for(lambda: cluster.pod_names(NS, "sl") == [], 20, "both pods deleted")
        base = op.run_cycles("busy-sl")
        wait_for(lambda: op.run_cycles("busy-sl") >= base + 20, 30, "20 more cycles of another run")
    st = cluster.status(NS, "sl")
    assert st["restartCount"] == 0 and st["attempt"] == 0
    assert "lowered while the attempt ran with 100" in cluster.condition(NS, "sl", "Succeeded")["message"]
    assert sorted(p.rpartition("/")[2] for p in _requests(cluster, "delete", "/pods/")) == ["sl-a0-0", "sl-a0-1"]
