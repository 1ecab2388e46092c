"""The ``[kubetitan]`` table of ``trainer.toml``: typed, written by the operator's renderer and read by the trainer.

torchtitan 0.2.2 extends its config through ``job.custom_config_module``: the module named there must define a
``JobConfig`` dataclass, whose fields ConfigManager merges with its own (``torchtitan/config/manager.py``,
``_maybe_add_custom_config``; unknown keys are refused there). The rendered TOML names
``kubetitan_trainer.job_config``, which hands torchtitan :class:`JobConfig` from here; the renderer
(``kubetitan_core.render.kubetitan_table``) builds a :class:`Kubetitan` and writes it with :func:`to_table`.

What is written: every top-level key and each table's ``source`` (they say what the run is, whatever the value),
and any other key whose value is not the trainer's default, so a trainer image of an older version reads every file
that uses none of a newer version's keys.

Torch-free on purpose (the operator imports it). No ``from __future__ import annotations`` here: ConfigManager
checks ``is_dataclass(field.type)`` to recurse into nested tables, which fails on string annotations.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kubetitan_core.api import (AttentionMask, CheckpointSpec, DataOrder, DataSource, NetworkFallback, Platform,
                                ShardsDtype, ShardsPath, StagingWrite, TierRead, TokenizerSource, shards_paths)

ALWAYS = {"always": True}
"""Field metadata: written whatever the value (see the module docstring)."""


@dataclass
class KubetitanData:
    """``[kubetitan.data]``: where the training tokens come from."""

    source: DataSource = field(default="synthetic", metadata=ALWAYS)
    """`synthetic`: deterministic random tokens (benchmarks); `huggingface`: a text dataset
    tokenized on the fly, read the way torchtitan reads c4; `shards`: pre-tokenized `.bin` files;
    `mixture`: several sources (shards directories, streamed datasets) mixed by weight (`mixture_paths`,
    `mixture_weights`, `mixture_kinds`)."""
    order: DataOrder = field(default="shuffled", metadata=ALWAYS)
    """Order of the windows of `shards` and `mixture` sources: `shuffled` (a seeded permutation per epoch, the
    seed being `debug.seed`) or `sequential` (corpus order)."""
    hf_dataset: str = "allenai/c4"
    """Dataset repository on the hub, a local directory or file (`.jsonl`, `.json`, `.txt`,
    `.parquet`), or `builtin` for the small corpus shipped with the trainer."""
    hf_config: str = ""
    """Dataset configuration (subset) name; empty means none. Ignored for local files."""
    hf_split: str = "train"
    """Split to read."""
    hf_streaming: bool = True
    """Stream the dataset instead of downloading it whole first."""
    hf_text_field: str = "text"
    """Column holding the text."""
    shards_path: str = ""
    """Directory with `*.bin` token shards and `index.json` (written by `kubetitan prepare-data`), or
    `s3://bucket/prefix` holding a copy of one (staged to local disk at start: `[kubetitan.data_s3]`)."""
    shards_dtype: ShardsDtype = "auto"
    """Token dtype of the shards; `auto` reads it from `index.json`."""
    mixture_paths: list[str] = field(default_factory=list)
    """The sources of a `mixture`, one entry each: a shards directory (or an `s3://bucket/prefix` copy of one), or
    for a `huggingface` source (see `mixture_kinds`) the dataset (a hub id or a local path, as `hf_dataset`)."""
    mixture_kinds: list[str] = field(default_factory=list)
    """Kind of each `mixture_paths` entry: `shards` or `huggingface`; empty: `shards` for all."""
    mixture_hf_configs: list[str] = field(default_factory=list)
    """Per mixture source: the dataset configuration of a `huggingface` one (as `hf_config`), empty otherwise."""
    mixture_hf_splits: list[str] = field(default_factory=list)
    """Per mixture source: the split of a `huggingface` one (as `hf_split`); empty: `train`."""
    mixture_hf_text_fields: list[str] = field(default_factory=list)
    """Per mixture source: the text column of a `huggingface` one (as `hf_text_field`); empty: `text`."""
    mixture_hf_streaming: list[bool] = field(default_factory=list)
    """Per mixture source: stream a `huggingface` one (as `hf_streaming`); empty: true."""
    mixture_weights: list[float] = field(default_factory=list)
    """Weight of each `mixture_paths` entry (0 or more, normalised; 0 only with a schedule that raises it): its share
    of the samples (and tokens); with a schedule, its weight at step 0."""
    mixture_schedule_interpolations: list[str] = field(default_factory=list)
    """Per mixture source: how its weight changes between its schedule points, `linear` or `step`; empty (for all,
    or for one source): no schedule, its weight holds (kubetitan_core.weights)."""
    mixture_schedule_sources: list[int] = field(default_factory=list)
    """The weight schedules' points, one entry each: the index of the source (in `mixture_paths`) it belongs to; with
    `mixture_schedule_steps` and `mixture_schedule_weights`, its points in increasing step order."""
    mixture_schedule_steps: list[int] = field(default_factory=list)
    """Per schedule point: its training step (0 is the start, where the source's weight is `mixture_weights`)."""
    mixture_schedule_weights: list[float] = field(default_factory=list)
    """Per schedule point: the source's weight at that step (0 or more)."""
    mixture_dtypes: list[str] = field(default_factory=list)
    """Token dtype of each mixture source (`auto`, `uint16`, `uint32`); empty: `auto` for all."""
    mixture_names: list[str] = field(default_factory=list)
    """Name of each mixture source (the `source` label of its metrics); empty: the directory's or dataset's name."""
    eval_samples: int = 0
    """Held-out sequences evaluated every `[validation] freq` steps, over all data-parallel ranks (rounded down to
    a multiple of local batch x data-parallel degree); 0: no evaluation."""
    held_out_percent: float = 0.0
    """Without `eval_shards_path`: the last this many percent of every training source's windows are held out
    (never trained on) and evaluated."""
    eval_shards_path: str = ""
    """A separate held-out shards directory (or `s3://bucket/prefix`) to evaluate; empty: hold out part of the
    training data."""
    attention_mask: AttentionMask = "causal"
    """`causal`: every token attends to every earlier token of its sample; `document`: only to the earlier tokens of
    its own document (block-causal, from the shards' `.idx` boundaries, through torchtitan's flex attention)."""
    ledger: bool = False
    """Debugging: each rank appends the global samples it trains (step, position, source, window, epoch) to
    `<dump_folder>/kubetitan/ledger/rank-<r>-of-<W>.txt`."""


def table_shards_paths(d: KubetitanData) -> list[ShardsPath]:
    """``kubetitan_core.api.shards_paths`` of a ``[kubetitan.data]`` table (the trainer's side of the one rule)."""
    kinds = list(d.mixture_kinds) or ["shards"] * len(d.mixture_paths)  # a huggingface entry reads no shards
    return shards_paths(d.source, d.shards_path,
                        [p if kind == "shards" else None for p, kind in zip(d.mixture_paths, kinds, strict=True)],
                        d.eval_shards_path)

@dataclass
class KubetitanTokenizer:
    """``[kubetitan.tokenizer]``: which tokenizer to load."""

    source: TokenizerSource = field(default="builtin", metadata=ALWAYS)
    """`builtin`: the byte-level BPE shipped with the trainer (vocabulary below 2048);
    `path`: a directory holding `tokenizer.json`; `huggingface`: downloaded from the hub at start
    (uses `HF_TOKEN` from the environment)."""
    path: str = ""
    """Directory holding `tokenizer.json` (and `tokenizer_config.json`), for `source = "path"`."""
    repo: str = ""
    """Hub repository for `source = "huggingface"`, e.g. `meta-llama/Meta-Llama-3.1-8B`."""


@dataclass
class KubetitanModel:
    """``[kubetitan.model]``: dimensions of the `custom` flavour (unused by named flavours)."""

    dim: int = 256
    """Hidden size; divisible by `n_heads`."""
    n_layers: int = 6
    """Transformer blocks."""
    n_heads: int = 16
    """Attention (query) heads."""
    n_kv_heads: int = 16
    """Key/value heads (grouped-query attention); divides `n_heads`."""
    ffn_dim_multiplier: float = 1.0
    """Multiplier on the feed-forward hidden size."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    rope_theta: float = 500000.0
    """Base frequency of the rotary position embedding."""
    vocab_size: int = 2048
    """Vocabulary size; at least the tokenizer's."""


@dataclass
class KubetitanCheckpointStorage:
    """``[kubetitan.checkpoint_storage]``: checkpoints in S3 instead of ``job.dump_folder`` (kubetitan_trainer.storage)."""

    s3_uri: str = ""
    """`s3://bucket/prefix`: each save goes to `<prefix>/step-N/`. Empty: checkpoints stay in the local or
    mounted folder `job.dump_folder`/`checkpoint.folder`."""
    region: str = ""
    """The bucket's AWS region (empty: `us-east-1`)."""
    endpoint: str = ""
    """An S3-compatible endpoint URL; empty: AWS's regional endpoint."""
    force_path_style: bool = False
    """Path-style addressing (`endpoint/bucket/key`), which most S3-compatible servers need."""
    max_attempts: int = 10
    """Attempts per S3 request in the client's retry strategy (backoff with jitter on 503 SlowDown, 5xx,
    connection resets and timeouts)."""
    thread_count: int = 4
    """DCP writer threads per rank; each writes its own object, so a save writes ranks x this objects."""
    max_failed_saves: int = CheckpointSpec.model_fields["max_failed_saves"].default
    """`spec.checkpoint.maxFailedSaves` (its default and bounds are the API's): checkpoint saves in a row that may
    fail with a storage error while training goes on; the save that makes this many in a row ends the run with exit
    code 6 (retryable). The last step's save is tried this many times before that. Any store: S3 or a volume."""


@dataclass
class KubetitanDataS3:
    """``[kubetitan.data_s3]``: how the data's `s3://` shards paths are reached, and where they are staged
    (kubetitan_trainer.data.s3shards)."""

    region: str = ""
    """The buckets' AWS region (empty: `us-east-1`)."""
    endpoint: str = ""
    """An S3-compatible endpoint URL; empty: AWS's regional endpoint."""
    force_path_style: bool = False
    """Path-style addressing (`endpoint/bucket/key`), which most S3-compatible servers need."""
    max_attempts: int = 10
    """Attempts per S3 request in the client's retry strategy (backoff with jitter on 503 SlowDown, 5xx,
    connection resets and timeouts)."""
    stage_dir: str = ""
    """Node-local directory the shards are copied to at start (`<stage_dir>/<bucket>/<prefix>/`); empty:
    `<job.dump_folder>/kubetitan/data-cache`."""
    threads: int = 8
    """Ranged GETs in flight while staging."""
    part_size_bytes: int = 16 * 2**20
    """Bytes per ranged GET (each in-flight GET holds one part in memory)."""




@dataclass
class KubetitanRuntime:
    """``[kubetitan.runtime]``: tuning of the trainer's recovery and compile internals (``spec.runtime``). The
    defaults are the settings measured best; the trainer reads the table once as each worker process starts."""

    restore_tier_read: TierRead = "pread"
    """How a load from the node-local restore tier reads its files: `pread` (straight into the loader threads'
    pinned buffers) or `map` (a read-only mapping, copied through pinned buffers)."""
    restore_tier_load_threads: int = 0
    """Threads that copy the restore tier into the training state at a load; 0: automatic (`pread`: the pod's CPUs
    over its workers, 2 to 16; `map`: 1 when torch's own copies are parallel, else 4)."""
    defer_optimizer_load: bool = True
    """Load the optimizer's part of a restore-tier load in the background, while the first step's forward and
    backward run (the step waits for it before the optimizer's update); false: all of it at once."""
    defer_threads: int = 4
    """Threads of the background (deferred) part of a restore-tier load."""
    defer_switch_interval_ms: int = 0
    """Python's thread switch interval, in milliseconds, while the deferred part is copied; 0: Python's own (5 ms)."""
    staging_write: StagingWrite = "pwrite"
    """How the checkpoint stager writes its staged copy into the restore tier's arena: `pwrite` (threads write the
    files; the worker never maps them) or `map` (copies into a mapping of the files)."""
    staging_write_threads: int = 8
    """Threads that write the arena in the `pwrite` mode."""
    early_cuda_context: bool = False
    """Create the worker's CUDA context on a side thread as the worker starts, instead of on torch's first CUDA
    call."""
    aot_compile: bool = False
    """Ahead-of-time compiled transformer blocks (each rank makes its own artefact once per node, restarts
    load it instead of compiling) and the AOTAutograd cache's allow-list of the recipe's functions (compiled
    runs: a restart loads the joint graphs from the cache). Off: compiled blocks compile as torch does."""


@dataclass
class KubetitanPreflight:
    """``[kubetitan.preflight]``: the pod's pre-flight gate (kubetitan_trainer.preflight), run by each pod's launcher
    before the attempt's first workers start. The GPU model and the EFA devices it expects are ``[kubetitan]``'s
    `gpu_product`/`instance_type` and `efa_per_node`."""

    enabled: bool = True
    """`spec.runPolicy.preflight` is `Enabled`: run the gate; a failed check ends the pod with exit code 8."""
    gpus: int = 0
    """GPUs the pod must see (`spec.resources.gpusPerNode`); 0: a CPU pod (the GPU checks are skipped, saying so)."""
    inject: str = ""
    """Tests only (never rendered from a spec): the name of a check that is reported failed after it ran, to drive
    the failure path (exit code 8, the termination message) on a healthy node."""


@dataclass
class Kubetitan:
    """``[kubetitan]``: what torchtitan's own sections cannot say."""

    job_name: str = field(default="local", metadata=ALWAYS)
    """Name of the LlamaPretrain (labels metrics and logs)."""
    namespace: str = field(default="default", metadata=ALWAYS)
    """Namespace of the LlamaPretrain."""
    metrics_port: int = field(default=9090, metadata=ALWAYS)
    """Port of the Prometheus `/metrics` endpoint served by each node's local rank 0; 0 turns it off."""
    metrics_host: str = "0.0.0.0"
    """Address the metrics endpoint binds to; `0.0.0.0` binds dual-stack (`::`, IPv4 and IPv6) where the
    kernel has IPv6."""
    gpu_product: str = field(default="", metadata=ALWAYS)
    """GPU model from the spec (H100, H200, ...); the MFU peak when the device name does not say."""
    instance_type: str = field(default="", metadata=ALWAYS)
    """Node instance type from the spec (informational; also tells the GPU model)."""
    platform: Platform = field(default="generic", metadata=ALWAYS)
    """Cluster flavour from the spec; on `eks`/`hyperpod` with EFA the NCCL network is enforced."""
    efa_per_node: int = field(default=0, metadata=ALWAYS)
    """EFA interfaces the pod requested; above 0 the trainer checks that NCCL runs on EFA."""
    network_fallback: NetworkFallback = field(default="Fail", metadata=ALWAYS)
    """EFA requested on eks/hyperpod but NCCL not on it: `Fail` exits 5, `AllowSockets` warns and goes on."""
    requested_fsdp_float8_all_gather: bool = field(default=False, metadata=ALWAYS)
    """The spec asked for FSDP FP8 all-gather (the renderer turns it off when dp_shard is 1;
    the trainer says so in its log)."""
    requested_precompute_float8_scale: bool = field(default=False, metadata=ALWAYS)
    """The spec asked for precomputed FP8 scales (same rule as above)."""
    inprocess_restarts: int = 0
    """In-process restarts per worker process (`kubetitan_trainer.recovery.inprocess`): after a fault that leaves the
    process alive (an exception in a step, a non-finite loss, a collective error or timeout) every rank restarts
    its training loop in the same process, on a new process group, from the newest saved state; a fault the causes
    table does not restart in place, one that repeats at the same step, or more than this many end the worker as
    before. 0 (the default): off."""
    inprocess_progress_timeout_seconds: int = 0
    """With in-process restarts on: seconds a step may stand still before its rank reports a `Hang` and the gang
    restarts in-process (needed on NCCL, where a host waiting on a stuck kernel never sees the collective timeout);
    0: only the collective timeout (`comm.train_timeout_seconds`) detects a hang. The first step after a start or an
    in-process restart is not timed (it compiles); the collective timeout bounds it."""
    loss_chunks: int = 0
    """`precision.lossChunks`: the output projection and the cross entropy in this many chunks of the batch's tokens,
    their gradients made in the forward pass (`kubetitan_trainer.chunked_loss`); 0 or 1: torchtitan's loss."""
    data: KubetitanData = field(default_factory=KubetitanData)
    """Training data."""
    tokenizer: KubetitanTokenizer = field(default_factory=KubetitanTokenizer)
    """Tokenizer."""
    model: KubetitanModel = field(default_factory=KubetitanModel)
    """Custom model dimensions."""
    checkpoint_storage: KubetitanCheckpointStorage = field(default_factory=KubetitanCheckpointStorage)
    """Where checkpoints go when not in `job.dump_folder` (S3)."""
    data_s3: KubetitanDataS3 = field(default_factory=KubetitanDataS3)
    """How `s3://` shards paths of `data` are reached and staged."""
    preflight: KubetitanPreflight = field(default_factory=KubetitanPreflight)
    """The pod's pre-flight gate."""
    runtime: KubetitanRuntime = field(default_factory=KubetitanRuntime)
    """Tuning of the recovery and compile internals."""


@dataclass
class JobConfig:
    """The extension torchtitan merges into its own ``JobConfig``."""

    kubetitan: Kubetitan = field(default_factory=Kubetitan)
    """kubetitan's settings."""


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


def to_table(obj: Any) -> dict[str, Any]:
    """A ``[kubetitan]`` dataclass as its TOML table: the fields marked :data:`ALWAYS`, the others that differ from
    their default, and each nested table that has a key to write."""
    table: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            if sub := to_table(value):
                table[f.name] = sub
        elif f.metadata.get("always") or value != _default(f):
            table[f.name] = list(value) if isinstance(value, (list, tuple)) else value
    return table


def from_table(cls: type, table: dict[str, Any]) -> Any:
    """The dataclass ``cls`` from its TOML table, as torchtitan's ConfigManager reads it (``_dict_to_dataclass``):
    a key ``cls`` does not have is an error (ValueError naming it), a missing one takes its default."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(table) - set(known)):
        raise ValueError(f"unknown key(s) {unknown} in the [{cls.__name__}] table; known: {sorted(known)}")
    return cls(**{k: from_table(known[k].type, v) if dataclasses.is_dataclass(known[k].type) and isinstance(v, dict)
                  else v for k, v in table.items()})
