"""Observation parsing (pods, nodes, metrics, spec changes) and the RBAC table against real calls."""

from __future__ import annotations

import pytest

from kmockx.harness import LPT, Cluster, Operator, Rank0Metrics, wait_for
from support.specs import NS, cpu_spec, lpt
from kubetitan_core import contract
from kubetitan import rbac
from kubetitan_core.api import LlamaPretrainSpec
from kubetitan.observation import NodeObs
from kubetitan.observation.pods import node_obs, pod_obs
from kubetitan.observation.scrape import metrics_url, parse_metrics
from kubetitan.observation.spec import spec_changes
from kubetitan.status import training_status
from kubetitan.observation.tracking import progress, track


def _pod(status: dict, **meta) -> dict:
    return {"metadata": {"name": "j-a1-0", "labels": {"kubetitan.io/attempt": "1", "kubetitan.io/rank": "0"},
                         "creationTimestamp": "2026-01-01T00:00:00Z", **meta},
            "spec": {"nodeName": "n1"}, "status": status}


@pytest.mark.parametrize(("pod", "want"), [
    (_pod({"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": [
        {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T00:01:00Z"}}}]}),
     {"phase": "Running", "pod_ip": "10.0.0.1", "running_since": 1767225660.0, "attempt": 1, "rank": 0}),
    (_pod({"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
        "exitCode": 137, "reason": "OOMKilled"}}}]}), {"exit_code": 137, "terminated_reason": "OOMKilled"}),
    (_pod({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                               "message": "0/3 nodes"}]}), {"unschedulable_message": "0/3 nodes"}),
    (_pod({"phase": "Failed", "reason": "Evicted", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}]}),
     {"reason": "Evicted", "disruption_reason": "TerminationByKubelet"}),
    (_pod({}, deletionTimestamp="2026-01-01T00:02:00Z"), {"deleting": True, "phase": "Pending"}),
], ids=["running", "oom", "unschedulable", "evicted", "deleting"])
def test_pod_obs(pod, want) -> None:
    got = pod_obs(pod)
    assert got is not None
    assert {k: getattr(got, k) for k in want} == want


def test_pod_without_labels_is_ignored() -> None:
    assert pod_obs({"metadata": {"name": "x"}}) is None


@pytest.mark.parametrize(("node", "want"), [
    (None, NodeObs("n", exists=False, ready=False)),
    ({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, NodeObs("n")),
    ({"status": {"conditions": [{"type": "Ready", "status": "Unknown",
                                 "lastTransitionTime": "2026-01-01T00:00:00Z"}]}},
     NodeObs("n", ready=None, not_ready_since=1767225600.0)),
], ids=["missing", "ready", "unknown"])
def test_node_obs(node, want) -> None:
    assert node_obs("n", node) == want


def test_metrics_from_a_real_exporter_fill_training_status() -> None:
    m = Rank0Metrics(clock=lambda: 1000.0)
    try:
        m.step(50, attempt=0, checkpoint=40, loss=1.5)
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    parsed = parse_metrics(text)
    assert parsed[contract.M_STEP] == 50
    t = training_status(LlamaPretrainSpec.model_validate({"training": {"steps": 100}}), parsed, 1000.0, None)
    assert (t.step, t.loss, t.last_checkpoint_step, t.progress, t.mfu) == (50, 1.5, 40, "50/100", 0.4)
    assert t.goodput == pytest.approx(50 / 62.5, abs=1e-3)
    assert t.eta == "1970-01-01T00:17:30Z"  # 50 steps left x 1 s/step after t=1000


def test_progress_tracking_ignores_other_attempts_and_tracks_heartbeat() -> None:
    o = track(None, 1, 10.0, metrics={contract.M_STEP: 7.0, contract.M_ATTEMPT: 0.0})
    assert progress(o).step is None and progress(o).metrics_available is False  # an older attempt's process
    o = track(o, 1, 10.0, metrics={contract.M_STEP: 7.0, contract.M_ATTEMPT: 1.0, contract.M_LAST_STEP_TIMESTAMP: 9.0})
    o = track(o, 1, 50.0, metrics={contract.M_STEP: 7.0, contract.M_ATTEMPT: 1.0, contract.M_LAST_STEP_TIMESTAMP: 9.0})
    p = progress(o)
    assert (p.step, p.start_step, p.last_progress_time, p.first_step_time) == (7, 6, 10.0, 9.0)
    assert (p.metrics_available, p.metrics_ok_time) == (True, 50.0)
    # a failed scrape keeps the last known progress and the timers; it only flips availability
    q = progress(track(o, 1, 60.0, scrape_error="GET http://[fd00::1]:9090/metrics timed out after 3s"))
    assert (q.step, q.last_progress_time, q.metrics_ok_time, q.metrics_available) == (7, 10.0, 50.0, False)
    # the next attempt starts from nothing
    assert progress(track(o, 2, 70.0)) == progress(None)


@pytest.mark.parametrize(("ip", "url"), [
    ("10.1.2.3", "http://10.1.2.3:9090/metrics"),
    ("fd00:10:244::5", "http://[fd00:10:244::5]:9090/metrics"),
    ("::1", "http://[::1]:9090/metrics"),
], ids=["ipv4", "ipv6", "ipv6-loopback"])
def test_metrics_url_brackets_ipv6(ip, url) -> None:
    assert metrics_url(ip, 9090) == url


@pytest.mark.parametrize(("old", "new", "want"), [
    ({"training": {"steps": 10}}, {"training": {"steps": 20}}, (["training.steps"], [], [])),
    ({"runPolicy": {"suspend": False}}, {"runPolicy": {"suspend": True}}, (["runPolicy.suspend"], [], [])),
    ({"resources": {"nodes": 2}}, {"resources": {"nodes": 4}}, ([], ["resources.nodes"], [])),
    ({"model": {"flavor": "8B"}}, {"model": {"flavor": "70B"}}, ([], [], ["model.flavor"])),
    ({"checkpoint": {"storage": {"hostPath": "/a"}}}, {"checkpoint": {"storage": {"hostPath": "/b"}}},
     ([], [], ["checkpoint.storage.hostPath"])),
], ids=["steps-live", "suspend-live", "nodes-deferred", "model-rejected", "storage-rejected"])
def test_spec_changes(old, new, want) -> None:
    assert spec_changes(old, new) == want


# ------------------------------------------------------------------ RBAC
def _verb(r) -> tuple[str, str, str] | None:
    res = r.resource
    if res is None or res.plural is None:
        return None  # discovery
    m = r.method.value
    verb = ("watch" if (r.params or {}).get("watch") in ("true", "1") else "get" if r.name else "list") \
        if m == "GET" else {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[m]
    plural = f"{res.plural}/{r.subresource}" if r.subresource else res.plural
    return res.group or "", plural, verb


@pytest.mark.xdist_group("operator-kmock")
def test_every_api_call_is_in_the_rbac_table(cluster: Cluster) -> None:
    """Derive (apiGroup, resource, verb) from every request the operator (kopf + our client) made."""
    def verbs() -> list[tuple[str, str, str]]:
        return [v for r in list(cluster.k) if (v := _verb(r)) is not None]

    for r in range(2):  # in the node index's initial list, which kopf completes before any handler runs
        cluster.add_node(f"node-{r}")
    with Operator(cluster, namespaces=(NS,)):
        cluster.apply(lpt("rb", cpu_spec(ttlSecondsAfterFinished=0)))
        wait_for(lambda: len(cluster.pod_names(NS, "rb")) == 2, 20, "pods")
        for r in range(2):
            cluster.run_pod(NS, f"rb-a0-{r}", f"node-{r}")
        cluster.terminate_pod(NS, "rb-a0-1", 1)
        wait_for(lambda: "rb-a1-0" in cluster.pod_names(NS, "rb"), 20, "restart")
        cluster.terminate_pod(NS, "rb-a1-0", 0, "Completed")
        wait_for(lambda: cluster.lpt(NS, "rb") is None, 20, "TTL deleted the run")
        # kopf opens the node index's watch after its initial list; the run above can end before that request is
        # made on a loaded machine, so wait for the request itself (the index's list is what gated the handlers)
        wait_for(lambda: ("", "nodes", "watch") in verbs(), 20, "the node index's watch")
    calls = verbs()
    seen = {v for v in calls if v[1] != "namespaces" or v[2] != "create"}  # the test harness itself
    missing = sorted(v for v in seen if not rbac.allowed(*v))
    assert not missing, f"calls not in kubetitan.rbac.RULES: {missing}"
    assert ("", "pods", "create") in seen and ("kubetitan.io", "llamapretrains/status", "patch") in seen
    assert ("kubetitan.io", "llamapretrains", "delete") in seen
    # node health comes from the index, not from a GET per cycle: the nodes were there before the operator started,
    # so no pod can arrive before its node (the one case observation.read.confirm_missing reads a node)
    assert ("", "nodes", "get") not in seen
    assert cluster.get(LPT, NS, "rb") is None


def test_rules_render_as_policy_rules() -> None:
    rules = rbac.rules(cluster_wide=True)
    assert any(r["apiGroups"] == [""] and "nodes" in r["resources"] and r["verbs"] == ["get", "list", "watch"]
               for r in rules)
    assert {"apiGroups": ["kubetitan.io"], "resources": ["llamapretrains/finalizers"], "verbs": ["update"]} in rules
    assert all(r["verbs"] and r["resources"] for r in rules)
    assert not any("nodes" in r["resources"] for r in rbac.rules(cluster_wide=False))
