"""How the operator runs, against kmockx: HA peering, namespace scope, liveness, structured logs.

The HA and log tests start ``kubetitan operator`` as real processes (the CLI code path); the scope
tests run ``kubetitan.runner.run`` in-process (the same function the CLI calls).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import requests

from kmockx.harness import Cluster, Operator, OperatorProcess, wait_for
from support.specs import NS, cpu_spec, lpt

pytestmark = pytest.mark.xdist_group("operator-kmock")
OTHER = "team-b"


def _in(ns: str, name: str) -> dict[str, Any]:
    obj = copy.deepcopy(lpt(name, cpu_spec(nodes=1)))
    obj["metadata"]["namespace"] = ns
    return obj


def _pod_creates(c: Cluster) -> list[str]:
    """Pod names of every pod-create request the server received (from kmock's request log)."""
    return [(r.data or {}).get("metadata", {}).get("name", "") for r in list(c.k)
            if r.method is not None and r.method.value == "POST" and r.resource is not None
            and r.resource.plural == "pods"]


def _created(op: OperatorProcess, name: str) -> bool:
    return any(r.get("message", "").startswith("Created attempt") and f"/{name} " in r["message"]
               for r in op.log_records())


def test_peering_one_active_replica_then_takeover(cluster: Cluster) -> None:
    cluster.add_peering("kubetitan")
    args = ("--namespace", NS, "--peering", "kubetitan", "--scan-interval", "0.5")
    with OperatorProcess(cluster.kubeconfig, *args, "--priority", "100") as a:
        wait_for(lambda: len(cluster.peers("kubetitan")) == 1, 15, "replica A's keep-alive")
        with OperatorProcess(cluster.kubeconfig, *args, "--priority", "50") as b:
            wait_for(lambda: len(cluster.peers("kubetitan")) == 2, 15, "both keep-alives")
            # both start paused (peering is mandatory); only the highest priority resumes
            assert "Resuming operations" in a.log_text() and "Resuming operations" not in b.log_text()
            cluster.apply(lpt("ha1", cpu_spec(nodes=2)))
            wait_for(lambda: len(cluster.pod_names(NS, "ha1")) == 2, 15, "ha1 pods")
            wait_for(lambda: cluster.status(NS, "ha1").get("phase") == "Starting", 15, "ha1's status by A")
            assert sorted(_pod_creates(cluster)) == ["ha1-a0-0", "ha1-a0-1"], "each pod created once, by one replica"
            # A logs "Created attempt" after its last POST, and its log reaches us through a pipe: wait for it
            wait_for(lambda: _created(a, "ha1"), 15, "replica A's 'Created attempt' log line")
            assert not _created(b, "ha1")
            a.stop()
            wait_for(lambda: "Resuming operations" in b.log_text(), 15, "replica B takes over")
            assert list(cluster.peers("kubetitan")) and len(cluster.peers("kubetitan")) == 1
            # B serves new runs and continues the old one (a gang failure still restarts it)
            cluster.apply(lpt("ha2", cpu_spec(nodes=2)))
            wait_for(lambda: len(cluster.pod_names(NS, "ha2")) == 2, 15, "ha2 pods by replica B")
            cluster.terminate_pod(NS, "ha1-a0-0", 1)
            wait_for(lambda: cluster.pod_names(NS, "ha1") == ["ha1-a1-0", "ha1-a1-1"], 15, "ha1 restarted by B")
            wait_for(lambda: _created(b, "ha2"), 15, "replica B's 'Created attempt' log line")
            assert not _created(a, "ha2")
            assert sorted(_pod_creates(cluster)) == sorted(
                ["ha1-a0-0", "ha1-a0-1", "ha1-a1-0", "ha1-a1-1", "ha2-a0-0", "ha2-a0-1"])


@pytest.mark.parametrize(
    ("scope", "kwargs", "served", "ignored"),
    [
        ("namespaced", {"namespaces": (NS,)}, [NS], [OTHER]),
        ("glob", {"namespaces": ("team-*",)}, [OTHER], [NS]),
        ("all-namespaces", {"all_namespaces": True}, [NS, OTHER], []),
    ],
    ids=["namespace-ml", "namespace-glob", "all-namespaces"],
)
def test_namespace_scope(scope: str, kwargs: dict[str, Any], served: list[str], ignored: list[str]) -> None:
    with Cluster(namespaces=(OTHER,)) as c, Operator(c, **kwargs):
        for ns in (NS, OTHER):
            c.apply(_in(ns, f"run-{ns}"))
        for ns in served:
            wait_for(lambda ns=ns: c.pod_names(ns, f"run-{ns}") == [f"run-{ns}-a0-0"], 15, f"pods in {ns}")
            wait_for(lambda ns=ns: c.status(ns, f"run-{ns}").get("phase") == "Starting", 10, f"status in {ns}")
        for ns in ignored:
            # never watched or touched there at all (the request log), so nothing can come later either
            touched = [str(e) for e in c.k.log if e.user != "system:admin" and f"/namespaces/{ns}/" in e.path]
            assert not touched, touched
            assert c.pod_names(ns, f"run-{ns}") == [], f"{scope}: a run in {ns} got pods"
            obj = c.lpt(ns, f"run-{ns}")
            assert obj is not None and not obj.get("status") and not obj["metadata"].get("finalizers"), obj
        # only a glob needs namespace listing: namespaced mode with exact names never asks (its Role forbids it,
        # and kopf would wait on the 403), cluster-wide mode watches cluster-wide
        listed = [e for e in c.k.log if e.user != "system:admin" and e.path.split("?")[0] == "/api/v1/namespaces"]
        assert bool(listed) == (scope == "glob"), [str(e) for e in listed]


def test_liveness_and_json_logs(cluster: Cluster) -> None:
    """JSON logs at levels an on-call engineer can use: a tenant's invalid spec is one warning naming the run (not an
    error), liveness probes leave no access-log line, and stopping logs nothing per run."""
    with OperatorProcess(cluster.kubeconfig, "--namespace", NS, log_format="json") as op:
        for _ in range(3):
            r = requests.get(op.liveness, timeout=5)
            assert r.status_code == 200 and isinstance(r.json(), dict)
        cluster.apply(lpt("lg", cpu_spec(nodes=1)))
        wait_for(lambda: _created(op, "lg"), 15, "the create log line")
        cluster.apply(lpt("bad", {**cpu_spec(nodes=1), "training": {"steps": 0}}), admit=False)  # past the CRD schema
        wait_for(lambda: (cluster.condition(NS, "bad", "SpecAccepted") or {}).get("status") == "False", 15,
                 "invalid spec condition")
        wait_for(lambda: any("spec the operator refuses" in r["message"] for r in op.log_records()), 15,
                 "the spec-error record")
        mark = len(op.log_records())
        assert op.stop() == 0
        with pytest.raises(requests.RequestException):
            requests.get(op.liveness, timeout=1)
        records = op.log_records()  # raises on any line that is not one JSON object
    assert all(isinstance(r, dict) and r.get("message") and r.get("severity") and r.get("timestamp")
               for r in records)
    # the spec-error record carries the object reference (kopf's refkey "object"), as kopf's own per-object ones do
    refs = [(o.get("name"), o.get("namespace")) for r in records if isinstance(o := r.get("object"), dict)]
    assert ("bad", NS) in refs
    spec_errors = [r for r in records if "spec the operator refuses" in r["message"]]
    assert [(r["severity"], r["object"]["name"]) for r in spec_errors] == [("warn", "bad")], spec_errors
    assert "ml/bad" in spec_errors[0]["message"] and "training.steps" in spec_errors[0]["message"]
    assert not [r for r in records if r["severity"] in ("error", "fatal")], "a tenant's mistake is not an error"
    assert not [r for r in records if "/healthz" in r["message"]], "no access log for probes"
    at_shutdown = [r for r in records[mark:] if isinstance(r.get("object"), dict) or "lg" in r["message"].split()]
    assert not at_shutdown, f"per-run records at shutdown: {at_shutdown}"
    assert ("Warning", "InvalidSpec") in _events(cluster, "bad")


def _requests(c: Cluster, method: str, plural: str) -> list[str]:
    """Object names of every ``method`` request on ``plural`` the server received (kmock's request log)."""
    out = []
    for r in list(c.k):
        if r.method is None or r.method.value != method or r.resource is None or r.resource.plural != plural:
            continue
        out.append(r.name or ((r.data or {}).get("metadata") or {}).get("name", ""))
    return out


def test_fail_back_a_b_a_keeps_the_live_gang(cluster: Cluster) -> None:
    """A active -> B (higher priority) takes over and restarts the run to attempt 1 -> B stops -> A resumes.
    A must rebuild its view from the API: no pod of attempt 1 deleted, no attempt 2, the run goes on to
    success under A."""
    logs: list[OperatorProcess] = []
    try:
        _fail_back(cluster, logs)
    except AssertionError as e:  # say what each replica did
        raise AssertionError(f"{e}\n" + "\n".join(f"--- replica {i}:\n{op.log_text()[-2500:]}"
                                                   for i, op in enumerate(logs))) from None


def _fail_back(cluster: Cluster, logs: list[OperatorProcess]) -> None:
    cluster.add_peering("kubetitan")
    args = ("--namespace", NS, "--peering", "kubetitan", "--scan-interval", "0.5")
    with OperatorProcess(cluster.kubeconfig, *args, "--priority", "50") as a:
        logs.append(a)
        wait_for(lambda: "Resuming operations" in a.log_text(), 15, "replica A active")
        cluster.apply(lpt("fb", cpu_spec(nodes=2)))
        wait_for(lambda: cluster.pod_names(NS, "fb") == ["fb-a0-0", "fb-a0-1"], 15, "attempt 0 by A")
        for r in range(2):
            cluster.run_pod(NS, f"fb-a0-{r}", f"node-{r}")
        wait_for(lambda: _created(a, "fb"), 10, "A created attempt 0")
        with OperatorProcess(cluster.kubeconfig, *args, "--priority", "100") as b:
            logs.append(b)
            wait_for(lambda: "Resuming operations" in b.log_text(), 20, "replica B takes over")
            wait_for(lambda: "Pausing operations" in a.log_text(), 20, "replica A paused")
            cluster.terminate_pod(NS, "fb-a0-1", 1)
            wait_for(lambda: cluster.pod_names(NS, "fb") == ["fb-a1-0", "fb-a1-1"], 20, "B restarted to attempt 1")
            # B logs "Created attempt" after its last pod POST: the pods can be listed before the line exists
            wait_for(lambda: _created(b, "fb"), 10, "B logged creating attempt 1")
            for r in range(2):
                cluster.run_pod(NS, f"fb-a1-{r}", f"node-{r}")
            wait_for(lambda: (cluster.status(NS, "fb").get("observation") or {}).get("ranksSeen") == [0, 1]
                     and cluster.status(NS, "fb").get("attempt") == 1, 10, "B's status of attempt 1")
            b.stop()
        wait_for(lambda: a.log_text().count("Resuming operations") >= 2, 20, "replica A resumes")
        # A acts again (its cycles must not touch attempt 1): the run finishes under A
        cluster.terminate_pod(NS, "fb-a1-1", 0, "Completed")
        cluster.terminate_pod(NS, "fb-a1-0", 0, "Completed")
        wait_for(lambda: cluster.status(NS, "fb").get("phase") == "Succeeded", 20, "Succeeded under A")
    deleted = _requests(cluster, "DELETE", "pods")
    assert not [n for n in deleted if n.startswith("fb-a1-")], deleted
    assert sorted(_pod_creates(cluster)) == ["fb-a0-0", "fb-a0-1", "fb-a1-0", "fb-a1-1"]
    st = cluster.status(NS, "fb")
    assert (st["restartCount"], st["attempt"]) == (1, 1)


def _events(c: Cluster, name: str) -> list[tuple[str, str]]:
    return sorted((e.get("type", ""), e.get("reason", "")) for e in c.list("v1/events", NS)
                  if (e.get("involvedObject") or {}).get("name") == name)


def test_events_are_posted_once_with_two_peering_replicas(cluster: Cluster) -> None:
    """Two replicas peering (as the chart runs them: its own priority each): only the active one acts, so each
    Event of the run (the restart, the success) exists once, not once per replica."""
    cluster.add_peering("kubetitan")
    args = ("--namespace", NS, "--peering", "kubetitan", "--scan-interval", "0.2")
    with OperatorProcess(cluster.kubeconfig, *args, "--priority", "100") as a, \
            OperatorProcess(cluster.kubeconfig, *args, "--priority", "50") as b:
        wait_for(lambda: len(cluster.peers("kubetitan")) == 2, 15, "both keep-alives")
        wait_for(lambda: "Resuming operations" in a.log_text(), 15, "replica A active")
        cluster.apply(lpt("ev", cpu_spec(nodes=2)))
        wait_for(lambda: cluster.pod_names(NS, "ev") == ["ev-a0-0", "ev-a0-1"], 15, "attempt 0")
        for r in range(2):
            cluster.run_pod(NS, f"ev-a0-{r}", f"node-{r}")
        cluster.terminate_pod(NS, "ev-a0-1", 1)
        wait_for(lambda: cluster.pod_names(NS, "ev") == ["ev-a1-0", "ev-a1-1"], 15, "attempt 1")
        for r in range(2):
            cluster.run_pod(NS, f"ev-a1-{r}", f"node-{r}")
        cluster.terminate_pod(NS, "ev-a1-1", 0, "Completed")
        cluster.terminate_pod(NS, "ev-a1-0", 0, "Completed")
        wait_for(lambda: ("Normal", "Completed") in _events(cluster, "ev"), 20, "the Completed Event")
        # one more run served end to end: both replicas had every chance to act on "ev" meanwhile
        cluster.apply(lpt("ev2", cpu_spec(nodes=1)))
        wait_for(lambda: cluster.status(NS, "ev2").get("phase") == "Starting", 15, "the next run served")
        assert "Resuming operations" not in b.log_text()
    assert _events(cluster, "ev") == [("Normal", "Completed"), ("Warning", "RestartContainerFailed")], \
        _events(cluster, "ev")


def test_info_logs_do_not_follow_pod_events(cluster: Cluster) -> None:
    """At the default level (info) the operator logs what it does, not what it watches: 40 changes of a run's pods
    (each a watch event that wakes the run) add no record at info; creating the attempt does."""
    with OperatorProcess(cluster.kubeconfig, "--namespace", NS, "--scan-interval", "0.5") as op:
        cluster.apply(lpt("ql", cpu_spec(nodes=2)))
        wait_for(lambda: _created(op, "ql"), 15, "the create log line")
        cluster.run_pod(NS, "ql-a0-0", "node-0")
        mark = len(op.log_records())
        for i in range(40):
            cluster.patch("v1/pods", NS, "ql-a0-0", {"metadata": {"annotations": {"example.com/tick": str(i)}}})
        cluster.run_pod(NS, "ql-a0-1", "node-1")  # the last pod event changes the status: all seen by then
        wait_for(lambda: (cluster.condition(NS, "ql", "Ready") or {}).get("reason") in ("WaitingForFirstStep", "MetricsUnavailable"), 15,
                 "both pods seen running")
        records = op.log_records()
    assert any(r["severity"] == "info" and r["message"].startswith("Created attempt") for r in records[:mark])
    chatty = [r for r in records[mark:] if r["severity"] in ("debug", "info")]
    assert not chatty, chatty
