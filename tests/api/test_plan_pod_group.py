"""The planner's Kubernetes PodGroup: when an attempt gets one (a pure answer from the spec and what the server
serves) and what it is (a gang of the attempt's size, named by every pod of the attempt)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from support.specs import cpu_spec, make_lpt
from kubetitan import plan
from kubetitan_core.validation import parse


def _lpt(spec):
    lpt, errors = parse(make_lpt(spec, uid="uid-1"))
    assert errors == [], errors
    return lpt


def _spec(nodes=4, **scheduling):
    spec = cpu_spec(nodes)
    spec["scheduling"] = scheduling
    return spec


@pytest.mark.parametrize(("served", "scheduling", "want"), [
    (True, {}, True),
    (False, {}, False),
    (True, {"podGroup": "Disabled"}, False),
    (True, {"queueName": "team-a"}, False),
    (True, {"schedulerName": "volcano"}, False),
    (True, {"schedulerName": "default-scheduler"}, True),
    (False, {"podGroup": "Auto"}, False),
], ids=["served", "not-served", "opted-out", "kueue-keeps-its-labels", "another-scheduler", "default-scheduler-named",
        "auto-not-served"])
def test_when_an_attempt_gets_a_pod_group(served, scheduling, want):
    assert plan.uses_pod_group(_lpt(_spec(**scheduling)).spec, served) is want


def _by_kind(objs):
    return [o["kind"] for o in objs]


def _elastic(nodes=4):
    """An elastic run of 2..``nodes`` nodes (a global batch every size's data-parallel degree divides)."""
    spec = _spec(nodes)
    spec["runPolicy"] = {"elastic": {"minNodes": 2}}
    spec["parallelism"] = {"dataParallelShardDegree": -1}
    spec["training"]["globalBatchSize"] = 192
    return spec


@pytest.mark.parametrize(("spec", "kw", "size"), [
    (_spec(4), {}, 4),
    (_spec(1), {}, 1),
    (_elastic(4), {"nodes": 2}, 2),
    (_elastic(4), {"nodes": 3}, 3),
], ids=["4-nodes", "1-node", "elastic-shrunk-to-2", "elastic-at-3"])
def test_the_pod_group_is_a_gang_of_the_attempt_and_every_pod_names_it(spec, kw, size):
    lpt = _lpt(spec)
    objs = plan.attempt_children(lpt, 3, pod_groups=True, **kw)
    assert _by_kind(objs) == ["ConfigMap", "Service", "PodGroup"] + ["Pod"] * size
    group = objs[2]
    assert group == {
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
        "metadata": {"name": "run-a3", "namespace": "ml",
                     "labels": {**plan.job_labels(lpt), "kubetitan.io/attempt": "3"},
                     "ownerReferences": plan.owner_references(lpt)},
        "spec": {"schedulingPolicy": {"gang": {"minCount": size}}},
    }
    assert plan.pod_group_name("run", 3) == "run-a3"
    for p in objs[3:]:
        assert p["spec"]["schedulingGroup"] == {"podGroupName": "run-a3"}
    # the pods are the same as without a PodGroup, but for the one field
    without = plan.attempt_children(lpt, 3, **kw)
    for a, b in zip(objs[3:], without[2:], strict=True):
        assert {**a, "spec": {k: v for k, v in a["spec"].items() if k != "schedulingGroup"}} == b


def test_without_pod_groups_the_children_are_todays():
    lpt = _lpt(_spec(2))
    objs = plan.attempt_children(lpt, 0)
    assert _by_kind(objs) == ["ConfigMap", "Service", "Pod", "Pod"]
    assert objs == plan.attempt_children(lpt, 0, pod_groups=False)
    assert all("schedulingGroup" not in p["spec"] for p in objs[2:])


def test_kueue_keeps_its_labels_and_gets_no_pod_group():
    lpt = _lpt(_spec(2, queueName="team-a"))
    objs = plan.attempt_children(lpt, 1, pod_groups=plan.uses_pod_group(lpt.spec, served=True))
    assert _by_kind(objs) == ["ConfigMap", "Service", "Pod", "Pod"]
    for p in objs[2:]:
        assert p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "run-a1"
        assert "schedulingGroup" not in p["spec"]


def test_a_subset_of_ranks_still_gets_the_whole_gangs_pod_group():
    """A missing rank of a live gang is created again in the gang it belongs to: minCount stays the attempt's."""
    objs = plan.attempt_children(_lpt(_spec(4)), 2, ranks={1}, pod_groups=True)
    assert _by_kind(objs) == ["ConfigMap", "Service", "PodGroup", "Pod"]
    assert objs[2]["spec"]["schedulingPolicy"]["gang"]["minCount"] == 4
    assert objs[3]["metadata"]["name"] == "run-a2-1"
    assert objs[3]["spec"]["schedulingGroup"] == {"podGroupName": "run-a2"}


def test_the_pod_group_carries_the_pods_priority_class():
    spec = _spec(2)
    spec["resources"]["priorityClassName"] = "training-high"
    objs = plan.attempt_children(_lpt(spec), 0, pod_groups=True)
    assert objs[2]["spec"]["priorityClassName"] == "training-high"
    assert all(p["spec"]["priorityClassName"] == "training-high" for p in objs[3:])


def test_the_pod_group_and_its_pods_pass_the_kubernetes_1_37_schemas():
    """Field names as Kubernetes 1.37 spells them (strict: an unknown field is an error); before 1.37 there is no
    scheduling.k8s.io/v1beta1 PodGroup and no pod field naming one, which is why the operator asks the server."""
    objs = plan.attempt_children(_lpt(_spec(2)), 0, pod_groups=True)
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(objs[3], "1.35", strict=True)  # no spec.schedulingGroup before 1.36
    bad = {**objs[2], "spec": {"schedulingPolicy": {"gang": {"minCount": 2, "minMember": 2}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37", strict=True)


def test_the_spec_field_is_typed():
    assert _lpt(_spec(2)).spec.scheduling.pod_group == "Auto"
    _, errors = parse(make_lpt(_spec(2, podGroup="Off")))
    assert errors and "podGroup" in str(errors[0])
