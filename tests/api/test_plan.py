"""The planner: one attempt of a LlamaPretrain -> ConfigMap, headless Service and one pod per node."""

from __future__ import annotations

import pytest

from support.specs import make_lpt
from kubetitan_core import contract
from kubetitan.plan import attempt_children, master_address, pod_name
from kubetitan_core.validation import parse

PVC = {"storage": {"persistentVolumeClaim": {"claimName": "fsx"}}}


def plan(spec, attempt=0, **kw):
    lpt, errors = parse(make_lpt(spec, uid="uid-1"))
    assert errors == [], errors
    return lpt, attempt_children(lpt, attempt, **kw)


def arg(pod, flag):
    args = pod["spec"]["containers"][0]["args"]
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{flag}="))


def env(pod):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("nodes", [1, 4, 64], ids=["1-node", "4-nodes", "64-nodes"])
def test_gang_shape(nodes):
    spec = {"resources": {"nodes": nodes, "instanceType": "p5.48xlarge", "platform": "eks"}, "checkpoint": PVC}
    lpt, objs = plan(spec, attempt=3)
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ConfigMap", "Service"] + ["Pod"] * nodes
    pods = objs[2:]
    assert [p["metadata"]["name"] for p in pods] == [f"run-a3-{r}" for r in range(nodes)]
    assert len({p["metadata"]["name"] for p in pods}) == nodes
    for rank, p in enumerate(pods):
        labels = p["metadata"]["labels"]
        assert labels["kubetitan.io/attempt"] == "3" and labels["kubetitan.io/rank"] == str(rank)
        assert labels["kubetitan.io/name"] == "run" and labels["kubetitan.io/uid"] == "uid-1"
        assert arg(p, "node-rank") == str(rank)
        assert arg(p, "nnodes") == str(nodes)
        assert arg(p, "nproc-per-node") == "8"
        assert arg(p, "master-addr") == "run-a3-0.run.ml.svc" == master_address(lpt, 3)
        assert arg(p, "rdzv-id") == "ml-run-a3"
        rp = lpt.spec.run_policy  # rank 0's DNS wait outlasts the scheduling wait (Unschedulable is reported first)
        assert arg(p, "dns-timeout") == str(rp.unschedulable_timeout_seconds + rp.startup_timeout_seconds)
        assert arg(p, "rdzv-timeout") == str(rp.unschedulable_timeout_seconds + rp.startup_timeout_seconds)
        assert p["spec"]["hostname"] == p["metadata"]["name"] and p["spec"]["subdomain"] == "run"
        assert p["spec"]["restartPolicy"] == "Never"
        assert p["spec"]["automountServiceAccountToken"] is False
        # CPU/memory from the catalog: 90% of p5's 192 vCPUs (no CPU limit), 85% of its 2048 GiB (request = limit);
        # huge pages: libfabric's EFA buffers
        assert p["spec"]["containers"][0]["resources"] == {
            "limits": {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32, "memory": "1740Gi", "hugepages-2Mi": "5120Mi"},
            "requests": {"cpu": "172", "memory": "1740Gi", "hugepages-2Mi": "5120Mi"}}
        assert p["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p["spec"]["tolerations"]
        assert env(p)[contract.ENV_ATTEMPT] == "3" and env(p)["FI_PROVIDER"] == "efa"
        ref = p["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LlamaPretrain", "run", "uid-1", True)
        anti = p["spec"].get("affinity", {}).get("podAntiAffinity")
        assert (anti is not None) == (nodes > 1), "one pod per node only matters for several nodes"
    ports = {pt["name"] for pt in pods[0]["spec"]["containers"][0]["ports"]}
    assert ports == {"metrics", "rendezvous"}
    svc = objs[1]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"kubetitan.io/name": "run"}


@pytest.mark.parametrize("resources,limits,requests", [
    ({"instanceType": "ml.p4d.24xlarge", "platform": "hyperpod"},  # HyperPod names keep the amounts
     {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 4, "hugepages-2Mi": "5120Mi", "memory": "979Gi"},
     {"hugepages-2Mi": "5120Mi", "cpu": "86", "memory": "979Gi"}),
    ({"instanceType": "p5en.48xlarge", "platform": "eks", "memory": "1500Gi"},  # the spec's memory is the request
     {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 16, "hugepages-2Mi": "5120Mi", "memory": "1500Gi"},
     {"hugepages-2Mi": "5120Mi", "cpu": "172", "memory": "1500Gi"}),
    ({"instanceType": "p5.48xlarge", "platform": "eks", "efaPerNode": 0}, {"nvidia.com/gpu": 8, "memory": "1740Gi"},
     {"cpu": "172", "memory": "1740Gi"}),
    ({"instanceType": "p5.48xlarge", "platform": "generic"}, {"nvidia.com/gpu": 8, "memory": "1740Gi"},
     {"cpu": "172", "memory": "1740Gi"}),  # no EFA off eks
    ({"instanceType": "g6e.48xlarge", "platform": "eks"},  # g6e's EFA: no huge pages (no GPUDirect RDMA setup)
     {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 4, "memory": "1305Gi"}, {"cpu": "172", "memory": "1305Gi"}),
])
def test_huge_pages_come_with_efa_only(resources, limits, requests):
    _, objs = plan({"resources": resources, "checkpoint": PVC})
    res = objs[2]["spec"]["containers"][0]["resources"]
    assert res["limits"] == limits and res.get("requests") == requests


def test_trainer_config_carries_the_network_check_inputs():
    import tomllib

    _, objs = plan({"resources": {"instanceType": "p5.48xlarge", "platform": "eks",
                                  "networkFallback": "AllowSockets"}, "checkpoint": PVC})
    kt = tomllib.loads(objs[0]["data"][contract.CONFIG_KEY])["kubetitan"]
    assert (kt["platform"], kt["efa_per_node"], kt["network_fallback"]) == ("eks", 32, "AllowSockets")
    _, objs = plan({})
    kt = tomllib.loads(objs[0]["data"][contract.CONFIG_KEY])["kubetitan"]
    assert (kt["platform"], kt["efa_per_node"], kt["network_fallback"]) == ("generic", 0, "Fail")


def test_trainer_logs_without_colour_codes():
    """The log's end is the termination message, which the restart record and its Event quote."""
    import tomllib

    _, objs = plan({})
    assert tomllib.loads(objs[0]["data"][contract.CONFIG_KEY])["metrics"]["disable_color_printing"] is True


def test_plan_is_deterministic_and_attempts_never_collide():
    _, a = plan({})
    _, b = plan({})
    assert a == b
    _, c = plan({}, attempt=1)
    assert {o["metadata"]["name"] for o in a if o["kind"] == "Pod"}.isdisjoint(
        {o["metadata"]["name"] for o in c if o["kind"] == "Pod"})
    # The config and service are shared by attempts: same names, same content.
    assert a[:2] == c[:2]


def test_config_map_holds_the_rendered_trainer_config_and_pods_record_its_hash():
    _, objs = plan({"training": {"steps": 77, "warmupSteps": 5}})
    toml = objs[0]["data"][contract.CONFIG_KEY]
    assert "steps = 77" in toml and 'name = "kubetitan_llama3"' in toml
    _, objs2 = plan({"training": {"steps": 78, "warmupSteps": 5}})
    h1 = objs[2]["metadata"]["annotations"]["kubetitan.io/config-hash"]
    h2 = objs2[2]["metadata"]["annotations"]["kubetitan.io/config-hash"]
    assert h1 != h2


@pytest.mark.parametrize(
    "spec, check",
    [
        ({"scheduling": {"queueName": "q"}},
         lambda p: p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
         and p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "run-a0"
         and p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "1"),
        ({"scheduling": {"schedulerName": "volcano"}}, lambda p: p["spec"]["schedulerName"] == "volcano"),
        ({"resources": {"platform": "hyperpod", "instanceType": "ml.p5.48xlarge"}},
         lambda p: {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In", "values": ["Schedulable"]}
         in p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
             "nodeSelectorTerms"][0]["matchExpressions"]),
        ({"resources": {"gpusPerNode": 0, "processesPerNode": 2}, "model": {"flavor": "debug"},
          "precision": {"compile": False}},
         lambda p: p["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
         and "tolerations" not in p["spec"]
         and arg(p, "nproc-per-node") == "2"),
        ({"checkpoint": {"saveTimeoutSeconds": 900}}, lambda p: p["spec"]["terminationGracePeriodSeconds"] == 930),
        ({"tokenizer": {"source": "huggingface", "repo": "r", "tokenSecretRef": {"name": "hf"}}},
         lambda p: env(p)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}),
        ({"resources": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}},
         lambda p: [e for e in p["spec"]["containers"][0]["env"] if e["name"] == "NCCL_DEBUG"][-1]["value"] == "INFO"),
        ({"resources": {"shmSize": "32Gi"}},
         lambda p: {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in p["spec"]["volumes"]),
        ({"data": {"source": "shards", "shards": {"path": "/data/t"}, "volume": {"claimName": "d", "readOnly": True}}},
         lambda p: {"name": "data", "persistentVolumeClaim": {"claimName": "d", "readOnly": True}}
         in p["spec"]["volumes"]),
        ({"checkpoint": {"storage": {"hostPath": "/ck"}}},
         lambda p: {"name": "checkpoints", "hostPath": {"path": "/ck", "type": "DirectoryOrCreate"}}
         in p["spec"]["volumes"]),
        ({"resources": {"cpu": "180", "memory": "1800Gi"}},
         lambda p: p["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "180", "memory": "1800Gi"}
         and p["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "180",
                                                                   "memory": "1800Gi"}),
    ],
    ids=["kueue", "scheduler", "hyperpod-health", "cpu", "grace", "hf-token", "user-env-last", "shm", "data-pvc",
         "host-path", "cpu-memory"],
)
def test_pod_options(spec, check):
    _, objs = plan(spec)
    assert check(objs[2])


def test_avoided_nodes_become_node_affinity():
    _, objs = plan({"resources": {"nodes": 2}, "checkpoint": PVC}, attempt=2, avoid_nodes=["n2", "n1", "n1"])
    terms = objs[2]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]} in terms[0][
        "matchExpressions"]


def test_user_affinity_terms_all_get_the_operator_rules():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}
    _, objs = plan({"resources": {"affinity": user}}, avoid_nodes=["bad"])
    terms = objs[2]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert len(terms) == 2
    assert all(any(e["key"] == "kubernetes.io/hostname" for e in t["matchExpressions"]) for t in terms)
    # The user's object is not mutated by planning.
    assert len(user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]) == 1


def test_pod_name_fits_a_dns_label_for_the_longest_allowed_name():
    assert len(pod_name("x" * 48, 9999, 4095)) <= 63


def test_negative_attempt_is_refused():
    lpt, _ = parse(make_lpt({}))
    with pytest.raises(ValueError, match="attempt"):
        attempt_children(lpt, -1)


@pytest.mark.parametrize("example", [p.name for p in __import__("support.paths", fromlist=["EXAMPLES"]).EXAMPLES])
@pytest.mark.parametrize("kw", [{}, {"ranks": {1, 3}}, {"ranks": {0}}, {"pod_groups": True, "avoid_nodes": ("n7",)},
                                {"stray": True}],
                         ids=["every-rank", "some-ranks", "rank-0", "pod-group-and-avoid", "a-spec-holding-a-placeholder"])
def test_each_pod_of_the_gang_template_is_the_pod_of_its_rank(example: str, kw: dict) -> None:
    """A gang's pods come from one template (plan.gang_pods): each is exactly ``plan.pod`` of its rank, and its
    prepared JSON text is that pod, for every example (GPUs, EFA, Kueue, S3...), rank 0 included."""
    kw = dict(kw)
    import json

    import yaml

    from kubetitan import plan as plan_mod
    from support.paths import EXAMPLES

    doc = yaml.safe_load(next(p for p in EXAMPLES if p.name == example).read_text())
    doc["metadata"]["uid"] = "uid-1"
    spec = doc["spec"]
    spec.setdefault("resources", {})["nodes"] = max(4, spec["resources"].get("nodes", 1))
    if kw.pop("stray", False):  # the template's placeholder in the spec itself: each pod serialised on its own
        spec["resources"].setdefault("env", []).append({"name": "X", "value": "\x01kubetitan-rank\x01"})
    if "hostPath" in (spec.get("checkpoint") or {}).get("storage", {}):  # single-node only: a claim for 4 nodes
        spec["checkpoint"]["storage"] = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    spec.setdefault("parallelism", {})["dataParallelShardDegree"] = -1  # whatever the 4 nodes' world is
    lpt, errors = parse(doc)
    assert lpt is not None and errors == [], errors
    objs = attempt_children(lpt, 2, job_start_time=1000.0, prepared=True, **kw)
    pods = [o for o in objs if o["kind"] == "Pod"]
    digest = plan_mod._hash(objs[0]["data"][contract.CONFIG_KEY])
    ranks = sorted(kw.get("ranks", range(lpt.spec.resources.nodes)))
    assert [p["metadata"]["name"] for p in pods] == [pod_name(lpt.metadata.name, 2, r) for r in ranks]
    for r, p in zip(ranks, pods):
        want = plan_mod.pod(lpt, 2, r, 1000.0, kw.get("avoid_nodes", ()), digest,
                            in_pod_group=kw.get("pod_groups", False))
        assert p == want and json.loads(p.text) == want, r
    plain = [o for o in attempt_children(lpt, 2, job_start_time=1000.0, **kw) if o["kind"] == "Pod"]
    assert plain == pods and all(type(o) is dict for o in plain)  # what `kubetitan render` dumps as YAML
