"""How the operator runs, against kmockx: namespace scope, liveness, structured logs.

The log tests start ``kubetitan operator`` as real processes (the CLI code path); the scope tests run
``kubetitan.runner.run`` in-process (the same function the CLI calls). One writer among several replicas is the
leader Lease's (tests/operator/test_leader_election.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import requests

from kmockx.harness import Cluster, Operator, OperatorProcess, wait_for
from support.specs import NS, cpu_spec, lpt

pytestmark = pytest.mark.xdist_group("operator-ha")
OTHER = "team-b"


def _in(ns: str, name: str) -> dict[str, Any]:
    obj = copy.deepcopy(lpt(name, cpu_spec(nodes=1)))
    obj["metadata"]["namespace"] = ns
    return obj


def _created(op: OperatorProcess, name: str) -> bool:
    return any(r.get("message", "").startswith("Created attempt") and f"/{name} " in r["message"]
               for r in op.log_records())


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
    assert ("Warning", "InvalidSpec") in cluster.events(NS, "bad")


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
