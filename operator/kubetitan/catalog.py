"""Facts the validator, the planner and the trainer share: model flavours and accelerators.

Pure data, no I/O. The model dimensions are torchtitan 0.2.2's Llama 3 flavours
(``torchtitan/models/llama3/__init__.py``); a test checks them against the installed
torchtitan so that the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    "H100": Accelerator("NVIDIA H100 80GB HBM3", (9, 0), 989.4, 80),
    "H200": Accelerator("NVIDIA H200", (9, 0), 989.4, 141),
    "A100": Accelerator("NVIDIA A100-SXM4-80GB", (8, 0), 312.0, 80),
    "L40S": Accelerator("NVIDIA L40S", (8, 9), 362.1, 48),
    "A10G": Accelerator("NVIDIA A10G", (8, 6), 125.0, 24),
}


@dataclass(frozen=True)
class InstanceType:
    """A node type: what one node brings to the gang."""

    gpu: str
    gpus: int
    efa: int
    hyperpod: bool = False
    hugepages_2mi: str = ""
    """`hugepages-2Mi` each pod requests with EFA: libfabric's EFA provider takes its buffers from the
    node's 2 MiB huge pages, which the EFA installer reserves. 5120Mi is the amount AWS's EKS EFA guide
    (docs.aws.amazon.com/eks/latest/userguide/node-efa.html) puts in the pod's limits; empty: none."""


_EFA_HUGEPAGES = "5120Mi"
_EC2 = {
    "p5.48xlarge": InstanceType("H100", 8, 32, hugepages_2mi=_EFA_HUGEPAGES),
    "p5e.48xlarge": InstanceType("H200", 8, 32, hugepages_2mi=_EFA_HUGEPAGES),
    "p5en.48xlarge": InstanceType("H200", 8, 16, hugepages_2mi=_EFA_HUGEPAGES),
    "p4d.24xlarge": InstanceType("A100", 8, 4, hugepages_2mi=_EFA_HUGEPAGES),
    "p4de.24xlarge": InstanceType("A100", 8, 4, hugepages_2mi=_EFA_HUGEPAGES),
    "g6e.48xlarge": InstanceType("L40S", 8, 0),
    "g5.48xlarge": InstanceType("A10G", 8, 0),
}
# SageMaker HyperPod names the same hardware with an "ml." prefix.
INSTANCE_TYPES: dict[str, InstanceType] = {
    **_EC2,
    **{f"ml.{k}": InstanceType(v.gpu, v.gpus, v.efa, hyperpod=True, hugepages_2mi=v.hugepages_2mi) for k, v in _EC2.items()},
}


def accelerator_for(instance_type: str | None, gpu_product: str | None) -> Accelerator | None:
    """The accelerator of a node: the explicit GPU product wins over the instance type."""
    if gpu_product:
        return ACCELERATORS.get(gpu_product)
    if instance_type and instance_type in INSTANCE_TYPES:
        return ACCELERATORS[INSTANCE_TYPES[instance_type].gpu]
    return None
