"""The planner: (LlamaPretrain, attempt) -> the child objects of that attempt.

Pure: no I/O, no clock, no randomness. Names are deterministic, so creating the same plan twice
is idempotent (``AlreadyExists`` is success), and pod names carry the attempt number, so a pod of
an earlier attempt stuck terminating on a dead node never blocks the next one.

One attempt = one gang:
- a ConfigMap ``<name>-config`` with ``trainer.toml`` (shared by all attempts; pods record its hash),
- a headless Service ``<name>`` giving every pod a stable DNS name (rendezvous + metrics),
- ``resources.nodes`` Pods ``<name>-a<attempt>-<rank>``, each running torchrun for one node,
- where the cluster serves Kubernetes PodGroups and the spec lets it (:func:`uses_pod_group`), a PodGroup
  ``<name>-a<attempt>`` with a gang policy of the attempt's size, which every pod names in ``spec.schedulingGroup``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kubetitan_core import API_VERSION, KIND, contract
from kubetitan_core.api import (LlamaPretrain, LlamaPretrainSpec, at_size, elastic_sizes, processes_per_node,
                                reads_s3_shards, resolved_dp_shard, world_size)
from kubetitan_core.catalog import (EFA_RESOURCE, GPU_RESOURCE, HOSTNAME_LABEL, HUGEPAGES_RESOURCE,
                                    INSTANCE_TYPE_LABEL, INSTANCE_TYPES, KUEUE_GROUP_COUNT, KUEUE_GROUP_LABEL,
                                    KUEUE_QUEUE_LABEL, pod_resources)
from kubetitan_core import hang, render
from kubetitan_core.contract import launcher as contract_launcher
from kubetitan_core.contract.launcher import RENDEZVOUS_PORT, LauncherArgs
from kubetitan_core.render import trainer_toml

LABEL_NAME = "kubetitan.io/name"
LABEL_UID = "kubetitan.io/uid"
LABEL_ATTEMPT = "kubetitan.io/attempt"
LABEL_RANK = "kubetitan.io/rank"
ANNOTATION_CONFIG_HASH = "kubetitan.io/config-hash"
CONTAINER_NAME = "trainer"
TERMINATION_MARGIN_SECONDS = 30
"""Extra grace on top of checkpoint.saveTimeoutSeconds for the process to flush and exit."""

TRAINER_UID = 10001
"""The trainer image's user and group (``ARG TRAINER_UID`` in images/trainer.Dockerfile; a test keeps them equal).
The pods run as it whatever the image says, and it is the ``fsGroup`` that makes fresh volume roots writable."""

HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
POD_GROUP_API_VERSION = "scheduling.k8s.io/v1beta1"
"""Kubernetes' own PodGroup API (KEP-4671; beta in 1.37 behind the ``GenericWorkload`` feature gate)."""
DEFAULT_SCHEDULER = "default-scheduler"


def config_map_name(name: str) -> str:
    return f"{name}-config"


def service_name(name: str) -> str:
    return name


def pod_name(name: str, attempt: int, rank: int) -> str:
    return f"{name}-a{attempt}-{rank}"


def pod_group_name(name: str, attempt: int) -> str:
    """The attempt's PodGroup (the name Kueue's pod-group label of the attempt carries too)."""
    return f"{name}-a{attempt}"


def master_address(lpt: LlamaPretrain, attempt: int) -> str:
    """DNS name of rank 0 through the headless service."""
    ns = lpt.metadata.namespace or "default"
    return f"{pod_name(lpt.metadata.name, attempt, 0)}.{service_name(lpt.metadata.name)}.{ns}.svc"


def job_labels(lpt: LlamaPretrain) -> dict[str, str]:
    """Labels on every child; select a run's children with ``kubetitan.io/name=<name>``."""
    labels = {
        "app.kubernetes.io/name": "kubetitan",
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "kubetitan",
        LABEL_NAME: lpt.metadata.name,
    }
    if lpt.metadata.uid:
        labels[LABEL_UID] = lpt.metadata.uid
    return labels


def owner_references(lpt: LlamaPretrain) -> list[dict[str, Any]]:
    """Owner reference to the LlamaPretrain (omitted when rendering offline without a uid)."""
    if not lpt.metadata.uid:
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": lpt.metadata.name,
            "uid": lpt.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _meta(lpt: LlamaPretrain, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None):
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if lpt.metadata.namespace:
        meta["namespace"] = lpt.metadata.namespace
    if annotations:
        meta["annotations"] = annotations
    if refs := owner_references(lpt):
        meta["ownerReferences"] = refs
    return meta


def config_map(lpt: LlamaPretrain) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(lpt, config_map_name(lpt.metadata.name), job_labels(lpt)),
        "data": {contract.CONFIG_KEY: trainer_toml(lpt)},
    }


def service(lpt: LlamaPretrain) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(lpt, service_name(lpt.metadata.name), job_labels(lpt)),
        "spec": {
            "clusterIP": "None",
            # Rendezvous must resolve before the pods are Ready.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_NAME: lpt.metadata.name},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                {"name": "metrics", "port": lpt.spec.monitoring.metrics_port,
                 "targetPort": lpt.spec.monitoring.metrics_port},
            ],
        },
    }


def efa_per_node(lpt: LlamaPretrain) -> int:
    return render.efa_per_node(lpt.spec)


def hugepages_2mi(lpt: LlamaPretrain) -> str:
    """`hugepages-2Mi` per pod: the instance type's amount when the pod gets EFA interfaces, else none."""
    it = INSTANCE_TYPES.get(lpt.spec.resources.instance_type or "")
    return it.hugepages_2mi if it is not None and efa_per_node(lpt) > 0 else ""


def _env(lpt: LlamaPretrain, attempt: int, job_start_time: float | None) -> list[dict[str, Any]]:
    s = lpt.spec
    env: list[dict[str, Any]] = [
        {"name": contract.ENV_ATTEMPT, "value": str(attempt)},
        {"name": contract.ENV_JOB_NAME, "value": lpt.metadata.name},
        {"name": contract.ENV_JOB_NAMESPACE, "value": lpt.metadata.namespace or "default"},
        {"name": contract.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": contract.ENV_NO_USER_SITE, "value": "1"},  # no .pth files from a home directory (reserved)
    ]
    if job_start_time is not None:
        env.append({"name": contract.ENV_JOB_START_TIME, "value": f"{job_start_time:.3f}"})
    if s.resources.gpus_per_node > 0:
        env += [
            {"name": "NCCL_DEBUG", "value": "WARN"},
            # Dump the NCCL flight recorder when a collective times out: the evidence for a hang.
            {"name": "TORCH_NCCL_DUMP_ON_TIMEOUT", "value": "1"},
            {"name": "TORCH_NCCL_TRACE_BUFFER_SIZE", "value": "2000"},
            {"name": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "value": f"{s.checkpoint.mount_path}/nccl_trace/rank_"},
        ]
    if efa_per_node(lpt) > 0:
        env.append({"name": "FI_PROVIDER", "value": "efa"})
        it = INSTANCE_TYPES.get(s.resources.instance_type or "")
        if it is None or it.rdma:  # GPUDirect RDMA over EFA: the p types (a g type's EFA has none)
            env.append({"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"})
        env.append({"name": "FI_EFA_FORK_SAFE", "value": "1"})
    tok = s.tokenizer.token_secret_ref
    if tok is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": tok.name, "key": tok.key}}})
    ck_s3, data_s3 = s.checkpoint.storage.s3, s.data.s3
    # one Secret at most (rule data.s3-one-secret); without one, the pod's identity (Pod Identity / IRSA)
    ref = (ck_s3.credentials_secret_ref if ck_s3 is not None else None) or \
        (data_s3.credentials_secret_ref if data_s3 is not None and reads_s3_shards(s) else None)
    if ref is not None:
        env += [{"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.access_key_id_key}}},
                {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {
                    "name": ref.name, "key": ref.secret_access_key_key}}}]
    # The user's variables replace ours of the same name (e.g. NCCL_DEBUG) instead of repeating them.
    user = copy.deepcopy(s.resources.env)
    names = {e.get("name") for e in user}
    env = [e for e in env if e["name"] not in names] + user
    return env


def pod_security_context() -> dict[str, Any]:
    """Pod-level securityContext: non-root as the image's uid, volumes group-owned by it, seccomp on.

    ``fsGroup`` makes the kubelet give every volume that supports ownership management (emptyDir, configMap,
    and PVCs whose CSI driver's ``fsGroupPolicy`` allows it) group ``TRAINER_UID`` with group write and the
    setgid bit, so a fresh root-owned claim is writable by the non-root trainer; ``OnRootMismatch`` does that
    walk only when the root's ownership is wrong (a large FSx checkpoint tree is not re-chowned at every pod
    start). hostPath volumes get no ownership change: docs/install.md says what an admin prepares.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": TRAINER_UID,
        "runAsGroup": TRAINER_UID,
        "fsGroup": TRAINER_UID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Container-level securityContext: Pod Security ``restricted`` with no capability at all, EFA included.

    EFA needs no added capability: the EFA device plugin injects the ``/dev/infiniband/uverbs*`` devices, and
    libfabric's memory registration needs the locked-memory rlimit, which the container runtime of the node
    sets (the EKS-optimized accelerated AL2023 AMIs and HyperPod's EKS AMI ship the host-level EFA setup; see
    "Manage EFA devices on Amazon EKS" in the EKS user guide). Adding ``IPC_LOCK`` would not help either: a
    process of a non-root user gets an empty effective capability set at execve unless ambient capabilities
    are set (capabilities(7)), and the pod API has no field for them.
    """
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _affinity(lpt: LlamaPretrain, attempt: int, avoid_nodes: Sequence[str]) -> dict[str, Any] | None:
    s = lpt.spec
    aff: dict[str, Any] = copy.deepcopy(s.resources.affinity) if s.resources.affinity else {}
    exprs: list[dict[str, Any]] = []
    if s.resources.platform == "hyperpod":
        exprs.append({"key": HYPERPOD_HEALTH_LABEL, "operator": "In", "values": ["Schedulable"]})
    if avoid_nodes:
        exprs.append({"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(avoid_nodes))})
    if exprs:
        node_aff = aff.setdefault("nodeAffinity", {})
        req = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []})
        terms = req.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({"matchExpressions": []})
        for term in terms:  # terms are ORed: every term must carry our rules
            term.setdefault("matchExpressions", []).extend(copy.deepcopy(exprs))
    if (s.resources.gpus_per_node > 0 or s.run_policy.elastic is not None) and s.resources.nodes > 1:
        # One pod per node: a gang of N nodes must really be N machines (an elastic run's size is a node count).
        pod_anti = aff.setdefault("podAntiAffinity", {})
        pod_anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {
                "labelSelector": {
                    "matchLabels": {LABEL_NAME: lpt.metadata.name, LABEL_ATTEMPT: str(attempt)}
                },
                "topologyKey": HOSTNAME_LABEL,
            }
        )
    return aff or None


def launcher_args(lpt: LlamaPretrain, attempt: int, rank: int,
                  hang_floor_seconds: float = hang.AUTO_HANG_FLOOR_SECONDS) -> LauncherArgs:
    """The launcher's arguments in the pod of node ``rank`` of ``attempt``
    (:func:`kubetitan_core.contract.launcher.launcher_args`, which ``kubetitan run`` calls too): the mounted config,
    rank 0 through the headless Service, one rendezvous id per attempt. In-place restarts
    (``runPolicy.maxInPlaceRestarts``; 0: the static launcher, every failure re-creates the gang): the launchers
    restart every rank's workers together, the operator records each one from rank 0's metrics and re-creates the
    gang when the attempt's budget is used up (``decide.failure.restarted_in_place``); the launcher's hang watchdog stops a
    worker whose step stands still and every rank's workers restart in place."""
    meta = lpt.metadata
    return contract_launcher.launcher_args(
        lpt.spec, config=f"{contract.CONFIG_MOUNT}/{contract.CONFIG_KEY}", node_rank=rank,
        master_addr=master_address(lpt, attempt), rdzv_id=f"{meta.namespace or 'default'}-{meta.name}-a{attempt}",
        hang_floor_seconds=hang_floor_seconds)


def _resources(lpt: LlamaPretrain) -> dict[str, Any]:
    """The trainer container's requests and limits: GPUs, EFA interfaces, CPU and memory, huge pages."""
    r = lpt.spec.resources
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if r.gpus_per_node > 0:
        limits[GPU_RESOURCE] = r.gpus_per_node
    if (efa := efa_per_node(lpt)) > 0:
        limits[EFA_RESOURCE] = efa
    # CPU and memory: the spec's (request = limit), else from the instance type (catalog.pod_resources says how).
    res = pod_resources(r.instance_type, r.gpus_per_node, processes_per_node(lpt.spec), r.cpu, r.memory)
    requests["cpu"], requests["memory"] = res.cpu, res.memory
    if res.cpu_limit is not None:
        limits["cpu"] = res.cpu_limit
    if res.memory_limit is not None:
        limits["memory"] = res.memory_limit
    if hp := hugepages_2mi(lpt):
        # Huge pages are not overcommitted: request = limit. The API server refuses them without a cpu or
        # memory request ("HugePages require cpu or memory"), which every trainer pod now has.
        limits[HUGEPAGES_RESOURCE] = requests[HUGEPAGES_RESOURCE] = hp
    return {k: v for k, v in (("limits", limits), ("requests", requests)) if v}


def _volumes(lpt: LlamaPretrain) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the trainer container's volume mounts, the pod's volumes): config, /dev/shm, checkpoints, the s3:// shards'
    staging disk, the data volume."""
    s = lpt.spec
    ck, data, st = s.checkpoint, s.data, s.checkpoint.storage
    mounts = [
        {"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": contract.SHM_MOUNT},
    ]
    volumes: list[dict[str, Any]] = [
        # only the trainer config: the ConfigMap also keeps the spec the attempt was created from (for the operator)
        {"name": "config", "configMap": {"name": config_map_name(lpt.metadata.name),
                                         "items": [{"key": contract.CONFIG_KEY, "path": contract.CONFIG_KEY}]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.resources.shm_size}},
    ]
    if ck.enabled and (st.persistent_volume_claim or st.host_path):
        mounts.append({"name": "checkpoints", "mountPath": ck.mount_path})
        if st.persistent_volume_claim:
            volumes.append({"name": "checkpoints", "persistentVolumeClaim": {
                "claimName": st.persistent_volume_claim.claim_name}})
        else:
            volumes.append({"name": "checkpoints", "hostPath": {"path": st.host_path, "type": "DirectoryOrCreate"}})
    elif ck.enabled and st.s3 is not None:
        # checkpoints go to S3; the dump folder is the pod's local scratch (compile cache, step log, tokenizer)
        mounts.append({"name": "checkpoints", "mountPath": ck.mount_path})
        volumes.append({"name": "checkpoints", "emptyDir": {}})
    if reads_s3_shards(s):  # node-local disk the s3:// shards are staged to (kubetitan_trainer.data.s3shards)
        mounts.append({"name": "data-stage", "mountPath": contract.DATA_STAGE_MOUNT})
        volumes.append({"name": "data-stage", "emptyDir": {}})
    if data.volume is not None:
        mounts.append({"name": "data", "mountPath": data.mount_path, "readOnly": data.volume.read_only})
        volumes.append({"name": "data", "persistentVolumeClaim": {
            "claimName": data.volume.claim_name, "readOnly": data.volume.read_only}})
    return mounts, volumes


def _container(lpt: LlamaPretrain, attempt: int, rank: int, job_start_time: float | None,
               mounts: list[dict[str, Any]], hang_floor_seconds: float) -> dict[str, Any]:
    """The trainer container: the launcher (``contract.TRAINER_COMMAND``: the image's interpreter by absolute path,
    user site off) with its arguments."""
    s, r = lpt.spec, lpt.spec.resources
    ports = [{"name": "metrics", "containerPort": s.monitoring.metrics_port, "protocol": "TCP"}]
    if rank == 0:
        ports.append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": r.image,
        "imagePullPolicy": r.image_pull_policy,
        "command": list(contract.TRAINER_COMMAND),
        "args": launcher_args(lpt, attempt, rank, hang_floor_seconds).to_argv(),
        "env": _env(lpt, attempt, job_start_time),
        "ports": ports,
        "volumeMounts": mounts,
        # The trainer's own message (e.g. the config error) becomes the pod's termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
    }
    if resources := _resources(lpt):
        container["resources"] = resources
    return container


def _scheduling(lpt: LlamaPretrain, attempt: int, avoid_nodes: Sequence[str]) -> dict[str, Any]:
    """The pod spec's placement fields that are set: node selector, tolerations, affinity, service account,
    priority class, scheduler, image pull secrets."""
    s, r = lpt.spec, lpt.spec.resources
    node_selector = dict(r.node_selector)
    if r.instance_type:
        node_selector.setdefault(INSTANCE_TYPE_LABEL, r.instance_type)
    tolerations = copy.deepcopy(r.tolerations)
    if r.gpus_per_node > 0 and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    fields: dict[str, Any] = {
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "affinity": _affinity(lpt, attempt, avoid_nodes),
        "serviceAccountName": r.service_account_name,
        "priorityClassName": r.priority_class_name,
        "schedulerName": s.scheduling.scheduler_name,
        "imagePullSecrets": [{"name": n} for n in r.image_pull_secrets],
    }
    return {k: v for k, v in fields.items() if v}


def uses_pod_group(spec: LlamaPretrainSpec, served: bool) -> bool:
    """Whether an attempt of ``spec`` gets a Kubernetes PodGroup: the API server serves them (``served``: the
    operator's API discovery, an input here), ``scheduling.podGroup`` is ``Auto``, and no other gang integration is
    asked for (a Kueue ``queueName``, or a ``schedulerName`` other than the default scheduler's, which would not read
    the PodGroup)."""
    sch = spec.scheduling
    return (served and sch.pod_group == "Auto" and sch.queue_name is None
            and sch.scheduler_name in (None, DEFAULT_SCHEDULER))


def pod_group(lpt: LlamaPretrain, attempt: int) -> dict[str, Any]:
    """The attempt's PodGroup: gang scheduling with ``minCount`` = the attempt's pods (``lpt`` sized to the
    attempt), so the scheduler binds all of them or none; the pods' priority class, so the gang is preempted and
    preempts as its pods would. Only ``gang.minCount`` of its spec may change after creation; the operator never
    changes it (an attempt of another size is another attempt, with its own PodGroup)."""
    meta = lpt.metadata
    labels = {**job_labels(lpt), LABEL_ATTEMPT: str(attempt)}
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": lpt.spec.resources.nodes}}}
    if lpt.spec.resources.priority_class_name:
        spec["priorityClassName"] = lpt.spec.resources.priority_class_name
    return {
        "apiVersion": POD_GROUP_API_VERSION,
        "kind": "PodGroup",
        "metadata": _meta(lpt, pod_group_name(meta.name, attempt), labels),
        "spec": spec,
    }


def pod(
    lpt: LlamaPretrain,
    attempt: int,
    rank: int,
    job_start_time: float | None = None,
    avoid_nodes: Sequence[str] = (),
    config_hash: str | None = None,
    hang_floor_seconds: float = hang.AUTO_HANG_FLOOR_SECONDS,
    in_pod_group: bool = False,
) -> dict[str, Any]:
    """The pod of node ``rank`` in ``attempt`` (``hang_floor_seconds``: the operator's ``--hang-floor-seconds``,
    passed on to the launcher's hang watchdog; ``in_pod_group``: the pod names the attempt's PodGroup in
    ``spec.schedulingGroup``)."""
    s, meta = lpt.spec, lpt.metadata
    name = pod_name(meta.name, attempt, rank)
    labels = {**job_labels(lpt), LABEL_ATTEMPT: str(attempt), LABEL_RANK: str(rank)}
    annotations = {ANNOTATION_CONFIG_HASH: config_hash or _hash(trainer_toml(lpt))}
    if s.scheduling.queue_name:
        labels[KUEUE_QUEUE_LABEL] = s.scheduling.queue_name
        labels[KUEUE_GROUP_LABEL] = pod_group_name(meta.name, attempt)
        annotations[KUEUE_GROUP_COUNT] = str(s.resources.nodes)
    mounts, volumes = _volumes(lpt)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts whole gangs, never single pods
        "hostname": name,
        "subdomain": service_name(meta.name),
        "automountServiceAccountToken": False,  # training pods get no Kubernetes API access
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": s.checkpoint.save_timeout_seconds + TERMINATION_MARGIN_SECONDS,
        "containers": [_container(lpt, attempt, rank, job_start_time, mounts, hang_floor_seconds)],
        "volumes": volumes,
        **_scheduling(lpt, attempt, avoid_nodes),
    }
    if in_pod_group:
        spec["schedulingGroup"] = {"podGroupName": pod_group_name(meta.name, attempt)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(lpt, name, labels, annotations),
        "spec": spec,
    }


def sized(lpt: LlamaPretrain, nodes: int | None) -> LlamaPretrain:
    """``lpt`` as an attempt of ``nodes`` nodes renders it (itself when ``nodes`` is None or its own size)."""
    if nodes is None or nodes == lpt.spec.resources.nodes:
        return lpt
    return lpt.model_copy(update={"spec": at_size(lpt.spec, nodes)})


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def attempt_children(
    lpt: LlamaPretrain,
    attempt: int,
    job_start_time: float | None = None,
    avoid_nodes: Sequence[str] = (),
    hang_floor_seconds: float = hang.AUTO_HANG_FLOOR_SECONDS,
    nodes: int | None = None,
    ranks: Collection[int] | None = None,
    pod_groups: bool = False,
    prepared: bool = False,
) -> list[dict[str, Any]]:
    """Every child object of ``attempt``: ConfigMap, Service, the PodGroup (``pod_groups``), then the pods by rank.
    ``nodes``: the attempt's gang size when it is not ``resources.nodes`` (``runPolicy.elastic``: ``status.nodes``):
    pods, ``--nnodes``, the trainer config and the PodGroup's ``minCount`` follow it, and the global batch stays the
    spec's (``kubetitan_core.api.at_size``). ``ranks``: render only these pods (each pod depends on its rank alone, so
    they are the full list's pods of those ranks). ``pod_groups``: the attempt is gang-scheduled through a Kubernetes
    PodGroup (the operator's answer to :func:`uses_pod_group` when the attempt started; pure: no discovery here).
    ``prepared``: the pods as :class:`Prepared`, each with its JSON text (what the operator sends); else plain dicts."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    lpt = sized(lpt, nodes)
    cm = config_map(lpt)
    digest = _hash(cm["data"][contract.CONFIG_KEY])
    wanted = [r for r in range(lpt.spec.resources.nodes) if ranks is None or r in ranks]
    pods = gang_pods(lambda rank: pod(lpt, attempt, rank, job_start_time, avoid_nodes, digest, hang_floor_seconds,
                                      in_pod_group=pod_groups), lpt.metadata.name, attempt, wanted, prepared)
    return [cm, service(lpt), *([pod_group(lpt, attempt)] if pod_groups else []), *pods]


class Prepared(dict):  # type: ignore[type-arg]
    """A child object together with its JSON text, made once: ``kube.Client`` sends ``text`` as the request body
    instead of serialising the object again. Read-only: pods of one gang share their nested parts."""

    __slots__ = ("text",)

    def __init__(self, obj: dict[str, Any], text: str | None = None) -> None:
        super().__init__(obj)
        self.text = text if text is not None else json.dumps(obj, separators=(",", ":"))


_NAME_TOKEN = "\x01kubetitan-pod-name\x01"
_RANK_TOKEN = "\x01kubetitan-rank\x01"
"""Placeholders of a rank's own values in the gang's pod template; JSON escapes the control characters, so the text
holds them as ``\\u0001...\\u0001`` (a template whose text holds them more often than placed, because a spec's own
string held one, is not used: each pod is serialised on its own then)."""


def _as_rank(t: dict[str, Any], node_rank_arg: int, name: str, rank: str) -> dict[str, Any]:
    """Rank ``rank``'s pod from the gang's template ``t`` (another rank's pod): new dicts only where they differ (the
    name, the hostname, the rank label, ``--node-rank``); every other part is ``t``'s own object."""
    container = dict(t["spec"]["containers"][0])
    container["args"] = [*container["args"][:node_rank_arg], f"--node-rank={rank}", *container["args"][node_rank_arg + 1:]]
    meta = {**t["metadata"], "name": name, "labels": {**t["metadata"]["labels"], LABEL_RANK: rank}}
    return {**t, "metadata": meta, "spec": {**t["spec"], "hostname": name, "containers": [container]}}


def gang_pods(render_rank: Any, name: str, attempt: int, ranks: Sequence[int], prepared: bool = True
              ) -> list[dict[str, Any]]:
    """The pods of ``ranks``, each equal to ``render_rank(rank)`` (:func:`pod`), at a fraction of the cost: rank 0 is
    rendered on its own (its rendezvous port), every other rank is a copy of one rendered rank that differs only in
    its name, hostname, rank label and ``--node-rank``, and (``prepared``) its JSON text is filled into the
    template's text (a 1,024-pod gang: two renders and two serialisations, not 1,024 of each; tests/api/test_plan.py
    compares every rank with :func:`pod`)."""
    out: list[dict[str, Any]] = []
    if 0 in ranks:
        out.append(Prepared(render_rank(0)) if prepared else render_rank(0))
    others = [r for r in ranks if r != 0]
    if not others:
        return out
    t = render_rank(others[0])
    first = str(others[0])
    node_rank_arg = t["spec"]["containers"][0]["args"].index(f"--node-rank={first}")
    if not prepared:
        return out + [_as_rank(t, node_rank_arg, pod_name(name, attempt, r), str(r)) for r in others]
    text = json.dumps(_as_rank(t, node_rank_arg, _NAME_TOKEN, _RANK_TOKEN), separators=(",", ":"))
    name_in, rank_in = json.dumps(_NAME_TOKEN)[1:-1], json.dumps(_RANK_TOKEN)[1:-1]
    usable = text.count(name_in) == 2 and text.count(rank_in) == 2  # name + hostname; label + --node-rank
    for r in others:
        pod_name_ = pod_name(name, attempt, r)
        obj = _as_rank(t, node_rank_arg, pod_name_, str(r))
        out.append(Prepared(obj, text.replace(name_in, pod_name_).replace(rank_in, str(r)) if usable else None))
    return out


def attempt_pod_names(lpt: LlamaPretrain, attempt: int, nodes: int | None = None) -> list[str]:
    """The names of ``attempt_children``'s pods, by rank, without rendering them."""
    return [pod_name(lpt.metadata.name, attempt, rank) for rank in range(sized(lpt, nodes).spec.resources.nodes)]


# ------------------------------------------------------------------ world-size changes
WORLD_SIZE_FIELDS = ("resources.nodes", "resources.gpusPerNode", "resources.processesPerNode", "parallelism")
"""Spec paths that set an attempt's world size (pods x processes) or how it splits into data-parallel ranks."""


def dp_degree(spec: LlamaPretrainSpec) -> int | None:
    """The data-parallel degree (replicate x shard, -1 resolved); None when the degrees do not divide the world."""
    shard = resolved_dp_shard(spec)
    return None if shard is None else shard * spec.parallelism.data_parallel_replicate_degree


def _world_size_fields(a: dict[str, Any], d: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path, before, after) of each world-size field an edit changes, a ``parallelism`` degree by its own path."""
    out: list[tuple[str, Any, Any]] = []
    for path in WORLD_SIZE_FIELDS:
        x, y = _at(a, path), _at(d, path)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += [(f"{path}.{k}", x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        else:
            out.append((path, x, y))
    return out


@dataclass(frozen=True)
class WorldSizeEdit:
    """A spec edit of a started run that changes its world size or data-parallel degree, and what becomes of it:
    applied at the next attempt (``allowed``), or refused (``refusal`` says why and the fix). The operator's spec
    gate (``status.spec_gate``) and the admission webhook (``admission.review``) both answer from this."""

    change: str
    """The fields and the numbers: "resources.nodes 2 -> 3 changes the world size 2 -> 3 and the data-parallel
    degree 2 -> 3"."""
    path: str
    """The first changed field as a spec path (``spec.resources.nodes``): where admission points its answer."""
    allowed: bool
    """Whether the trainer resumes the run's checkpoint at the new size (``world_size_change_allowed``)."""
    hub: str = "data.source huggingface"
    """The hub-streamed source that refuses it (``kubetitan_core.contract.per_rank_sources``)."""
    elastic: range | None = None
    """The node counts ``runPolicy.elastic`` allows the edited spec (``api.elastic_sizes``); None: not elastic."""

    @property
    def refusal(self) -> str:
        """Why a refused edit is refused, and the fix (the condition's, the Event's and the webhook's message)."""
        return (f"{self.change}: the edit is refused, and not applied, because the run reads hub-streamed data "
                f"({self.hub}), which cannot resume at another data-parallel degree: a streamed dataset keeps one "
                "read position per data-parallel rank. The running attempt goes on as "
                "it was created. Revert the edit; or prepare the dataset into shards with `kubetitan prepare-data` "
                "(data.source shards resumes at any size) and start a new LlamaPretrain on them; or start a new "
                "LlamaPretrain at the new size with its own checkpoint storage")

    @property
    def deferral(self) -> str:
        """What an allowed edit does (the admission warning; the operator's ``DeferredToNextAttempt`` message adds
        the other deferred fields)."""
        if self.elastic is not None:  # the size is the operator's to choose, within the bounds
            return (f"{self.change}: runPolicy.elastic sizes this run, so the next attempt keeps the size of the "
                    f"running one (its last resize) within minNodes..maxNodes ({self.elastic.start}.."
                    f"{self.elastic.stop - 1} now) and grows toward maxNodes when nodes stay free for "
                    "growCheckSeconds; other layout fields apply when the next attempt starts. The running attempt "
                    "goes on as it was created")
        return (f"{self.change}: applied when the next attempt starts (a restart, or suspend and resume to apply now), "
                "which resumes the newest checkpoint at the new size; the running attempt goes on as it was created")


def world_size_edit(applied: LlamaPretrainSpec, desired: LlamaPretrainSpec) -> WorldSizeEdit | None:
    """The world-size or data-parallel change of an edit from ``applied`` to ``desired``; None when it has none."""
    before = (world_size(applied), dp_degree(applied))
    after = (world_size(desired), dp_degree(desired))
    if before == after:
        return None
    fields = _world_size_fields(applied.model_dump(by_alias=True, mode="json"),
                                desired.model_dump(by_alias=True, mode="json"))
    change = (f"{', '.join(f'{p} {x} -> {y}' for p, x, y in fields) or 'the spec'} changes the world size "
              f"{before[0]} -> {after[0]} and the data-parallel degree {before[1]} -> {after[1]}")
    hub = [*contract.per_rank_sources(applied.data), *contract.per_rank_sources(desired.data)]
    return WorldSizeEdit(change=change, path=f"spec.{fields[0][0]}" if fields else "spec",
                         allowed=world_size_change_allowed(applied, desired),
                         elastic=elastic_sizes(desired) if desired.run_policy.elastic is not None else None,
                         **({"hub": hub[0]} if hub else {}))


def world_size_change_allowed(applied: LlamaPretrainSpec, desired: LlamaPretrainSpec) -> bool:
    """Whether an edit from ``applied`` to ``desired`` may change the world size at the next attempt: when it keeps
    the data-parallel degree, or when the trainer resumes both specs' data at another one
    (``kubetitan_core.contract.resumes_at_another_dp_degree``: not for hub-streamed data). The checkpoint was written
    with ``applied``'s data and is read with ``desired``'s, so both must allow it."""
    if dp_degree(applied) == dp_degree(desired):
        return True
    return contract.resumes_at_another_dp_degree(applied.data) and contract.resumes_at_another_dp_degree(desired.data)


def _at(d: Any, path: str) -> Any:
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
