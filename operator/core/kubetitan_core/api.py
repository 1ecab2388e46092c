"""The ``LlamaPretrain`` API: typed spec and status, with their defaults.

This module is the single source of truth for the resource. Every field is documented
once, by the docstring under it; the CRD (``kubectl explain``), the API reference in
``docs/api.md`` and the defaults the operator applies are all generated from here.

Python names are snake_case; the wire format (YAML, the CRD) is camelCase, derived by
the alias generator. Defaults live on the fields, and nowhere else: ``LlamaPretrain``
parsed from a user's YAML *is* the defaulted object.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from kubetitan_core import API_VERSION, KIND
from kubetitan_core.contract import is_s3_uri
from kubetitan_core.causes import RESIZE_CAUSES, RESTART_CAUSES  # noqa: F401 - RESIZE_CAUSES re-exported
from kubetitan_core.weights import WeightSchedule, percent_step


# The closed choices the trainer's TOML table (kubetitan_core.contract.trainer_toml) and the launcher's arguments
# (kubetitan_core.contract.launcher) carry too: defined here once, imported there.
DataSource = Literal["synthetic", "huggingface", "shards", "mixture"]
DataOrder = Literal["shuffled", "sequential"]
ShardsDtype = Literal["auto", "uint16", "uint32"]
TokenizerSource = Literal["builtin", "path", "huggingface"]
Platform = Literal["generic", "eks", "hyperpod"]
NetworkFallback = Literal["Fail", "AllowSockets"]
AttentionMask = Literal["causal", "document"]
"""Which tokens a token attends to: every earlier one in its sample (``causal``) or only those of its own document
(``document``: block-causal at the document boundaries the shards store)."""
TierRead = Literal["pread", "map"]
"""How a restore-tier load reads the tier's files (``[kubetitan.runtime] restore_tier_read``)."""
StagingWrite = Literal["pwrite", "map"]
"""How the checkpoint stager writes its arena (``[kubetitan.runtime] staging_write``)."""
HangTimeoutPolicy = Literal["Auto", "Fixed"]


class _Base(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
        # No coercion: "1000" or `yes` is not an integer, .inf/.nan are not numbers (the API server agrees).
        strict=True,
        allow_inf_nan=False,
    )

    def dump(self) -> dict[str, Any]:
        """The camelCase wire form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- model
class CustomModelSpec(_Base):
    """Dimensions of a custom Llama 3 architecture (``model.flavor: custom``)."""

    dim: int = Field(ge=64, le=65536)
    """Hidden size of the transformer (torchtitan ``dim``). Must be divisible by ``nHeads``."""
    n_layers: int = Field(ge=1, le=1024)
    """Number of transformer blocks."""
    n_heads: int = Field(ge=1, le=1024)
    """Number of attention (query) heads."""
    n_kv_heads: int | None = Field(default=None, ge=1, le=1024)
    """Number of key/value heads for grouped-query attention. Defaults to ``nHeads`` (no GQA)."""
    ffn_dim_multiplier: float | None = Field(default=None, gt=0, le=16)
    """Multiplier on the feed-forward hidden size, as in Llama 3 (e.g. 1.3 for 8B). Unset means 1."""
    multiple_of: int = Field(default=256, ge=1, le=65536)
    """The feed-forward hidden size is rounded up to a multiple of this."""
    rope_theta: float = Field(default=500000.0, gt=0)
    """Base frequency of the rotary position embedding."""
    vocab_size: int = Field(default=128256, ge=2, le=1_048_576)
    """Vocabulary size; must be at least the tokenizer's (128256 for the Llama 3 tokenizer)."""


class ModelSpec(_Base):
    """Which Llama 3 architecture to pre-train."""

    flavor: Literal["debug", "1B", "3B", "8B", "70B", "405B", "custom"] = "8B"
    """Model size. `debug` is torchtitan's tiny debug model (runs on CPU); `1B`..`405B` are
    torchtitan 0.2.2's Llama 3 flavours; `custom` takes its dimensions from `model.custom`."""
    custom: CustomModelSpec | None = None
    """Dimensions of the model when `flavor` is `custom`; must be unset otherwise."""


# ------------------------------------------------------------------------ training
class TrainingSpec(_Base):
    """Optimisation: steps, batch, learning-rate schedule."""

    steps: int = Field(default=1000, ge=1, le=1_000_000_000)
    """Total number of optimizer steps. Mutable while running: the trainer gets the new total with the
    next attempt. Raised: an attempt that finishes its old total is followed by one that resumes from
    its final checkpoint. Lowered: the run succeeds at the first checkpoint at or past the new total
    (its pods are stopped)."""
    seq_len: int = Field(default=8192, ge=16, le=1_048_576)
    """Tokens per sequence."""
    local_batch_size: int = Field(default=1, ge=1, le=65536)
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per optimizer step over all data-parallel ranks. Unset means
    `localBatchSize` x data-parallel degree (no gradient accumulation); a multiple of that
    turns on gradient accumulation."""
    learning_rate: float = Field(default=3.0e-4, gt=0, le=1)
    """Peak learning rate of AdamW."""
    warmup_steps: int = Field(default=200, ge=0)
    """Steps of linear learning-rate warm-up from zero to `learningRate`."""
    decay_ratio: float | None = Field(default=None, ge=0, le=1)
    """Fraction of the steps spent decaying the learning rate at the end (warmup-stable-decay).
    Unset means decay over every step after the warm-up."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the learning-rate decay."""
    min_lr_factor: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of `learningRate`."""
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    """AdamW weight decay."""
    max_norm: float = Field(default=1.0, gt=0, le=1000)
    """Gradient clipping: maximum global L2 norm of the gradients."""
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    """Random seed for model initialisation and data order. Unset means torchtitan's default."""


# --------------------------------------------------------------------- parallelism
class ParallelismSpec(_Base):
    """How the model and the batch are split over the GPUs. The product of the degrees must
    equal the number of training processes (`resources.nodes` x processes per node)."""

    data_parallel_shard_degree: int = Field(default=-1, ge=-1, le=1_000_000)
    """FSDP2 sharding degree. -1 means every process not used by the other degrees."""
    data_parallel_replicate_degree: int = Field(default=1, ge=1, le=1_000_000)
    """Replicated data-parallel degree (HSDP when combined with sharding)."""
    tensor_parallel_degree: int = Field(default=1, ge=1, le=1024)
    """Tensor-parallel degree; must divide the number of attention heads."""
    pipeline_parallel_degree: int = Field(default=1, ge=1, le=1024)
    """Pipeline-parallel degree; must divide the number of layers."""
    context_parallel_degree: int = Field(default=1, ge=1, le=1024)
    """Context-parallel degree; `training.seqLen` must be divisible by twice this."""


# ----------------------------------------------------------------------- precision
class Float8Spec(_Base):
    """FP8 linear layers through torchao (torchtitan's `quantize.linear.float8` converter)."""

    enabled: bool = False
    """Train the linear layers in FP8. Needs GPUs of compute capability 8.9 or newer
    (H100, H200, L40S), or `emulate` on CPU."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling recipe. `tensorwise`: one scale per tensor, fastest, supports FP8 all-gather.
    `rowwise`: one scale per row, more accurate, no FP8 all-gather."""
    fsdp_float8_all_gather: bool = False
    """All-gather FSDP-sharded weights in FP8 instead of bf16 (halves all-gather traffic).
    Needs the `tensorwise` recipe and a data-parallel shard degree above 1."""
    precompute_dynamic_scale: bool = False
    """Compute the FP8 scales of all sharded weights in one fused all-reduce after each
    optimizer step. Needs `fsdpFloat8AllGather`."""
    emulate: bool = False
    """Emulate FP8 in higher precision (torchao's emulation mode), for CPU tests and debugging only."""
    filter_fqns: list[str] = Field(default_factory=lambda: ["output"])
    """Module names (fully-qualified-name fragments) kept out of FP8; the output projection by default."""

    def filters_output(self) -> bool:
        """Whether ``filter_fqns`` keeps the output projection (the module ``output``) out of FP8: torchtitan skips
        a module whose name contains one of the fragments."""
        return any(fragment in "output" for fragment in self.filter_fqns)


class PrecisionSpec(_Base):
    """Numerics and the compiler: mixed precision, FP8, torch.compile, activation checkpointing."""

    compile: bool = True
    """Compile the model with torch.compile (per transformer block)."""
    float8: Float8Spec = Field(default_factory=Float8Spec)
    """FP8 training settings."""
    activation_checkpointing: Literal["none", "selective", "full"] = "selective"
    """Recompute activations in the backward pass to save memory: `none`, `selective`
    (per op, the seeds' recipe) or `full` (every block)."""
    selective_activation_checkpointing: str = Field(default="op", pattern=r"^(op|[1-9][0-9]*)$")
    """With `selective`: `op` to save the outputs of expensive ops only, or an integer N to
    checkpoint every N-th block."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the parameters during the forward and backward pass under FSDP."""
    loss_chunks: int = Field(default=0, ge=0, le=64)
    """Compute the output projection and the cross entropy in this many chunks of the batch's tokens, each chunk's
    gradient in the forward pass, so the logits of the whole batch (2 bytes x tokens x vocabulary, and as much again
    for their gradient) never exist: the memory that frees buys a larger batch or less activation checkpointing.
    Same FLOPs; the projection then runs in bf16 and is kept out of FP8 even when `float8.filterFqns` would put it
    there, so it pays only where the freed memory buys more than the FP8 projection: on one H100 at batch 2 and seq
    8192 it fit without activation checkpointing but ran 1.6% slower than the FP8 projection with every 7th block
    checkpointed (docs/benchmarks.md). 0 or 1: off (torchtitan's loss). Not with tensor or pipeline parallelism."""


# ---------------------------------------------------------------------------- data
class VolumeClaim(_Base):
    """A PersistentVolumeClaim mounted into every training pod."""

    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim in the LlamaPretrain's namespace."""
    read_only: bool = False
    """Mount the claim read-only."""


class HuggingFaceDataSpec(_Base):
    """A Hugging Face text dataset, read the way torchtitan reads c4."""

    dataset: str = Field(default="allenai/c4", min_length=1)
    """Dataset repository on the Hugging Face hub, a local path inside the image or a volume, or
    `builtin` for the small text corpus shipped with the trainer (debug runs, offline tests)."""
    config: str | None = "en"
    """Dataset configuration (subset) name."""
    split: str = Field(default="train", min_length=1)
    """Split to read."""
    streaming: bool = True
    """Stream the dataset instead of downloading it whole first."""
    text_field: str = Field(default="text", min_length=1)
    """Column that holds the text."""


class S3CredentialsSecretRef(_Base):
    """A Secret in the LlamaPretrain's namespace holding static AWS credentials (instead of the pod's identity)."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Secret."""
    access_key_id_key: str = Field(default="AWS_ACCESS_KEY_ID", min_length=1)
    """Key of the access key id within the Secret."""
    secret_access_key_key: str = Field(default="AWS_SECRET_ACCESS_KEY", min_length=1)
    """Key of the secret access key within the Secret."""


class S3Access(_Base):
    """How the trainer reaches S3 (or an S3-compatible store) through the Amazon S3 Connector for PyTorch
    (docs/storage.md). Credentials come from the pod's identity (EKS Pod Identity or IRSA on
    `resources.serviceAccountName`) unless `credentialsSecretRef` is set."""

    region: str = Field(default="us-east-1", pattern=r"^[a-z]{2}(-[a-z]+)+-\d+$")
    """The bucket's AWS region, e.g. `us-west-2`."""
    endpoint: str | None = None
    """An S3-compatible endpoint (`https://...`); unset: AWS's regional endpoint (S3 Express One Zone
    directory buckets included)."""
    force_path_style: bool = False
    """Path-style addressing (`endpoint/bucket/key`), which most S3-compatible servers need."""
    credentials_secret_ref: S3CredentialsSecretRef | None = None
    """A Secret with static credentials, exposed to the trainer as `AWS_ACCESS_KEY_ID` and
    `AWS_SECRET_ACCESS_KEY`. Prefer the pod's identity (no long-lived keys). The variables hold for every S3
    request of the pod: set at most one Secret across `checkpoint.storage.s3` and `data.s3`."""


class ShardsDataSpec(_Base):
    """Pre-tokenized shards: flat token files written by `kubetitan prepare-data`."""

    path: str = Field(min_length=1)
    """Directory holding `*.bin` token shards (and their `index.json`) inside the pod, or `s3://bucket/prefix`
    holding a copy of one (`aws s3 sync` of the `prepare-data` output): it is copied to the node's local disk at
    start with every checksum verified, reached as `data.s3` says (docs/data.md)."""
    dtype: ShardsDtype = "auto"
    """Token dtype of the shards; `auto` reads it from `index.json`."""


class WeightPoint(_Base):
    """One point of a weight schedule: the weight a source has at a step. Set exactly one of `step` and `percent`."""

    step: int | None = Field(default=None, ge=0, le=1_000_000_000)
    """Training step of this point (0 is the start; at most `training.steps`)."""
    percent: float | None = Field(default=None, ge=0, le=100)
    """Where this point is as a percentage of `training.steps` (the nearest step, halves up), instead of `step`."""
    weight: float = Field(ge=0, le=1_000_000)
    """The source's weight at this point, relative to the other sources' weights at the same step (0: none of the
    samples of that step come from it)."""


class WeightScheduleSpec(_Base):
    """How a mixture source's weight changes over training: from `weight` at step 0 through `points` (docs/data.md,
    "Weight schedules"), e.g. a source annealed in over the last 10% of the steps."""

    interpolation: Literal["linear", "step"] = "linear"
    """`linear`: the weight changes step by step in a straight line from one point to the next (from `weight` at step
    0 to the first point); `step`: each point's weight holds from its step on. After the last point its weight
    holds."""
    points: list[WeightPoint] = Field(min_length=1, max_length=64)
    """The points, in increasing step order."""


class MixtureSourceSpec(_Base):
    """One dataset of a weighted mixture, `shards` or `huggingface` (exactly one), and its share of the samples."""

    shards: ShardsDataSpec | None = None
    """Pre-tokenized shards (written by `kubetitan prepare-data`): shuffled globally, resumable at any number of
    GPUs."""
    huggingface: HuggingFaceDataSpec | None = None
    """A Hugging Face text dataset streamed and tokenized on the fly, each data-parallel rank reading its own part
    of it in the dataset's order. A run with one cannot resume at another data-parallel degree (a stream has one
    position per rank): prepare it into shards with `kubetitan prepare-data` for that."""
    weight: float = Field(ge=0, le=1_000_000)
    """Share of the training samples (and so of the tokens) drawn from this source, relative to the other
    sources' weights: 3 and 1 mean 75% and 25%. Realised exactly: after any n samples each source has had
    its share of n, give or take less than one sample. With `schedule`, its weight at step 0 (0 allowed: a source
    scheduled in later)."""
    schedule: WeightScheduleSpec | None = None
    """The weight as a function of the step (annealing); unset: `weight` throughout. Resumable at any number of GPUs
    like the rest of the sample stream."""
    name: str | None = Field(default=None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    """Name of the source in metrics (the `source` label of `kubetitan_trainer_data_tokens_total`); unset means
    the shards directory's name, or the dataset's name after its last `/`."""


class EvalSpec(_Base):
    """Held-out evaluation: the loss on samples never trained on, every `intervalSteps` steps."""

    interval_steps: int = Field(default=100, ge=1, le=1_000_000_000)
    """Steps between two evaluations (also at step 1)."""
    samples: int = Field(default=256, ge=1, le=10_000_000)
    """Held-out sequences evaluated each time, over all data-parallel ranks (rounded down to a multiple of
    `localBatchSize` x data-parallel degree); the same ones every time."""
    held_out_percent: float = Field(default=1.0, gt=0, le=50)
    """Without `shards`: the last this many percent of every training source's sequences are held out (never
    trained on) and evaluated."""
    shards: ShardsDataSpec | None = None
    """A separate held-out dataset (shards written by `kubetitan prepare-data`); unset means a split of the
    training data (`heldOutPercent`). Required with `data.source: huggingface` and with a mixture that has a
    `huggingface` source."""


class DataSpec(_Base):
    """Where the training tokens come from, in which order, and what is held out."""

    source: DataSource = "synthetic"
    """`synthetic`: random tokens (benchmarks); `huggingface`: a streamed text dataset
    tokenized on the fly; `shards`: pre-tokenized files on a volume; `mixture`: several sources (shards
    directories or streamed datasets) mixed by weight (`mixture`)."""
    huggingface: HuggingFaceDataSpec | None = None
    """Settings for `source: huggingface`; unset means c4 `en` `train`, streamed."""
    shards: ShardsDataSpec | None = None
    """Settings for `source: shards` (required there)."""
    mixture: list[MixtureSourceSpec] = Field(default_factory=list, max_length=64)
    """The sources of `source: mixture` (required there, and only there), each with its weight."""
    order: DataOrder = "shuffled"
    """Order of the sequences of `shards` sources (alone or in a mixture): `shuffled` (a permutation of all sequences
    per epoch, seeded by `training.seed`, the same for any number of GPUs) or `sequential` (corpus order).
    A streamed `huggingface` dataset is read in its own order."""
    eval: EvalSpec | None = None
    """Held-out evaluation (loss and perplexity in metrics, status and the dashboard); unset means none."""
    attention_mask: AttentionMask = "causal"
    """`causal`: each token attends to every earlier token of its sequence, across the documents packed into it;
    `document`: only to the earlier tokens of its own document (block-causal attention at the document boundaries the
    shards' `.idx` files store, through torchtitan's flex attention; docs/data.md, "Document masking"). `document`
    needs shards sources (`shards`, or a mixture of shards) and no context parallelism."""
    ledger: bool = False
    """Audits: every rank appends the global samples it trains (step, position, source, window, epoch) to
    `<checkpoint.mountPath>/kubetitan/ledger/rank-<r>-of-<W>.txt` (docs/data.md, "The sample ledger"); a line per
    sample. `kubetitan run --ledger` turns it on for a local run."""
    volume: VolumeClaim | None = None
    """A claim mounted at `mountPath` that holds data (shards or a dataset copy)."""
    mount_path: str = Field(default="/data", pattern=r"^/")
    """Where `volume` is mounted."""
    s3: S3Access | None = None
    """How the `s3://` shards paths (`shards.path`, `mixture[].shards.path`, `eval.shards.path`) are reached:
    region, endpoint, path-style addressing, credentials. Unset: AWS's endpoint in us-east-1 with the pod's
    identity. The shards are staged to an emptyDir on the node (docs/storage.md: disk needed, request costs)."""


class SecretKeyRef(_Base):
    """A key in a Secret in the LlamaPretrain's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Secret."""
    key: str = Field(default="token", min_length=1)
    """Key within the Secret."""


class TokenizerSpec(_Base):
    """The tokenizer. Tokens and secrets are never written into the resource itself."""

    source: TokenizerSource = "builtin"
    """`builtin`: the small byte-level tokenizer shipped with the trainer (debug runs);
    `path`: a directory with `tokenizer.json` inside the image or a volume;
    `huggingface`: downloaded from the hub at start (Llama 3 needs a token)."""
    path: str | None = Field(default=None, pattern=r"^/")
    """Directory holding `tokenizer.json` (and `tokenizer_config.json`), for `source: path`."""
    repo: str | None = None
    """Hub repository to download the tokenizer from, for `source: huggingface`,
    e.g. `meta-llama/Meta-Llama-3.1-8B`."""
    token_secret_ref: SecretKeyRef | None = None
    """Secret key holding a Hugging Face access token; exposed to the trainer as `HF_TOKEN`."""


# ---------------------------------------------------------------------- checkpoint
class S3CheckpointStorage(S3Access):
    """Checkpoints in S3 (or an S3-compatible store) through the Amazon S3 Connector for PyTorch
    (docs/storage.md). Credentials come from the pod's identity (EKS Pod Identity or IRSA on
    `resources.serviceAccountName`) unless `credentialsSecretRef` is set."""

    uri: str = Field(min_length=6, max_length=1024)
    """`s3://bucket/prefix`: each save is written under `<prefix>/step-N/`; use one prefix per run."""


class CheckpointStorage(_Base):
    """Where checkpoints live. Set exactly one of the fields (docs/storage.md compares them)."""

    persistent_volume_claim: VolumeClaim | None = None
    """A shared ReadWriteMany claim (e.g. FSx for Lustre, EFS) mounted at `checkpoint.mountPath`."""
    host_path: str | None = Field(default=None, pattern=r"^/")
    """A directory on the node (single-node clusters and local runs only: lost with the node)."""
    s3: S3CheckpointStorage | None = None
    """An S3 bucket and prefix; `checkpoint.mountPath` then holds the pod's local scratch (compile cache,
    step log, tokenizer), an emptyDir."""


class CheckpointSpec(_Base):
    """Distributed checkpoints (torch.distributed.checkpoint, via torchtitan)."""

    enabled: bool = True
    """Save checkpoints. Restarts need them: with checkpoints off, `runPolicy.maxRestarts` must be 0."""
    storage: CheckpointStorage = Field(default_factory=CheckpointStorage)
    """Where checkpoints are written; required for runs on a cluster when enabled."""
    mount_path: str = Field(default="/checkpoints", pattern=r"^/")
    """Directory inside the pod where checkpoint storage is mounted (the torchtitan dump folder; with `storage.s3`,
    the pod's local scratch)."""
    interval_steps: int = Field(default=500, ge=1)
    """Save a checkpoint every this many steps (and at the last step)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
    """torchtitan's `checkpoint.async_mode`: `disabled` blocks training for the whole save;
    `async` stalls only for the device-to-host copy; `async_with_pinned_mem` also overlaps that."""
    keep_latest_k: int = Field(default=3, ge=0, le=1000)
    """Keep only the newest K checkpoints (0 keeps all). Must be 0 or at least 2 so that a
    partial newest checkpoint never leaves nothing to resume from."""
    save_timeout_seconds: int = Field(default=300, ge=10, le=86400)
    """Time a pod gets to save a checkpoint after SIGTERM (suspend, preemption) before it
    is killed; becomes the pod's `terminationGracePeriodSeconds`."""
    max_failed_saves: int = Field(default=3, ge=1, le=100)
    """Checkpoint saves in a row that may fail with a storage error (the store unreachable, a write refused, a
    volume's I/O error) while training goes on: each failure is one log line and the run's `CheckpointSaveFailing`
    condition (one Warning Event when it turns True), and the next interval saves again; the save that makes this
    many in a row ends the attempt with exit code 6 (retryable, counted against
    `runPolicy.maxRestarts`), which resumes from the newest complete checkpoint. The last step's save is tried this
    many times before that. Any storage: S3, a claim or a hostPath."""


# ----------------------------------------------------------------------- resources
class ResourcesSpec(_Base):
    """The nodes of the gang and what each pod gets."""

    nodes: int = Field(default=1, ge=1, le=4096)
    """Number of nodes, one pod per node."""
    gpus_per_node: int = Field(default=8, ge=0, le=16)
    """GPUs each pod requests (`nvidia.com/gpu`). 0 runs on CPU (debug model only)."""
    processes_per_node: int | None = Field(default=None, ge=1, le=64)
    """Training processes per pod (torchrun `--nproc-per-node`). Unset means one per GPU,
    or 1 on CPU."""
    platform: Platform = "generic"
    """Cluster flavour. `eks` adds EFA settings; `hyperpod` also requires nodes whose
    SageMaker HyperPod health label says they are schedulable."""
    instance_type: str | None = None
    """Node instance type, e.g. `p5.48xlarge` (EKS) or `ml.p5.48xlarge` (HyperPod).
    Becomes a node selector and tells the validator the GPU model."""
    gpu_product: Literal["H100", "H200", "B200", "A100", "L40S", "L4", "A10G"] | None = None
    """GPU model, when `instanceType` does not say it. Used for FP8 checks and MFU."""
    image: str = Field(default="kubetitan/trainer:0.1.0", min_length=1)
    """Trainer container image (see `images/trainer.Dockerfile`)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of the trainer container."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets used to pull the image."""
    efa_per_node: int | None = Field(default=None, ge=0, le=64)
    """EFA interfaces per pod (`vpc.amazonaws.com/efa`). Unset means all of the instance
    type's interfaces on `eks`/`hyperpod`, none elsewhere."""
    network_fallback: NetworkFallback = "Fail"
    """What the trainer does when EFA was requested on `eks`/`hyperpod` but NCCL is not on it after
    the first step (no aws-ofi-nccl plugin in the image, or not its `efa` provider): `Fail` ends the
    run with exit code 5; `AllowSockets` logs a warning and trains over TCP sockets (a fraction of
    EFA's bandwidth)."""
    shm_size: str = Field(default="64Gi", pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$")
    """Size of the memory-backed `/dev/shm` (data loader workers and NCCL need it)."""
    cpu: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+|m)?$")
    """CPU request and limit per pod (e.g. `180`). Unset: 90% of the instance type's vCPUs (scaled by the
    pod's share of its GPUs) as a request with no limit, or 1 per process without a catalog instance type."""
    memory: str | None = Field(default=None, pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$")
    """Memory request and limit per pod (e.g. `1800Gi`). Unset: 85% of the instance type's memory (scaled by
    the pod's share of its GPUs) as request and limit, or a 2Gi-per-process request without a catalog instance
    type."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node labels the pods must match."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Extra tolerations (core/v1 Toleration). A toleration for `nvidia.com/gpu` is always added
    when GPUs are requested."""
    affinity: dict[str, Any] | None = None
    """Pod affinity (core/v1 Affinity), merged with the operator's own node rules."""
    env: list[dict[str, Any]] = Field(default_factory=list)
    """Extra environment variables (core/v1 EnvVar) for the trainer container."""
    service_account_name: str | None = None
    """Service account of the training pods. Its API token is never mounted."""
    priority_class_name: str | None = None
    """PriorityClass of the training pods."""


# ---------------------------------------------------------------------- run policy
class ElasticSpec(_Base):
    """Elastic training: run on fewer nodes when a node is lost and no replacement comes, grow back at a
    checkpoint when capacity returns. The global batch (`training.globalBatchSize`, or `localBatchSize` x the
    data-parallel degree at `resources.nodes` when unset) stays the same at every size through gradient
    accumulation, so the loss curve and the learning-rate schedule (in steps) are unchanged; a smaller gang trains
    each step more slowly. Every size from `minNodes` to `maxNodes` must be a valid layout (the validator names the
    sizes that are not). Needs data that resumes at another data-parallel degree (synthetic, shards, mixture of
    shards: not a streamed Hugging Face dataset) and `parallelism.dataParallelShardDegree: -1`."""

    min_nodes: int = Field(ge=1, le=4096)
    """The fewest nodes the run trains on: it never shrinks below this; with fewer schedulable nodes it waits
    (`Unschedulable`) like a run that is not elastic."""
    max_nodes: int | None = Field(default=None, ge=1, le=4096)
    """The most nodes the run grows to when capacity allows. Defaults to `resources.nodes` (the size the run starts
    at)."""
    shrink_after_seconds: int = Field(default=300, ge=0, le=86400)
    """How long the run waits for a replacement after it lost a node (or while pods of the gang cannot be
    scheduled) before it restarts at the largest size the schedulable nodes fit (at least `minNodes`)."""
    grow_check_seconds: int = Field(default=600, ge=0, le=86400)
    """How long enough nodes must have been Ready and schedulable for the pods (node selector, tolerations, nodes
    the run avoids) before a shrunk run plans to grow: it grows right after its next complete checkpoint (save,
    then re-create the gang larger)."""
    max_resizes: int = Field(default=10, ge=0, le=10000)
    """Resizes (shrinks and grows) allowed in the run: their own budget, apart from `maxRestarts`. Once used up the
    run keeps its size (and waits for nodes like a run that is not elastic)."""


class RunPolicySpec(_Base):
    """What the operator does when things go wrong, and when the run ends."""

    suspend: bool = False
    """Stop the gang gracefully (each trainer saves a checkpoint on SIGTERM) and keep the run.
    Setting it back to false continues from that checkpoint."""
    max_restarts: int = Field(default=10, ge=0, le=10000)
    """Gang restarts allowed before the run is marked Failed. 0 disables restarts."""
    max_restarts_without_progress: int = Field(default=3, ge=1, le=10000)
    """Consecutive restarts that made no step progress before the run is marked Failed."""
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    """Delay before the first restart; doubles with each consecutive restart."""
    max_backoff_seconds: int = Field(default=600, ge=0, le=86400)
    """Upper bound of the restart delay."""
    hang_timeout_seconds: int = Field(default=900, ge=10, le=86400)
    """A running attempt whose step has not advanced for this long is declared hung (with `hangTimeoutPolicy: Auto`,
    the upper bound of the automatic timeout). While in-place restarts are left, each pod's launcher watches its
    workers' steps and stops a hung one: every rank's workers restart in place (cause `Hang`); the operator
    re-creates the gang only if none did within 30 s more (a frozen launcher or pod). The launchers take this and
    `hangTimeoutPolicy` when their pods are created: a change reaches them with the next re-created attempt (the
    operator's own rule applies it at once)."""
    hang_timeout_policy: HangTimeoutPolicy = "Auto"
    """`Fixed`: the hang timeout is `hangTimeoutSeconds`. `Auto`: it is 10 x the median step time the trainer
    reports (at least 30 s, or the operator's `--hang-floor-seconds`; at most `hangTimeoutSeconds`) once 5 steps of the current workers are seen, and
    `hangTimeoutSeconds` before that; a checkpoint step adds `checkpoint.saveTimeoutSeconds` in both."""
    max_in_place_restarts: int = Field(default=3, ge=0, le=100)
    """In-place restarts per attempt: a worker process that dies on a healthy node restarts the workers of
    every rank in the same pods (no rescheduling, no image pull, warm imports), resuming from the newest
    checkpoint. A failure beyond this many in one attempt, or a node failing in place twice in a row,
    re-creates the gang instead. 0 turns in-place restarts off (every failure re-creates the gang). Each in-place
    restart counts towards `maxRestarts` too."""
    in_process_restarts: int = Field(default=0, ge=0, le=100)
    """Restarts inside the worker processes, tried before an in-place restart: after a fault that leaves the
    processes alive (an exception in a step, a non-finite loss, a collective error or timeout, a step standing still
    for `inProcessHangSeconds`) every rank tears its process group down, makes a new one and loads the newest saved
    state (the restore tier's first) into the model and optimizer it already has, its compiled code kept: seconds,
    against a new process's imports and compile. A cause that needs a new process (a lost GPU, a full volume), a
    fault repeating at the same step, or more than this many per worker process fall back to the in-place and gang
    restarts. Needs `checkpoint.enabled`. 0 (the default): off."""
    in_process_hang_seconds: int | None = Field(default=None, ge=10, le=86400)
    """With `inProcessRestarts`: seconds a step may stand still before its rank reports a `Hang` and the gang
    restarts in its processes; on GPUs this is what ends a collective stuck on the device (NCCL's communicators are
    aborted). Not timed: the first step after a start or a restart (it compiles) and checkpoint saves. Unset: only
    the collective timeout (half of `hangTimeoutSeconds`, at least 60 s) detects a hung peer, and a hang on the GPU
    is left to the launcher's hang watchdog (a new process)."""
    startup_timeout_seconds: int = Field(default=1800, ge=10, le=86400)
    """Time from all pods running to the first step (image, compile, data) before the attempt
    counts as hung."""
    node_failure_grace_seconds: int = Field(default=60, ge=0, le=3600)
    """Pods on a NotReady or missing node are force-deleted after this long."""
    unschedulable_timeout_seconds: int = Field(default=900, ge=0, le=604800)
    """Time an attempt may wait for all its pods to be scheduled before the Unschedulable
    condition turns True."""
    unschedulable_action: Literal["Wait", "Fail"] = "Wait"
    """What to do once `unschedulableTimeoutSeconds` has passed: keep waiting (and say so)
    or fail the run."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Wall-clock limit of the whole run, counted from its start; then it fails with
    reason DeadlineExceeded."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the LlamaPretrain this long after it succeeded or failed. Unset keeps it."""
    cleanup_policy: Literal["None", "Running", "All"] = "Running"
    """Pods deleted when the run finishes: `None`, the still-`Running` ones, or `All`."""
    elastic: ElasticSpec | None = None
    """Shrink the gang when a node is lost and no replacement comes; grow it back at a checkpoint when capacity
    returns. Unset: the run always trains on `resources.nodes` nodes."""
    preflight: Literal["Enabled", "Disabled"] = "Enabled"
    """`Enabled`: before an attempt's first workers start, each pod's launcher checks its node in seconds: the GPU
    count (`resources.gpusPerNode`) and model (`resources.gpuProduct` or the instance type's), ECC and row-remapping
    state through NVML, a matrix product against its known result and its speed against the card's floor, an
    all-reduce across the pod's GPUs, and the EFA devices the pod requested. A failed check ends the pod with exit
    code 8 (cause `PreflightFailed`, its termination message naming the node and the check): the gang is re-created
    without that node. Its seconds are the `preflight` phase of the start-up (`status.training.startup`). On a CPU
    pod only the matrix product and a one-rank all-reduce run. `Disabled`: no gate. The launchers read it when their
    pods are created: a change reaches them with the next re-created attempt."""


class SchedulingSpec(_Base):
    """Gang scheduling integrations; all optional."""

    queue_name: str | None = None
    """Kueue LocalQueue; the pods of an attempt form one Kueue pod group (and get no Kubernetes PodGroup)."""
    scheduler_name: str | None = None
    """Scheduler for the pods, e.g. `volcano`; unset means the default scheduler. Another scheduler than
    `default-scheduler` keeps its own gang integration: the pods get no Kubernetes PodGroup."""
    pod_group: Literal["Auto", "Disabled"] = "Auto"
    """`Auto`: where the API server serves Kubernetes PodGroups (`scheduling.k8s.io/v1beta1`, Kubernetes 1.37+ with
    the `GenericWorkload` feature gate), each attempt gets a PodGroup `<name>-a<attempt>` whose gang policy's
    `minCount` is the attempt's node count, and every pod of the attempt names it (its `schedulingGroup`): the
    default scheduler binds all pods of the attempt or none. Not served, or with `queueName` or another
    `schedulerName`: no PodGroup. `Disabled`: never a PodGroup. Applies from the next attempt."""


class MonitoringSpec(_Base):
    """Metrics and logs."""

    metrics_port: int = Field(default=9090, ge=1024, le=65535)
    """Port of the trainer's Prometheus `/metrics` endpoint (served by each pod's local rank 0)."""
    log_frequency_steps: int = Field(default=10, ge=1)
    """Log and export metrics every this many steps."""
    tensorboard: bool = False
    """Write TensorBoard event files under the checkpoint mount (`tb/`)."""


class RuntimeSpec(_Base):
    """Tuning of the trainer's recovery and compile internals, rendered into `trainer.toml`'s `[kubetitan.runtime]`
    and read by every worker process as it starts. The defaults are the settings measured best
    (docs/reliability.md); change one to measure it on your hardware. A change reaches the pods with the next
    attempt."""

    restore_tier_read: TierRead = "pread"
    """How an in-place restart's load from the node-local restore tier reads its files: `pread` (straight into the
    loader threads' pinned buffers: no mapping, no page faults) or `map` (a read-only mapping, copied through pinned
    buffers)."""
    restore_tier_load_threads: int = Field(default=0, ge=0, le=256)
    """Threads that copy the restore tier into the training state; 0: automatic (`pread`: the pod's CPUs over its
    workers, 2 to 16; `map`: 1 when torch's own copies are parallel, else 4)."""
    defer_optimizer_load: bool = True
    """Load the optimizer's part of a restore-tier load in the background while the first step's forward and
    backward run (the step waits for it before the optimizer's update); false: all of it before the first step."""
    defer_threads: int = Field(default=4, ge=1, le=64)
    """Threads of the background part of a restore-tier load (more copy faster but slow the first step's compile,
    which shares the interpreter with them)."""
    defer_switch_interval_ms: int = Field(default=0, ge=0, le=1000)
    """Python's thread switch interval in milliseconds while the background part is copied; 0: Python's own
    (5 ms). Shorter hands the interpreter to the copy threads sooner."""
    staging_write: StagingWrite = "pwrite"
    """How the checkpoint stager writes its staged copy into the restore tier's files: `pwrite` (threads write them;
    the worker never maps them) or `map` (copies into a mapping of the files)."""
    staging_write_threads: int = Field(default=8, ge=1, le=64)
    """Threads that write the staged copy in the `pwrite` mode."""
    early_cuda_context: bool = False
    """Create each worker's CUDA context on a side thread as it starts, instead of on torch's first CUDA call
    (no gain measured yet)."""
    aot_compile: bool = False
    """Compile ahead of time: compiled transformer blocks get an artefact that a restarted worker loads instead of
    compiling (each rank makes its own for its device once per node, in the compile cache's folder), and the AOTAutograd
    cache may serve the recipe's graphs (their functions are marked cacheable, keyed by their packages' versions
    and sources), and reductions keep the block size they were compiled with (unless
    `TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK` is set), so a restarted worker does not benchmark them again. Off: the
    blocks compile as torch does. Needs `precision.compile`."""


class LlamaPretrainSpec(_Base):
    """Desired state of a Llama 3 pre-training run."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Model architecture."""
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Steps, batch and learning-rate schedule."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Parallel degrees."""
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    """FP8, compile and activation checkpointing."""
    data: DataSpec = Field(default_factory=DataSpec)
    """Training data."""
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    """Tokenizer."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Nodes, GPUs, image and pod settings."""
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    """Restarts, timeouts, suspension and clean-up."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Queueing and gang scheduling."""
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    """Metrics and TensorBoard."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Tuning of the trainer's recovery and compile internals."""


# -------------------------------------------------------------------------- status
Phase = Literal["Pending", "Starting", "Running", "Restarting", "Blocked", "Suspended", "Succeeded", "Failed"]

RestartCause = Literal[RESTART_CAUSES]  # type: ignore[valid-type]
"""``status.restarts[].cause``: the retried causes of :data:`kubetitan_core.causes.CAUSES`, in its order."""


class Condition(_Base):
    """A Kubernetes-style condition."""

    type: str
    """Condition type, e.g. `Ready`, `Running`, `Succeeded`, `Failed`, `Suspended`."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str
    """CamelCase reason for the last transition."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """When `status` last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The `metadata.generation` this condition was computed from."""


RestartMode = Literal["InPlace", "Recreate"]


class StartupPhases(_Base):
    """Where a start of the workers went, from the trainer's start-up anatomy (the
    `kubetitan_trainer_startup_phase_seconds` metric): from the launcher's start, or from its detection of the
    failure an in-place restart answers, to the end of the first trained step, in seconds per phase (they add up
    to `totalSeconds`). The first thing to read when a recovery is slow."""

    generation: int | None = None
    """Worker generation these workers are (0: the attempt's first; each in-place restart adds one)."""
    total_seconds: float | None = None
    """Sum of the phases: the start-up as the workers saw it."""
    process_start_seconds: float | None = None
    """Launcher start (or restart: stop, rendezvous, fork) until the worker's main() runs, less the launcher's wait
    for the pre-flight gate (`preflightSeconds`) and its warm imports (in `importsSeconds`)."""
    preflight_seconds: float | None = None
    """The launcher's wait for its pod's pre-flight gate (`runPolicy.preflight`) beyond its own warm imports, which
    the gate overlaps on a GPU pod; 0 for an in-place restart's workers (the gate runs once per attempt) and with the
    gate off."""
    imports_seconds: float | None = None
    """torch/torchtitan/trainer imports and the config check (about 0 for a warm, forked worker)."""
    process_group_init_seconds: float | None = None
    """The NCCL/gloo process group."""
    model_init_seconds: float | None = None
    """Model build, parallelisation, optimizer and data loader, until the checkpoint load."""
    checkpoint_load_seconds: float | None = None
    """The checkpoint load (DCP, or the node-local restore tier of an in-place restart)."""
    first_step_compile_seconds: float | None = None
    """torch.compile time inside the first step (a warm compile cache shrinks it)."""
    first_step_seconds: float | None = None
    """The rest of the first step."""


class RestartRecord(_Base):
    """One gang restart."""

    attempt: int
    """The attempt that ended (`Recreate`), or that restarted its workers in place (`InPlace`)."""
    mode: RestartMode = "Recreate"
    """`InPlace`: the launchers restarted every rank's workers in the same pods; `Recreate`: the operator
    deleted the gang and created the next attempt's pods."""
    generation: int | None = None
    """`InPlace` only: the worker generation the restart started (1 for the first in-place restart of the
    attempt)."""
    cause: RestartCause
    """Classified cause of the restart."""
    message: str = ""
    """What was observed (pod, exit code, node, reason)."""
    time: str
    """When the failure was detected (RFC 3339)."""
    node_name: str | None = None
    """Node the failure was attributed to, if any."""
    downtime_seconds: float | None = None
    """Time from failure detection (`time`) to the first step of the next attempt or worker generation."""
    resumed_from_step: int | None = None
    """Checkpoint step the next attempt (or worker generation) resumed from (0 = from scratch)."""
    lost_steps: int | None = None
    """Steps trained in the failed attempt (or generation) after its last checkpoint, i.e. work lost. In place: the
    launchers' own count (exact). Re-created: from the operator's last scrape of the failed attempt, so the steps
    rank 0 trained after that scrape are not counted (never more than the truth)."""
    startup: StartupPhases | None = None
    """The start-up of the workers that followed this restart, phase by phase (set once they trained a step)."""
    from_nodes: int | None = None
    """`Shrink`/`Grow`: the gang's size (nodes) before the resize."""
    to_nodes: int | None = None
    """`Shrink`/`Grow`: the gang's size (nodes) of the next attempt."""


class SourceLossStatus(_Base):
    """One data source of a mixture: its losses (nats per token)."""

    name: str
    """The source's name (`spec.data.mixture[].name`, else its directory's or dataset's)."""
    loss: float | None = None
    """Its training loss at the step of the status's training loss."""
    eval_loss: float | None = None
    """Its held-out loss at the newest evaluation."""


class TrainingStatus(_Base):
    """Training progress scraped from rank 0's metrics."""

    step: int | None = None
    """Last completed optimizer step."""
    total_steps: int | None = None
    """`spec.training.steps`."""
    progress: str | None = None
    """`step/totalSteps`, for the printer column."""
    loss: float | None = None
    """Training loss at `step`."""
    tokens_per_second: float | None = None
    """Training throughput over all GPUs, tokens per second."""
    tokens_per_second_per_gpu: float | None = None
    """Training throughput per GPU, tokens per second."""
    tflops_per_gpu: float | None = None
    """Achieved model TFLOP/s per GPU."""
    mfu: float | None = None
    """Model FLOPs utilisation, ratio 0-1 of the GPU's dense bf16 peak."""
    eval_loss: float | None = None
    """Loss on the held-out samples (`spec.data.eval`) at `evalStep`, nats per token."""
    eval_perplexity: float | None = None
    """Perplexity on the held-out samples at `evalStep` (exp of `evalLoss`)."""
    eval_step: int | None = None
    """Step of the newest held-out evaluation."""
    sources: list[SourceLossStatus] = Field(default_factory=list, max_length=64)
    """A mixture's losses by data source (training loss at `step`, held-out loss at `evalStep`), sorted by name."""
    last_checkpoint_step: int | None = None
    """Step of the newest complete checkpoint."""
    eta: str | None = None
    """Estimated completion time (RFC 3339) at the current throughput."""
    goodput: float | None = None
    """Productive step time over wall time since the run started, ratio 0-1."""
    startup: StartupPhases | None = None
    """The start-up of the running workers, phase by phase (rank 0's pod)."""
    last_update_time: str | None = None
    """When these numbers were last scraped."""


class AttemptObservation(_Base):
    """What the operator observed of the current attempt, kept so that a restarted or failed-over operator
    neither resets nor fires its timers (times are RFC 3339)."""

    attempt: int | None = None
    """The attempt these observations belong to."""
    step: int | None = None
    """Newest step the attempt reported."""
    start_step: int | None = None
    """Step the attempt started from (the checkpoint it loaded)."""
    last_checkpoint_step: int | None = None
    """Newest complete checkpoint the attempt reported."""
    last_progress_time: str | None = None
    """When the step last advanced (the hang timer runs from here)."""
    first_step_time: str | None = None
    """When the attempt's first trained step completed (start-up ends here)."""
    metrics_ok_time: str | None = None
    """When rank 0's /metrics last answered."""
    metrics_error: str | None = None
    """Why the newest scrape of rank 0's /metrics failed, if it did."""
    metrics_error_reason: str | None = None
    """The `MetricsAvailable` reason of that failure: `ScrapeFailed`, `MetricsTooLarge`, `MetricsTimeout` or
    `MetricsMalformed`."""
    ranks_seen: list[int] = Field(default_factory=list)
    """Ranks whose pod has been observed: a seen rank that is gone disappeared; one never seen is created."""
    nodes_missing_since: dict[str, str] = Field(default_factory=dict)
    """Node name to when the operator first saw it missing from the API (kept for the attempt after its pods are
    gone: ranks that disappeared from a missing node are a `NodeFailure`, not a `PodDeleted`)."""
    generation: int | None = None
    """Worker generation rank 0's metrics report (in-place restarts); step and timers above are this one's."""
    generation_start_time: str | None = None
    """When the current worker generation began (the failure a launcher reported)."""
    previous_generation_step: int | None = None
    """Newest step the previous worker generation reported (its work lost is counted from here)."""
    restart_exit_code: int | None = None
    """Exit code of the worker failure that began the current generation."""
    restart_node_rank: int | None = None
    """Pod rank whose worker failure began the current generation."""
    step_seconds_median: float | None = None
    """Median step time of the current generation's recent steps (the automatic hang timeout scales with it)."""
    grow_to: int | None = None
    """A planned grow (`runPolicy.elastic`): the size the gang grows to right after its next complete checkpoint."""
    grow_after_step: int | None = None
    """The planned grow waits for a complete checkpoint newer than this step."""
    saves_failed_in_a_row: int | None = None
    """Checkpoint saves that failed in a row, as rank 0 last reported (0 once one completes; none: not reported)."""
    saves_failed: int | None = None
    """Failed checkpoint saves of rank 0's current worker generation, in a row or not."""
    max_failed_saves: int | None = None
    """The trainer's failed-saves budget (`spec.checkpoint.maxFailedSaves` of the attempt's spec)."""
    last_failed_save_step: int | None = None
    """Step of the newest checkpoint save that failed."""
    last_save_error: str | None = None
    """The newest failed save's error: an errno name (`ENOSPC`, `EIO`) or the exception's type (`S3Exception`)."""


class StatusEvent(_Base):
    """A Kubernetes Event that belongs to a status change (a restart record, the end of the run, a refused edit):
    written into the status together with the change and sent after it, so that an operator stopped in between
    sends it when it resumes. The Event's name derives from these fields, so a resend is never a second Event."""

    type: Literal["Normal", "Warning"]
    """The Event's type."""
    reason: str
    """The Event's CamelCase reason."""
    message: str
    """The Event's message."""
    time: str
    """When the status change happened (RFC 3339)."""


class LlamaPretrainStatus(_Base):
    """Observed state of a Llama 3 pre-training run; rebuilt by the operator."""

    phase: Phase | None = None
    """Summary derived from the conditions, for display only."""
    conditions: list[Condition] = Field(default_factory=list)
    """Conditions keyed by type."""
    observed_generation: int | None = None
    """The `metadata.generation` the operator last acted on."""
    attempt: int | None = None
    """Current attempt number (0 for the first gang, +1 per restart)."""
    restart_count: int = 0
    """Number of gang restarts so far (resizes not included: `resizeCount`)."""
    nodes: int | None = None
    """Nodes of the current attempt's gang: `resources.nodes`, or with `runPolicy.elastic` the size the run
    trains at now."""
    resize_count: int = 0
    """Resizes (`Shrink`/`Grow` restarts) so far (`runPolicy.elastic.maxResizes`)."""
    restarts: list[RestartRecord] = Field(default_factory=list)
    """The newest restarts (at most 50), oldest first."""
    training: TrainingStatus | None = None
    """Training progress."""
    start_time: str | None = None
    """When the first attempt was created."""
    completion_time: str | None = None
    """When the run succeeded or failed."""
    message: str | None = None
    """Human-readable summary of the current state."""
    observation: AttemptObservation | None = None
    """The operator's timers and last known progress of the current attempt (kept across operator restarts)."""
    pending_events: list[StatusEvent] = Field(default_factory=list)
    """Events of the last status change that the operator has not confirmed sent yet (normally empty)."""


class ObjectMeta(BaseModel):
    """The subset of metadata the planner uses; everything else is kept as is."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(default="", max_length=253)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class LlamaPretrain(_Base):
    """A Llama 3 pre-training run: a gang of torchrun pods running torchtitan."""

    api_version: Literal["kubetitan.io/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    """`kubetitan.io/v1alpha1`."""
    kind: Literal["LlamaPretrain"] = KIND
    """`LlamaPretrain`."""
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """Standard object metadata."""
    spec: LlamaPretrainSpec = Field(default_factory=LlamaPretrainSpec)
    """Desired state of the run."""
    status: LlamaPretrainStatus | None = None
    """Observed state of the run, written by the operator."""


# ------------------------------------------------------------------ derived values
@dataclass(frozen=True)
class ShardsPath:
    """One shards directory a run reads: where the spec names it, where the trainer's ``[kubetitan.data]`` table
    carries it, and the path (a directory in the pod or ``s3://bucket/prefix``)."""

    spec_field: str
    """The wire field without ``spec.``, e.g. ``data.mixture[1].shards.path``."""
    table_field: str
    """The trainer's key, e.g. ``kubetitan.data.mixture_paths[1]``."""
    path: str
    held_out: bool = False
    """The held-out evaluation set (read only when evaluation is on)."""

    @property
    def field(self) -> str:
        """Both names, as the trainer's errors give them."""
        return f"{self.table_field} (spec.{self.spec_field})"


def shards_paths(source: str, shards_path: str, mixture: Sequence[str | None], eval_shards_path: str
                 ) -> list[ShardsPath]:
    """Every shards path a run reads, the one rule for the spec (:func:`spec_shards_paths`) and for the trainer's
    table (``kubetitan_core.contract.trainer_toml.table_shards_paths``): the source's with ``source: shards``, each
    mixture entry that is a shards directory with ``source: mixture`` (None: a hub dataset), then the held-out set's;
    empty paths left out."""
    out = [ShardsPath("data.shards.path", "kubetitan.data.shards_path", shards_path)] if source == "shards" else []
    if source == "mixture":
        out += [ShardsPath(f"data.mixture[{i}].shards.path", f"kubetitan.data.mixture_paths[{i}]", p)
                for i, p in enumerate(mixture) if p is not None]
    out.append(ShardsPath("data.eval.shards.path", "kubetitan.data.eval_shards_path", eval_shards_path, held_out=True))
    return [p for p in out if p.path]


def spec_shards_paths(s: LlamaPretrainSpec) -> list[ShardsPath]:
    """:func:`shards_paths` of a spec."""
    d = s.data
    return shards_paths(d.source, d.shards.path if d.shards is not None else "",
                        [m.shards.path if m.shards is not None else None for m in d.mixture],
                        d.eval.shards.path if d.eval is not None and d.eval.shards is not None else "")
def weight_schedules(s: LlamaPretrainSpec) -> list[WeightSchedule]:
    """Each mixture source's weight schedule (:mod:`kubetitan_core.weights`), percentages resolved against
    `training.steps`; a point that sets neither `step` nor `percent` is at step 0 (validation refuses it)."""
    out = []
    for m in s.data.mixture or []:
        sch = m.schedule
        points = tuple((p.step if p.step is not None else percent_step(p.percent, s.training.steps)
                        if p.percent is not None else 0, p.weight) for p in (sch.points if sch else []))
        out.append(WeightSchedule(m.weight, sch.interpolation if sch else "linear", points))
    return out


def reads_s3_shards(s: LlamaPretrainSpec) -> bool:
    """Whether any shards path the trainer reads is ``s3://`` (then the pod stages them: plan and render)."""
    return any(is_s3_uri(p.path) for p in spec_shards_paths(s))


def elastic_sizes(spec: LlamaPretrainSpec) -> range:
    """The gang sizes an elastic run may train at (``minNodes``..``maxNodes``); only ``resources.nodes`` otherwise."""
    e = spec.run_policy.elastic
    if e is None:
        return range(spec.resources.nodes, spec.resources.nodes + 1)
    return range(e.min_nodes, (e.max_nodes if e.max_nodes is not None else spec.resources.nodes) + 1)


def processes_per_node(spec: LlamaPretrainSpec) -> int:
    """torchrun's ``--nproc-per-node``: explicit, else one per GPU, else 1 on CPU."""
    r = spec.resources
    if r.processes_per_node is not None:
        return r.processes_per_node
    return r.gpus_per_node if r.gpus_per_node > 0 else 1


def world_size(spec: LlamaPretrainSpec) -> int:
    """Total number of training processes in one attempt."""
    return spec.resources.nodes * processes_per_node(spec)


def resolved_dp_shard(spec: LlamaPretrainSpec) -> int | None:
    """The FSDP shard degree with -1 resolved; None when the degrees do not divide the world."""
    p = spec.parallelism
    if p.data_parallel_shard_degree != -1:
        return p.data_parallel_shard_degree
    others = (
        p.data_parallel_replicate_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
        * p.context_parallel_degree
    )
    ws = world_size(spec)
    return ws // others if ws % others == 0 and ws >= others else None


def dp_degree(spec: LlamaPretrainSpec) -> int | None:
    """The data-parallel degree (shard x replicate) the batch is split over; None when the degrees do not divide the
    world."""
    shard = resolved_dp_shard(spec)
    return None if shard is None else shard * spec.parallelism.data_parallel_replicate_degree


def global_batch(spec: LlamaPretrainSpec) -> int | None:
    """The global batch in samples: ``training.globalBatchSize``, else ``localBatchSize`` x the data-parallel degree
    at ``resources.nodes`` (an elastic run keeps it at every size); None when the degrees do not divide the world."""
    t = spec.training
    if t.global_batch_size is not None:
        return t.global_batch_size
    dp = dp_degree(spec)
    return None if dp is None else t.local_batch_size * dp


def at_size(spec: LlamaPretrainSpec, nodes: int) -> LlamaPretrainSpec:
    """``spec`` as one attempt of ``nodes`` nodes trains it: ``resources.nodes`` set to the attempt's size and, for an
    elastic run, the global batch pinned (gradient accumulation makes up the difference at a smaller size). The
    spec itself when the size is its own."""
    if nodes == spec.resources.nodes:
        return spec
    gb = global_batch(spec)
    out = spec.model_copy(deep=True)
    out.resources.nodes = nodes
    if spec.run_policy.elastic is not None and gb is not None:
        out.training.global_batch_size = gb
    return out


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``M``, ``M | None`` or ``list[M]``, if any (how the CRD generator and the
    validator walk these models)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            if (m := model_in(arg)) is not None:
                return m
    return None
