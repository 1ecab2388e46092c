"""Elastic runs (``runPolicy.elastic``): the node capacity the decision reads (``kubetitan.elastic``, table tests on
pods the planner renders) and the status a resize leads to (``kubetitan.status.next_status``). The decision rules
themselves are table cases of tests/operator/test_decide_elastic.py (``CASES``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.specs import lpt

from kubetitan import conditions as C
from kubetitan import elastic, plan
from kubetitan.decide import Action, Decision
from kubetitan.observation import Capacity, NodeObs, Observed, Progress
from kubetitan.timestamps import iso
from kubetitan.status import next_status
from kubetitan_core.api import LlamaPretrain, LlamaPretrainSpec, LlamaPretrainStatus

NOW = 1_000_000.0


def run(**resources) -> LlamaPretrain:
    return LlamaPretrain.model_validate(lpt("e", {
        "resources": {"nodes": 3, "gpusPerNode": 8, "instanceType": "p5.48xlarge", **resources},
        "training": {"globalBatchSize": 48}, "data": {"source": "synthetic"}, "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "c"}}},
        "runPolicy": {"elastic": {"minNodes": 2, "growCheckSeconds": 120}}}, uid="u1"))


GPU_NODE = NodeObs("n", labels=(("node.kubernetes.io/instance-type", "p5.48xlarge"),),
                   allocatable=(("nvidia.com/gpu", "8"),), ready_since=NOW - 500)
P5 = (("hugepages-2Mi", "5120Mi"), ("nvidia.com/gpu", "8"), ("vpc.amazonaws.com/efa", "32"))
"""What a p5.48xlarge offers with the EFA device plugin and huge pages set up (an EKS node)."""
EKS = {"platform": "eks"}
"""The planner then requests 32 EFA interfaces and 5120Mi of hugepages-2Mi with the 8 GPUs (tests/api/test_plan.py)."""

FITS = [
    ("ready-gpu-node", {}, {}, True),
    ("not-ready", {}, {"ready": None}, False),
    ("missing", {}, {"exists": False}, False),
    ("cordoned", {}, {"unschedulable": True}, False),
    ("too-few-gpus", {}, {"allocatable": (("nvidia.com/gpu", "4"),)}, False),
    ("no-gpus-listed", {}, {"allocatable": ()}, False),
    ("eks-node-with-efa-and-huge-pages", EKS, {"allocatable": P5}, True),
    ("eks-node-without-efa", EKS, {"allocatable": (("hugepages-2Mi", "5120Mi"), ("nvidia.com/gpu", "8"))}, False),
    ("eks-node-with-too-few-efa", EKS, {"allocatable": P5[:2] + (("vpc.amazonaws.com/efa", "16"),)}, False),
    ("eks-node-without-huge-pages", EKS, {"allocatable": P5[1:]}, False),
    ("eks-node-with-too-few-huge-pages", EKS, {"allocatable": (("hugepages-2Mi", "2Gi"),) + P5[1:]}, False),
    ("eks-node-offering-more", EKS, {"allocatable": (("hugepages-2Mi", "8Gi"), ("nvidia.com/gpu", "8"),
                                                     ("vpc.amazonaws.com/efa", "64"))}, True),
    ("generic-pod-asks-no-efa", {}, {"allocatable": (("nvidia.com/gpu", "8"),)}, True),
    ("other-instance-type", {}, {"labels": (("node.kubernetes.io/instance-type", "p4d.24xlarge"),)}, False),
    ("untolerated-taint", {}, {"taints": (("dedicated", "team-b", "NoSchedule"),)}, False),
    ("tolerated-taint", {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "team-a",
                                          "effect": "NoSchedule"}]},
     {"taints": (("dedicated", "team-a", "NoSchedule"),)}, True),
    ("prefer-no-schedule-taint-does-not-block", {}, {"taints": (("x", "", "PreferNoSchedule"),)}, True),
    ("gpu-taint-tolerated-by-the-planner", {}, {"taints": (("nvidia.com/gpu", "present", "NoSchedule"),)}, True),
    ("node-selector-label-missing", {"nodeSelector": {"team": "a"}}, {}, False),
    ("required-affinity-matches", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]}}}},
     {"labels": (("node.kubernetes.io/instance-type", "p5.48xlarge"), ("zone", "z1"))}, True),
    ("required-affinity-does-not-match", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}]}}}},
     {"labels": (("node.kubernetes.io/instance-type", "p5.48xlarge"), ("zone", "z2"))}, False),
]


@pytest.mark.parametrize(("resources", "node", "want"), [c[1:] for c in FITS], ids=[c[0] for c in FITS])
def test_a_node_fits_the_rendered_pod(resources, node, want) -> None:
    pod = plan.pod(run(**resources), 0, 0)
    assert elastic.fits(replace(GPU_NODE, **node), elastic.placement(pod)) is want


def test_avoided_nodes_do_not_count() -> None:
    """A node the run avoids (failed as a node twice: ``decide.failure.nodes_to_avoid``) is no capacity."""
    nodes = [replace(GPU_NODE, name=f"n{i}") for i in range(3)]
    assert elastic.run_capacity(run(), 1, (), nodes, NOW) == Capacity(3, 3)
    assert elastic.run_capacity(run(), 1, ("n1",), nodes, NOW) == Capacity(2, 2)


def test_capacity_is_stable_only_after_grow_check_seconds() -> None:
    """Ready for 500 s counts as stable; a node Ready for 60 s (growCheckSeconds 120) counts only as schedulable."""
    nodes = [replace(GPU_NODE, name="a"), replace(GPU_NODE, name="b"), replace(GPU_NODE, name="c", ready_since=NOW - 60)]
    assert elastic.run_capacity(run(), 0, (), nodes, NOW) == Capacity(schedulable=3, stable=2)


def test_no_capacity_for_a_run_that_is_not_elastic() -> None:
    obj = run()
    obj.spec.run_policy.elastic = None
    assert elastic.run_capacity(obj, 0, (), [GPU_NODE], NOW) is None


def test_an_elastic_gang_is_one_pod_per_node_also_on_cpu() -> None:
    obj = LlamaPretrain.model_validate(lpt("e", {"resources": {"nodes": 3, "gpusPerNode": 0, "processesPerNode": 1},
                                                 "runPolicy": {"elastic": {"minNodes": 2}}}, uid="u1"))
    anti = plan.pod(obj, 0, 0)["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"


def test_an_attempt_renders_its_own_size_with_the_same_global_batch() -> None:
    """A shrunk attempt: 2 pods with --nnodes=2 (data-parallel degree 16), the spec's global batch (48) kept by
    gradient accumulation (3 micro-batches instead of 2)."""
    import tomllib

    children = plan.attempt_children(run(), 4, nodes=2)
    pods = [c for c in children if c["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["e-a4-0", "e-a4-1"]
    assert all("--nnodes=2" in p["spec"]["containers"][0]["args"] for p in pods)
    cfg = tomllib.loads(children[0]["data"]["trainer.toml"])
    assert cfg["training"]["global_batch_size"] == 48 and cfg["training"]["local_batch_size"] == 1
    full = tomllib.loads(plan.attempt_children(run(), 5, nodes=3)[0]["data"]["trainer.toml"])
    assert full["training"]["global_batch_size"] == 48


def test_an_unset_global_batch_is_pinned_at_the_spec_size() -> None:
    """No globalBatchSize: localBatchSize x the data-parallel degree at resources.nodes (2 x 3 = 6 on 3 one-process
    CPU nodes) is what every size trains."""
    import tomllib

    obj = LlamaPretrain.model_validate(lpt("e", {
        "model": {"flavor": "debug"}, "tokenizer": {"source": "builtin"}, "training": {"localBatchSize": 2},
        "resources": {"nodes": 3, "gpusPerNode": 0, "processesPerNode": 1},
        "runPolicy": {"elastic": {"minNodes": 2}}}, uid="u1"))
    for n, want in ((2, 6), (3, -1)):  # -1 at the spec's own size: torchtitan's local x dp, the same 6
        cfg = tomllib.loads(plan.attempt_children(obj, 0, nodes=n)[0]["data"]["trainer.toml"])
        assert cfg["training"]["global_batch_size"] == want, n


def elastic_spec() -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 3},
                                             "runPolicy": {"elastic": {"minNodes": 2}}})


def test_a_shrink_is_a_restart_record_with_the_sizes_and_its_own_budget() -> None:
    old = LlamaPretrainStatus(attempt=0, nodes=3, start_time=iso(NOW - 100))
    obs = Observed(now=NOW, progress=Progress(step=25, last_checkpoint_step=20))
    d = Decision(Action.RESTART, C.RESIZING, "lost n2", cause="Shrink", nodes=2, node_name="n2")
    new = next_status(elastic_spec(), old, d, obs)
    r = new.restarts[-1]
    assert (r.cause, r.from_nodes, r.to_nodes, r.resumed_from_step, r.lost_steps) == ("Shrink", 3, 2, 20, 5)
    assert (new.attempt, new.nodes, new.resize_count, new.restart_count) == (1, 2, 1, 0)
    full = C.find(new.conditions, C.FULL_SIZE)
    assert full is not None and (full.status, full.reason) == ("False", C.SHRUNK), full
    assert new.pending_events[-1].reason == "RestartShrink"
    # the next attempt is created at 2 nodes; once the grow is planned the condition says so
    created = next_status(elastic_spec(), new, Decision(Action.CREATE, C.CREATING, "", nodes=2), Observed(now=NOW))
    assert created.nodes == 2
    planned = next_status(elastic_spec(), created, Decision(Action.KEEP, C.TRAINING, "", ready=True,
                                                            grow_plan=(3, 40)), Observed(now=NOW))
    assert (planned.observation.grow_to, planned.observation.grow_after_step) == (3, 40)
    assert C.find(planned.conditions, C.FULL_SIZE).reason == C.GROW_PLANNED
    grown = next_status(elastic_spec(), planned, Decision(Action.RESTART, C.RESIZING, "", cause="Grow", nodes=3),
                        Observed(now=NOW + 1))
    assert (grown.nodes, grown.resize_count, grown.restart_count, grown.restarts[-1].from_nodes) == (3, 2, 0, 2)
    assert grown.observation.grow_to is None  # a new attempt: its plan is gone
    assert C.find(grown.conditions, C.FULL_SIZE).status == "True"
