"""The real operator (kopf, in-process) against kmockx: the lifecycle scenarios of issue 4.

Tests play the kubelet by patching pod status and serve rank 0's metrics from a real exporter on
127.0.0.1. They share ports and CPU, so they run in one xdist group.
"""

from __future__ import annotations

import pytest

from kmockx.harness import CMS, LPT, NS, PODS, SVCS, Cluster, Operator, ScaledClock, cpu_spec, lpt, wait_for
from kubetitan import plan, validation
from kubetitan.decide import parse_time

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
            if child["kind"] == "ConfigMap":
                assert got["data"] == child["data"]
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
        assert op.metric("kubetitan_operator_restarts_total", {"namespace": NS, "name": "r3", "cause": cause}) == 1
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
