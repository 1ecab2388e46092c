"""Facts the validator, the planner and the trainer share: model flavours, accelerators, instance types.

The Kubernetes label and resource names of the nodes and pods these run on are defined here too.

Pure data, no I/O. The model dimensions are torchtitan 0.2.2's Llama 3 flavours
(``torchtitan/models/llama3/__init__.py``); a test checks them against the installed
torchtitan so that the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# ---- Kubernetes names of the nodes and the pods: defined here once (the planner, the elastic capacity, the node
# observation, the validator and the admin policy read them)
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
HOSTNAME_LABEL = "kubernetes.io/hostname"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"


@dataclass(frozen=True)
class ModelDims:
    """Transformer dimensions of one Llama 3 flavour."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim_multiplier: float | None
    multiple_of: int
    rope_theta: float
    vocab_size: int = 128256


# flavour name in the LlamaPretrain spec -> (torchtitan flavour name, dims)
FLAVOURS: dict[str, tuple[str, ModelDims]] = {
    "debug": ("debugmodel", ModelDims(256, 6, 16, 16, None, 256, 500000.0, 2048)),
    "1B": ("1B", ModelDims(2048, 16, 32, 8, 1.5, 256, 500000.0)),
    "3B": ("3B", ModelDims(3072, 28, 24, 8, 1.0, 256, 500000.0)),
    "8B": ("8B", ModelDims(4096, 32, 32, 8, 1.3, 1024, 500000.0)),
    "70B": ("70B", ModelDims(8192, 80, 64, 8, 1.3, 4096, 500000.0)),
    "405B": ("405B", ModelDims(16384, 126, 128, 8, 1.2, 4096, 500000.0)),
}


@dataclass(frozen=True)
class Accelerator:
    """One GPU product as the validator and the MFU computation see it."""

    product: str
    compute_capability: tuple[int, int]
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak per GPU (no sparsity), the MFU denominator."""
    memory_gib: int

    @property
    def supports_float8(self) -> bool:
        """FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper) on."""
        return self.compute_capability >= (8, 9)


ACCELERATORS: dict[str, Accelerator] = {
    # Dense bf16 tensor-core peaks from NVIDIA's data sheets (the sparsity figures halved); memory per GPU.
    "H100": Accelerator("NVIDIA H100 80GB HBM3", (9, 0), 989.4, 80),
    "H200": Accelerator("NVIDIA H200", (9, 0), 989.4, 141),
    "B200": Accelerator("NVIDIA B200", (10, 0), 2250.0, 180),
    "A100": Accelerator("NVIDIA A100-SXM4-80GB", (8, 0), 312.0, 80),
    "L40S": Accelerator("NVIDIA L40S", (8, 9), 362.1, 48),
    "L4": Accelerator("NVIDIA L4", (8, 9), 121.0, 24),
    "A10G": Accelerator("NVIDIA A10G", (8, 6), 125.0, 24),
}


@dataclass(frozen=True)
class InstanceType:
    """A node type: what one node brings to the gang."""

    gpu: str
    """Key of :data:`ACCELERATORS`."""
    gpus: int
    efa: int
    """EFA interfaces the instance can attach (the maximum, one per network card that supports EFA)."""
    vcpus: int = 0
    memory_gib: int = 0
    """Instance memory (host RAM), GiB."""
    gpu_memory_gib: int = 0
    """Memory of one GPU, GiB (p4d's A100s have 40, p4de's 80)."""
    hyperpod: bool = False
    rdma: bool = False
    """GPUDirect RDMA over EFA (p4d and later p types; g types' EFA moves GPU data through host memory)."""
    hugepages_2mi: str = ""
    """`hugepages-2Mi` each pod requests with EFA: libfabric's EFA provider takes its buffers from the
    node's 2 MiB huge pages, which the EFA installer reserves. 5120Mi is the amount AWS's EKS EFA guide
    (docs.aws.amazon.com/eks/latest/userguide/node-efa.html) puts in the pod's limits; empty: none."""


# EC2 accelerated-computing instance types with NVIDIA GPUs that EKS and SageMaker HyperPod run, from the EC2
# documentation: "Amazon EC2 instance type specifications > Accelerated computing" (GPUs, GPU memory, vCPUs,
# memory) and the network-cards table of "Elastic network interfaces" with "Supported instance types" of the
# EFA user guide (EFA interfaces: one per EFA-capable network card). A test checks the table's invariants.
def _sizes(gpu: str, gpu_mem: int, mem_per_vcpu: int, efa: dict[str, int], gpus: dict[str, int]) -> dict[str, InstanceType]:
    """The g-family sizes: ``xlarge`` = 4 vCPUs, each size doubling (12x/24x/48x: 48/96/192 vCPUs)."""
    vcpus = {"xlarge": 4, "2xlarge": 8, "4xlarge": 16, "8xlarge": 32, "16xlarge": 64, "12xlarge": 48,
             "24xlarge": 96, "48xlarge": 192}
    return {size: InstanceType(gpu, gpus.get(size, 1), efa.get(size, 0), vcpus=v, memory_gib=v * mem_per_vcpu,
                               gpu_memory_gib=gpu_mem) for size, v in vcpus.items()}


_EFA_HUGEPAGES = "5120Mi"
_G_GPUS = {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}
_G_EFA = {"8xlarge": 1, "12xlarge": 1, "16xlarge": 1, "24xlarge": 1, "48xlarge": 1}
_EC2: dict[str, InstanceType] = {
    "p4d.24xlarge": InstanceType("A100", 8, 4, vcpus=96, memory_gib=1152, gpu_memory_gib=40,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    "p4de.24xlarge": InstanceType("A100", 8, 4, vcpus=96, memory_gib=1152, gpu_memory_gib=80,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    "p5.48xlarge": InstanceType("H100", 8, 32, vcpus=192, memory_gib=2048, gpu_memory_gib=80,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    "p5e.48xlarge": InstanceType("H200", 8, 32, vcpus=192, memory_gib=2048, gpu_memory_gib=141,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    "p5en.48xlarge": InstanceType("H200", 8, 16, vcpus=192, memory_gib=2048, gpu_memory_gib=141,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    "p6-b200.48xlarge": InstanceType("B200", 8, 8, vcpus=192, memory_gib=2048, gpu_memory_gib=179,
        rdma=True, hugepages_2mi=_EFA_HUGEPAGES),
    **{f"g5.{k}": v for k, v in _sizes("A10G", 24, 4, _G_EFA, _G_GPUS).items()},
    **{f"g6.{k}": v for k, v in _sizes("L4", 24, 4, _G_EFA, _G_GPUS).items()},
    **{f"g6e.{k}": v for k, v in _sizes("L40S", 48, 8, {**_G_EFA, "24xlarge": 2, "48xlarge": 4}, _G_GPUS).items()},
}
# SageMaker HyperPod names the same hardware with an "ml." prefix.
INSTANCE_TYPES: dict[str, InstanceType] = {
    **_EC2,
    **{f"ml.{k}": replace(v, hyperpod=True) for k, v in _EC2.items()},
}

# ------------------------------------------------------------------ CPU and memory of a trainer pod
CPU_SHARE = 0.9
"""Share of the node's vCPUs a pod that takes all of its GPUs requests; the rest is left to the kubelet's
reservation and the daemon sets every GPU node runs (device plugins, CNI, CSI, log and metrics agents)."""
MEMORY_SHARE = 0.85
"""Share of the node's memory such a pod requests (and is limited to): node allocatable is already a few GiB
below the instance's memory (kube-reserved, eviction threshold), and the daemon sets need some."""
FALLBACK_CPU_PER_PROCESS = 1
FALLBACK_MEMORY_GIB_PER_PROCESS = 2
"""Without a catalog instance type: a floor per training process, so the pod is not BestEffort."""


@dataclass(frozen=True)
class PodResources:
    """CPU and memory of one trainer pod: the spec's values, else derived from the instance type."""

    cpu: str
    memory: str
    cpu_limit: str | None
    memory_limit: str | None
    source: str
    """Where they come from, for messages: ``spec``, ``instance type p5.48xlarge`` or ``fallback``."""


def pod_resources(instance_type: str | None, gpus_per_node: int, processes: int, cpu: str | None = None,
                  memory: str | None = None) -> PodResources:
    """Requests and limits of a trainer pod.

    ``resources.cpu``/``memory`` in the spec are request and limit. Otherwise a catalog instance type gives
    ``CPU_SHARE`` of its vCPUs and ``MEMORY_SHARE`` of its memory, scaled by the pod's share of its GPUs: a CPU
    request with no CPU limit (a CFS quota would throttle the data loader and NCCL's proxy threads in bursts),
    memory request = limit (an OOM then kills the pod, not a node daemon). Without one: the fallback floor,
    requests only.
    """
    it = INSTANCE_TYPES.get(instance_type or "")
    if it is not None and it.vcpus:
        share = min(1.0, max(gpus_per_node, 1) / it.gpus)
        d_cpu = str(max(1, int(it.vcpus * share * CPU_SHARE)))
        d_mem = f"{max(1, int(it.memory_gib * share * MEMORY_SHARE))}Gi"
        source, d_mem_limit = f"instance type {instance_type}", d_mem
    else:
        d_cpu = str(FALLBACK_CPU_PER_PROCESS * processes)
        d_mem = f"{FALLBACK_MEMORY_GIB_PER_PROCESS * processes}Gi"
        source, d_mem_limit = "fallback", None
    if cpu is not None and memory is not None:
        source = "spec"
    return PodResources(cpu=cpu or d_cpu, memory=memory or d_mem, cpu_limit=cpu,
                        memory_limit=memory or d_mem_limit, source=source)


def unknown_instance_type_warning(instance_type: str | None, gpus_per_node: int, efa_per_node: int | None,
                                  gpu_product: str | None, processes: int, cpu: str | None = None,
                                  memory: str | None = None) -> str | None:
    """The warning for an instance type the catalog does not know, saying what is assumed instead; else None."""
    if not instance_type or instance_type in INSTANCE_TYPES:
        return None
    res = pod_resources(None, gpus_per_node, processes, cpu, memory)
    gpu = (f"GPU model {gpu_product} (spec.resources.gpuProduct)" if gpu_product else
           "an unknown GPU model (no FP8 hardware check, no MFU; set spec.resources.gpuProduct)")
    efa = (f"{efa_per_node} EFA interfaces (spec.resources.efaPerNode)" if efa_per_node is not None else
           "no EFA interfaces (set spec.resources.efaPerNode)")
    mem = (f"cpu {res.cpu} and memory {res.memory} per pod from the spec" if res.source == "spec" else
           f"requests of cpu {res.cpu} and memory {res.memory} per pod (1 CPU and 2Gi per process, no limit; set "
           "spec.resources.cpu and memory)")
    return (f"instance type {instance_type} is not in kubetitan's catalog (operator/core/kubetitan_core/catalog.py); "
            f"assuming {gpus_per_node} GPUs per node (spec.resources.gpusPerNode, not checked), {efa}, {gpu}, "
            f"and {mem}")


def product_of(device_name: str | None) -> str | None:
    """The :data:`ACCELERATORS` key a CUDA device name (``NVIDIA H100 80GB HBM3``) names, or None; longest keys
    first, so that ``NVIDIA L40S`` is never taken for an ``L4`` nor an ``H200`` for an ``H20``."""
    if device_name:
        for key in sorted(ACCELERATORS, key=len, reverse=True):
            if key in device_name:
                return key
    return None


def expected_product(instance_type: str | None, gpu_product: str | None) -> str | None:
    """The :data:`ACCELERATORS` key the spec names: ``gpuProduct``, else the catalog instance type's GPU."""
    if gpu_product:
        return gpu_product if gpu_product in ACCELERATORS else None
    if instance_type and instance_type in INSTANCE_TYPES:
        return INSTANCE_TYPES[instance_type].gpu
    return None


def accelerator_for(instance_type: str | None, gpu_product: str | None) -> Accelerator | None:
    """The accelerator of a node: the explicit GPU product wins over the instance type."""
    key = expected_product(instance_type, gpu_product)
    return ACCELERATORS[key] if key else None
