"""The real operator (kopf, in-process) against kmockx with and without Kubernetes PodGroups served.

Served (``Cluster(pod_groups=True)``: a 1.37 server with ``scheduling.k8s.io/v1beta1``): each attempt gets its gang
PodGroup before its pods, every pod names it, a gang the scheduler cannot place is reported as before, and the
PodGroup goes when its attempt ends. Not served (the default double): the discovery read answers 404 and the children
are today's. No scheduler reads the PodGroups here; tests/cluster's real one does.
"""

from __future__ import annotations

import pytest

from kmockx.harness import LPT, PODS, Cluster, Operator, wait_for
from support.specs import NS, cpu_spec, lpt
from kubetitan import conditions as C

pytestmark = pytest.mark.xdist_group("operator-kmock")

PODGROUPS = "scheduling.k8s.io/v1beta1/podgroups"
DISCOVERY = "/apis/scheduling.k8s.io/v1beta1"


def _group(c: Cluster, name: str) -> dict | None:
    return c.get(PODGROUPS, NS, name)


def _creates(c: Cluster) -> list[tuple[str, str]]:
    """(resource, name) of every create the operator sent, in order."""
    assert c.k is not None
    return [(e.path.split("?")[0].rsplit("/", 1)[1], e.name) for e in list(c.k.log) if e.verb == "create"]


def _unschedulable(c: Cluster, pod: str) -> None:
    """What kube-scheduler writes on each pod of a gang its PodGroup cycle cannot place."""
    c.patch(PODS, NS, pod, {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 1 Insufficient cpu. pod group is unschedulable"}]}}, "status")


def test_served_each_attempt_gets_its_gang_pod_group_first_and_loses_it_when_it_ends() -> None:
    with Cluster(pod_groups=True) as c, Operator(c):
        c.apply(lpt("pg", cpu_spec(nodes=3, unschedulableTimeoutSeconds=0)))
        wait_for(lambda: len(c.pod_names(NS, "pg")) == 3, 20, "3 pods")
        uid = c.lpt(NS, "pg")["metadata"]["uid"]
        group = _group(c, "pg-a0")
        assert group is not None
        assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}
        assert [(r["kind"], r["uid"], r["controller"]) for r in group["metadata"]["ownerReferences"]] == \
            [("LlamaPretrain", uid, True)]
        assert group["metadata"]["labels"]["kubetitan.io/attempt"] == "0"
        assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "pg-a0"} for p in c.pods(NS, "pg"))
        # the double logs a request once it has answered it, after the object is visible: wait for the log too
        def all_logged() -> list[tuple[str, str]] | None:
            got = _creates(c)
            return got if all(("pods", f"pg-a0-{r}") in got for r in range(3)) else None

        creates = wait_for(all_logged, 20, "the 3 pod creates in the double's request log")
        assert creates.index(("podgroups", "pg-a0")) < min(creates.index(("pods", f"pg-a0-{r}")) for r in range(3))

        # the scheduler cannot place the gang: reported as for any pod it cannot place
        for r in range(3):
            _unschedulable(c, f"pg-a0-{r}")
        wait_for(lambda: (c.condition(NS, "pg", C.UNSCHEDULABLE) or {}).get("status") == "True", 20,
                 "Unschedulable=True")
        cond = c.condition(NS, "pg", C.UNSCHEDULABLE)
        assert cond["reason"] == C.PODS_UNSCHEDULABLE and "pod group is unschedulable" in cond["message"]

        # placed at last, then rank 1 fails: attempt 1 gets its own PodGroup, attempt 0's goes with its pods
        for r in range(3):
            c.run_pod(NS, f"pg-a0-{r}", f"node-{r}")
        c.terminate_pod(NS, "pg-a0-1", 1)
        wait_for(lambda: _group(c, "pg-a1") is not None and _group(c, "pg-a0") is None, 20,
                 "attempt 1's PodGroup, attempt 0's deleted")
        wait_for(lambda: len(c.pod_names(NS, "pg")) == 3, 20, "attempt 1's pods")
        assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "pg-a1"} for p in c.pods(NS, "pg"))

        c.delete(LPT, NS, "pg")  # the PodGroup goes with the run (its owner reference; the double's collector)
        wait_for(lambda: _group(c, "pg-a1") is None, 20, "PodGroup collected with the run")


def test_served_but_not_for_this_spec_no_pod_group() -> None:
    """``podGroup: Disabled`` and a Kueue queue keep today's children on a server that serves PodGroups."""
    with Cluster(pod_groups=True) as c, Operator(c):
        c.apply(lpt("off", {**cpu_spec(), "scheduling": {"podGroup": "Disabled"}}))
        c.apply(lpt("kq", {**cpu_spec(), "scheduling": {"queueName": "team-a"}}))
        wait_for(lambda: len(c.pod_names(NS, "off")) == 2 and len(c.pod_names(NS, "kq")) == 2, 20, "pods")
        assert not c.list(PODGROUPS, NS)
        assert all("schedulingGroup" not in p["spec"] for p in c.pods(NS, "off") + c.pods(NS, "kq"))
        assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in c.pods(NS, "kq")} == {"kq-a0"}


def test_the_admins_switch_turns_them_off_on_a_server_that_serves_them() -> None:
    """``--pod-groups=disabled`` (chart: ``operator.podGroups``): no PodGroup, whatever the server serves."""
    with Cluster(pod_groups=True) as c:
        op = Operator(c)
        op.options.pod_groups = "disabled"
        with op:
            c.apply(lpt("adm", cpu_spec()))
            wait_for(lambda: len(c.pod_names(NS, "adm")) == 2, 20, "pods")
            assert not c.list(PODGROUPS, NS)
            assert all("schedulingGroup" not in p["spec"] for p in c.pods(NS, "adm"))


def test_not_served_the_children_are_todays() -> None:
    with Cluster() as c, Operator(c):
        c.apply(lpt("np", cpu_spec()))
        wait_for(lambda: len(c.pod_names(NS, "np")) == 2, 20, "pods")
        assert all("schedulingGroup" not in p["spec"] for p in c.pods(NS, "np"))
        assert c.k is not None
        asked = [e for e in list(c.k.log) if e.path.split("?")[0] == DISCOVERY]
        assert asked and {e.code for e in asked} == {404}
        assert not [e for e in list(c.k.log) if "/podgroups" in e.path]


def test_a_pod_group_refused_as_not_found_is_asked_about_again_and_the_attempt_goes_on_without() -> None:
    """Served when the operator started, gone by the first attempt (a server downgraded, or its gate turned off):
    the create answers 404, the operator reads the discovery again and creates the pods without a PodGroup."""
    with Cluster(pod_groups=True) as c, Operator(c):
        assert c.k is not None
        res = next(r for r in c.k.types if r.plural == "podgroups")
        c.call(_unserve(c, res))
        c.apply(lpt("gone", cpu_spec()))
        wait_for(lambda: len(c.pod_names(NS, "gone")) == 2, 30, "pods")
        assert all("schedulingGroup" not in p["spec"] for p in c.pods(NS, "gone"))
        assert [e.code for e in list(c.k.log) if e.verb == "create" and "/podgroups" in e.path] == [404]
        assert [e.code for e in list(c.k.log) if e.path.split("?")[0] == DISCOVERY][-1] == 404


async def _unserve(c: Cluster, res) -> None:
    assert c.k is not None
    c.k.types.pop(res)
    c.k.resources.pop(res)


def test_a_refused_pod_group_delete_never_holds_up_the_next_attempt() -> None:
    """The DELETE of an ended attempt's PodGroup refused (403: a chart without the row): logged, and the next
    attempt is created all the same (the old PodGroup goes with the run, through its owner reference)."""
    with Cluster(pod_groups=True) as c, Operator(c):
        assert c.k is not None
        fault = c.k.inject(code=403, verbs=frozenset({"delete"}), resource="podgroups")
        c.k.graceful_pod_deletion = True  # attempt 0's running rank stays, terminating: listed again every cycle
        c.apply(lpt("rf", cpu_spec()))
        wait_for(lambda: len(c.pod_names(NS, "rf")) == 2, 20, "pods")
        for r in range(2):
            c.run_pod(NS, f"rf-a0-{r}", f"node-{r}")
        c.terminate_pod(NS, "rf-a0-0", 1)
        wait_for(lambda: {"rf-a1-0", "rf-a1-1"} <= set(c.pod_names(NS, "rf")), 20, "attempt 1's pods")
        assert c.get(PODS, NS, "rf-a0-1")["metadata"].get("deletionTimestamp")
        assert fault.hits >= 1 and _group(c, "rf-a0") is not None and _group(c, "rf-a1") is not None
