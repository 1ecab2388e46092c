"""The admin policy through the real operator against the strict API double: a spec outside the policy gets
``Ready=False``/``SpecAccepted=False`` reason ``PolicyViolation`` and one Warning Event, and no child; the same
spec inside the policy is created (that its pods pass Pod Security ``restricted`` is shown on the real API server,
tests/cluster); an instance type the catalog does not know is one Warning Event ``UnknownInstanceType`` saying what is assumed.
"""

from __future__ import annotations

import pytest

from kmockx.harness import CMS, Cluster, Operator, wait_for
from support.specs import NS, cpu_spec, lpt
from kubetitan.policy import Policy

pytestmark = pytest.mark.xdist_group("operator-kmock")


def test_policy_refuses_at_reconcile_and_admits_what_it_allows(cluster: Cluster) -> None:
    refused = cpu_spec(nodes=1)
    refused["parallelism"]["dataParallelShardDegree"] = 2
    refused["resources"]["serviceAccountName"] = "s3-writer"
    refused["resources"]["image"] = "elsewhere/trainer:0.1.0"
    allowed = cpu_spec(nodes=2)
    allowed["resources"]["image"] = "mine/trainer:0.1.0"
    allowed["resources"]["instanceType"] = "x9.fake"  # not in the catalog: a Warning Event says what is assumed
    op = Operator(cluster)
    op.options.policy = Policy(image_prefixes=("mine/",))
    with op:
        cluster.apply(lpt("bad", refused))
        cluster.apply(lpt("good", allowed))
        cond = wait_for(lambda: cluster.condition(NS, "bad", "SpecAccepted"), 20, "SpecAccepted of bad")
        assert cond["status"] == "False" and cond["reason"] == "PolicyViolation", cond
        assert "spec.resources.serviceAccountName: service account ml/s3-writer" in cond["message"]
        assert "spec.resources.image: image elsewhere/trainer:0.1.0 does not start with a prefix" in cond["message"]
        ready = cluster.condition(NS, "bad", "Ready")
        assert ready["status"] == "False" and ready["reason"] == "PolicyViolation"
        assert cluster.status(NS, "bad")["message"].startswith("refused by the admin policy: ")
        events = wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == "PolicyViolation"],
                          10, "PolicyViolation event")
        assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "bad"
        # the phase/reason series the alerts read (kubetitan_operator_job_phase_info)
        assert op.metric("kubetitan_operator_job_phase_info", {"namespace": NS, "name": "bad", "phase": "Pending",
                                                               "reason": "PolicyViolation"}) == 1
        wait_for(lambda: len(cluster.pod_names(NS, "good")) == 2, 20, "2 pods of good")
        assert cluster.pod_names(NS, "bad") == []
        assert {c["metadata"]["name"] for c in cluster.list(CMS, NS)} == {"good-config"}
        unknown = wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == "UnknownInstanceType"],
                           10, "UnknownInstanceType event")
        assert unknown[0]["type"] == "Warning" and unknown[0]["involvedObject"]["name"] == "good"
        assert unknown[0]["message"].startswith("spec.resources.instanceType: instance type x9.fake is not in kubetitan's catalog")
        # One event, not one per cycle: let the operator run 20 more cycles, then count again.
        cycles = "kubetitan_operator_reconcile_duration_seconds_count"
        base = op.metric(cycles) or 0.0
        wait_for(lambda: (op.metric(cycles) or 0.0) >= base + 20, 20, "20 more reconcile cycles")
        assert cluster.condition(NS, "bad", "SpecAccepted") == cond
        assert len([e for e in cluster.list("v1/events", NS) if e.get("reason") == "PolicyViolation"]) == 1
        assert len([e for e in cluster.list("v1/events", NS) if e.get("reason") == "UnknownInstanceType"]) == 1


def test_policy_tightened_mid_run_keeps_observing_the_running_pods_and_blocks_the_next_attempt(cluster: Cluster) -> None:
    """The operator restarts with a stricter policy while a run's pods train: they are not left untracked. The
    running attempt goes on and is still observed (a pod failure is still a restart), the refusal is
    SpecAccepted=False reason PolicyViolation with one Warning Event, and no new attempt starts until the spec
    complies; once it does, the next attempt is created."""
    spec = cpu_spec(nodes=2)
    spec["resources"]["image"] = "elsewhere/trainer:0.1.0"
    with Operator(cluster):  # the default policy allows any image
        cluster.apply(lpt("run", spec))
        pods = wait_for(lambda: (n := cluster.pod_names(NS, "run")) and len(n) == 2 and n, 20, "2 pods of attempt 0")
    for i, pod in enumerate(pods):
        cluster.run_pod(NS, pod, f"node-{i}")
    op = Operator(cluster)
    op.options.policy = Policy(image_prefixes=("mine/",))
    with op:
        cond = wait_for(lambda: (c := cluster.condition(NS, "run", "SpecAccepted")) and c["reason"] == "PolicyViolation"
                        and c, 20, "SpecAccepted PolicyViolation")
        assert cond["status"] == "False"
        assert "spec.resources.image: image elsewhere/trainer:0.1.0 does not start with a prefix" in cond["message"]
        assert "a running attempt goes on as it was created" in cond["message"]
        assert cluster.pod_names(NS, "run") == pods  # nothing deleted, nothing new
        # Still observed: a worker failure ends the attempt with a restart record and its pods are cleaned up ...
        cluster.terminate_pod(NS, pods[1], 1)
        wait_for(lambda: cluster.status(NS, "run").get("restartCount") == 1, 20, "restart recorded")
        assert cluster.status(NS, "run")["restarts"][0]["cause"] == "ContainerFailed"
        wait_for(lambda: not [p for p in cluster.pods(NS, "run") if not p["metadata"].get("deletionTimestamp")],
                 20, "attempt 0's pods deleted")
        # ... but attempt 1 is not created from a spec the policy refuses (20 more cycles, no pod).
        cycles = "kubetitan_operator_reconcile_duration_seconds_count"
        base = op.metric(cycles) or 0.0
        wait_for(lambda: (op.metric(cycles) or 0.0) >= base + 20, 20, "20 more reconcile cycles")
        assert not [n for n in cluster.pod_names(NS, "run") if "-a1-" in n]
        ready = cluster.condition(NS, "run", "Ready")  # the blocked restart has its own phase and reason
        assert ready["status"] == "False" and ready["reason"] == "RestartBlocked", ready
        assert cluster.status(NS, "run")["phase"] == "Blocked"
        assert cluster.condition(NS, "run", "SpecAccepted")["reason"] == "PolicyViolation"
        events = [e for e in cluster.list("v1/events", NS) if e.get("reason") == "PolicyViolation"]
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        blocked = [e for e in cluster.list("v1/events", NS) if e.get("reason") == "RestartBlocked"]
        assert len(blocked) == 1 and "refused by the admin policy" in blocked[0]["message"], blocked
        # The spec made compliant: the next attempt starts.
        cluster.patch("kubetitan.io/v1alpha1/llamapretrains", NS, "run",
                      {"spec": {"resources": {"image": "mine/trainer:0.1.0"}}})
        wait_for(lambda: len([n for n in cluster.pod_names(NS, "run") if "-a1-" in n]) == 2, 20, "2 pods of attempt 1")
        assert cluster.condition(NS, "run", "SpecAccepted")["status"] == "True"


def test_spec_edited_invalid_mid_run_keeps_observing_the_running_pods(cluster: Cluster) -> None:
    """The same for an edit that only the Python validator refuses (warmupSteps >= steps): reason InvalidSpec,
    the running pods are still observed (a failure is a restart), no new attempt."""
    with Operator(cluster) as op:
        cluster.apply(lpt("run", cpu_spec(nodes=1)))
        pods = wait_for(lambda: (n := cluster.pod_names(NS, "run")) and n, 20, "the pod of attempt 0")
        cluster.run_pod(NS, pods[0], "node-0")
        cluster.patch("kubetitan.io/v1alpha1/llamapretrains", NS, "run", {"spec": {"training": {"warmupSteps": 500}}})
        cond = wait_for(lambda: (c := cluster.condition(NS, "run", "SpecAccepted")) and c["reason"] == "InvalidSpec"
                        and c, 20, "SpecAccepted InvalidSpec")
        assert "spec.training.warmupSteps" in cond["message"] and "a running attempt goes on" in cond["message"]
        cluster.terminate_pod(NS, pods[0], 1)
        wait_for(lambda: cluster.status(NS, "run").get("restartCount") == 1, 20, "restart recorded")
        cycles = "kubetitan_operator_reconcile_duration_seconds_count"
        base = op.metric(cycles) or 0.0
        wait_for(lambda: (op.metric(cycles) or 0.0) >= base + 20, 20, "20 more reconcile cycles")
        assert not [n for n in cluster.pod_names(NS, "run") if "-a1-" in n]


def test_single_node_run_without_a_checkpoint_volume_gets_a_warning_condition_and_one_event(cluster: Cluster) -> None:
    """``spec.checkpoint`` on (the default) with no storage on one node: the checkpoints would die with the pod.
    The run still starts (it is valid), with ``CheckpointsDurable=False`` reason ``NoCheckpointVolume`` and one
    Warning Event of that reason; a run with a claim gets ``CheckpointsDurable=True`` and no such Event."""
    bare = cpu_spec(nodes=1)
    del bare["checkpoint"]["storage"]
    op = Operator(cluster)
    with op:
        cluster.apply(lpt("bare", bare))
        cluster.apply(lpt("kept", cpu_spec(nodes=1)))
        cond = wait_for(lambda: cluster.condition(NS, "bare", "CheckpointsDurable"), 20, "CheckpointsDurable of bare")
        assert cond["status"] == "False" and cond["reason"] == "NoCheckpointVolume", cond
        assert "a re-created pod (node failure, eviction, a restart that re-creates the gang) starts again from " \
               "step 0" in cond["message"]
        events = wait_for(lambda: [e for e in cluster.list("v1/events", NS) if e.get("reason") == "NoCheckpointVolume"],
                          10, "NoCheckpointVolume event")
        assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "bare"
        assert events[0]["message"] == f"spec.checkpoint.storage: {cond['message']}"
        wait_for(lambda: len(cluster.pod_names(NS, "bare")) == 1, 20, "the pod of bare (a warning never blocks)")
        kept = wait_for(lambda: cluster.condition(NS, "kept", "CheckpointsDurable"), 20, "CheckpointsDurable of kept")
        assert kept["status"] == "True" and kept["reason"] == "CheckpointVolume", kept
        # One event, not one per cycle: let the operator run 20 more cycles, then count again.
        cycles = "kubetitan_operator_reconcile_duration_seconds_count"
        base = op.metric(cycles) or 0.0
        wait_for(lambda: (op.metric(cycles) or 0.0) >= base + 20, 20, "20 more reconcile cycles")
        warned = [e for e in cluster.list("v1/events", NS) if e.get("reason") == "NoCheckpointVolume"]
        assert [e["involvedObject"]["name"] for e in warned] == ["bare"]
        assert cluster.condition(NS, "bare", "CheckpointsDurable") == cond
