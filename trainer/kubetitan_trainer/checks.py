"""Static checks of a parsed job config before any process group exists (exit code 2 on failure).

Each check names the torchtitan key and the LlamaPretrain field it comes from, and the fix. Two kinds:

- **Re-checks of the rule table**: every ``kubetitan_core.validation.RULES`` entry with a ``trainer`` key has one
  function in :data:`RECHECKS` (registered with :func:`recheck` under the rule's id); :func:`check` runs them in
  table order, so the table decides what the trainer re-checks (a trainer.toml written by hand, or by an older
  operator, gets the same verdict). tests/trainer/test_rechecks.py fails on a flagged rule without a re-check, a
  re-check without a flagged rule, and a re-check that does not refuse its rule's violation.
- **Trainer-only checks** of things the spec cannot say wrong (the TrainSpec name, bounds of hand-written keys,
  files present in the pod).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torchtitan.config import JobConfig

from kubetitan_core.validation import RULES
from kubetitan_trainer import BUILTIN_TOKENIZER
from kubetitan_trainer.errors import ConfigError
from kubetitan_trainer.flavours import model_args_for

Recheck = Callable[[JobConfig, int, bool], None]
RECHECKS: dict[str, Recheck] = {}
"""Rule id -> its re-check ``(job_config, world_size, cuda)``, raising :class:`ConfigError` with that ``rule``."""

_FLAGGED = {r.id: r.trainer for r in RULES if r.trainer}


def recheck(rule_id: str) -> Callable[[Recheck], Recheck]:
    """Register the trainer's re-check of the table's rule ``rule_id`` (which must be flagged ``trainer``)."""

    def register(fn: Recheck) -> Recheck:
        if rule_id not in _FLAGGED:
            raise LookupError(f"{rule_id!r} is not a kubetitan_core.validation.RULES entry with a trainer key")
        RECHECKS[rule_id] = fn
        return fn

    return register


def check(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    """Raise the first :class:`ConfigError` found: trainer-only checks first, then the table's re-checks."""
    _trainer_only(job_config)
    for rule in RULES:
        if rule.trainer:
            RECHECKS[rule.id](job_config, world_size, cuda)


def _trainer_only(job_config: JobConfig) -> None:
    from kubetitan_core.render import TRAIN_SPEC_NAME

    if job_config.model.name != TRAIN_SPEC_NAME:
        raise ConfigError("model.name", f"is {job_config.model.name!r}", f"set it to {TRAIN_SPEC_NAME!r} (kubetitan's TrainSpec)")
    model_args_for(job_config)  # unknown flavour, bad custom dims
    t = job_config.training
    if t.steps < 1:
        raise ConfigError("training.steps (spec.training.steps)", f"is {t.steps}", "set at least 1")
    if t.seq_len < 2:
        raise ConfigError("training.seq_len (spec.training.seqLen)", f"is {t.seq_len}", "set at least 16")
    d = job_config.kubetitan.data
    if d.source == "huggingface" and d.hf_dataset.startswith("/") and not Path(d.hf_dataset).exists():
        raise ConfigError("kubetitan.data.hf_dataset (spec.data.huggingface.dataset)",
                          f"the local path {d.hf_dataset} does not exist",
                          "mount the volume that holds it (spec.data.volume) or fix the path")
    if not 0 <= job_config.kubetitan.metrics_port <= 65535:
        raise ConfigError("kubetitan.metrics_port (spec.monitoring.metricsPort)", "is out of range", "use 1024-65535")


def _others(job_config: JobConfig) -> int:
    p = job_config.parallelism
    return p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree


def _dp_shard(job_config: JobConfig, world_size: int) -> int:
    dp_shard = job_config.parallelism.data_parallel_shard_degree
    return world_size // _others(job_config) if dp_shard == -1 else dp_shard


@recheck("parallelism.product")
def _parallelism_product(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    others = _others(job_config)
    if world_size % others:
        raise ConfigError(
            "parallelism (spec.parallelism)",
            f"replicate x tensor x pipeline x context degrees = {others} does not divide the {world_size} training processes",
            "make the product of the degrees equal nodes x processesPerNode", "parallelism.product",
        )
    dp_shard = _dp_shard(job_config, world_size)
    if dp_shard * others != world_size:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree (spec.parallelism.dataParallelShardDegree)",
            f"{dp_shard} x {others} (other degrees) != {world_size} training processes",
            f"set it to {world_size // others} or -1", "parallelism.product",
        )


def vocab_error(job_config: JobConfig, tokens: int) -> ConfigError | None:
    """Rule tokenizer.vocab on the tokenizer's real size (also run by ``tokenizer.build_tokenizer`` after a
    download, for tokenizers that are not in the pod before training starts)."""
    model_vocab = model_args_for(job_config).vocab_size
    if tokens <= model_vocab:
        return None
    return ConfigError(
        "model.flavor (spec.model.flavor / spec.tokenizer)",
        f"the tokenizer has {tokens} tokens but flavour {job_config.model.flavor} has vocab_size {model_vocab}",
        "use a tokenizer that fits (the builtin one fits every flavour) or a custom flavour with a larger vocabSize",
        "tokenizer.vocab",
    )


@recheck("tokenizer.vocab")
def _tokenizer_vocab(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    """A tokenizer already in the pod (builtin, or a path holding tokenizer.json) is measured now; a hub tokenizer
    is measured by ``tokenizer.build_tokenizer`` once downloaded (same :func:`vocab_error`)."""
    tk = job_config.kubetitan.tokenizer
    folder = BUILTIN_TOKENIZER if tk.source == "builtin" else Path(tk.path) if tk.source == "path" and tk.path else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        return  # a missing path is rule tokenizer.path-required's
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if (e := vocab_error(job_config, HuggingFaceTokenizer(str(folder)).get_vocab_size())) is not None:
        raise e


@recheck("training.global-batch")
def _global_batch(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    t = job_config.training
    dp = _dp_shard(job_config, world_size) * job_config.parallelism.data_parallel_replicate_degree
    if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
        raise ConfigError(
            "training.global_batch_size (spec.training.globalBatchSize)",
            f"{t.global_batch_size} is not a multiple of local batch {t.local_batch_size} x data-parallel degree {dp}",
            f"use a multiple of {t.local_batch_size * dp}", "training.global-batch",
        )


def _float8(job_config: JobConfig):
    return job_config.quantize.linear.float8 if "quantize.linear.float8" in job_config.model.converters else None


@recheck("float8.hardware")
def _float8_hardware(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    f8 = _float8(job_config)
    if f8 is not None and not cuda and not f8.emulate:
        raise ConfigError(
            "quantize.linear.float8.emulate (spec.precision.float8.emulate)",
            "FP8 is on but there is no GPU",
            "set emulate: true for CPU runs, or run on H100/H200/L40S GPUs", "float8.hardware",
        )


@recheck("float8.emulate-compile")
def _float8_emulate_compile(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    f8 = _float8(job_config)
    if f8 is not None and f8.emulate and job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            "compile.enable (spec.precision.compile)",
            "torchao's FP8 emulation only runs in eager mode",
            "set compile: false when float8.emulate is true", "float8.emulate-compile",
        )


@recheck("float8.all-gather-recipe")
def _float8_all_gather_recipe(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    f8 = job_config.quantize.linear.float8
    if f8.enable_fsdp_float8_all_gather and (_float8(job_config) is None or f8.recipe_name is not None):
        raise ConfigError(
            "quantize.linear.float8.enable_fsdp_float8_all_gather (spec.precision.float8.fsdpFloat8AllGather)",
            "needs FP8 on (converter quantize.linear.float8) and the plain tensorwise path, but "
            + ("FP8 is off" if _float8(job_config) is None else f"recipe_name is {f8.recipe_name}"),
            "set recipe: tensorwise (rendered without recipe_name) or turn fsdpFloat8AllGather off",
            "float8.all-gather-recipe",
        )


@recheck("data.mixture-schedule")
def _mixture_schedule(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    from kubetitan_core import weights

    d = job_config.kubetitan.data
    if d.source != "mixture":
        return
    field = "kubetitan.data.mixture_schedule_* (spec.data.mixture[].schedule)"
    try:
        schedules = weights.from_lists(d.mixture_weights, d.mixture_schedule_interpolations, d.mixture_schedule_sources,
                                       d.mixture_schedule_steps, d.mixture_schedule_weights)
    except ValueError as e:
        raise ConfigError(field, str(e), "render trainer.toml from the spec (kubetitan render)",
                          "data.mixture-schedule") from None
    for i, msg in weights.problems(schedules, job_config.training.steps):
        where = "the mixture" if i is None else f"source {i}"
        raise ConfigError(field, f"{where}: {msg}", "fix the schedule in spec.data.mixture", "data.mixture-schedule")


@recheck("data.shards-required")
def _shards_required(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    d = job_config.kubetitan.data
    if d.source != "shards":
        return
    if not d.shards_path:
        raise ConfigError("kubetitan.data.shards_path (spec.data.shards.path)", "is empty",
                          "set it to a directory written by `kubetitan prepare-data`", "data.shards-required")
    from kubetitan_core.contract import is_s3_uri
    from kubetitan_trainer.data.shards import ShardSet

    if is_s3_uri(d.shards_path):  # staged and fully checked by the data loader (kubetitan_trainer.data.s3shards)
        return
    # Sizes (a stat per file), the index, the dtype and the tokenizer's vocabulary against the model's: a bad
    # directory stops the run here with exit code 2, not as a crash in the data loader that would be retried.
    ShardSet.open(d.shards_path, vocab_size=model_args_for(job_config).vocab_size, verify="size", dtype=d.shards_dtype)


@recheck("data.s3-uri")
def _data_s3_uri(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    from kubetitan_core.contract import is_s3_uri
    from kubetitan_core.contract.trainer_toml import table_shards_paths
    from kubetitan_core.validation import s3_uri_error

    for p in table_shards_paths(job_config.kubetitan.data):
        if is_s3_uri(p.path) and (msg := s3_uri_error(p.path)) is not None:
            raise ConfigError(p.field, msg, "write s3://bucket/prefix", "data.s3-uri")


@recheck("checkpoint.s3-uri")
def _s3_uri(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    from kubetitan_core.validation import s3_uri_error

    uri = job_config.kubetitan.checkpoint_storage.s3_uri
    if uri and (msg := s3_uri_error(uri)) is not None:
        raise ConfigError("kubetitan.checkpoint_storage.s3_uri (spec.checkpoint.storage.s3.uri)", msg,
                          "write s3://bucket/prefix", "checkpoint.s3-uri")


@recheck("tokenizer.path-required")
def _tokenizer_path(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    tk = job_config.kubetitan.tokenizer
    if tk.source == "path" and not (tk.path and (Path(tk.path) / "tokenizer.json").is_file()):
        raise ConfigError("kubetitan.tokenizer.path (spec.tokenizer.path)", f"no tokenizer.json in {tk.path or '(unset)'}",
                          "point it at a directory holding tokenizer.json inside the image or a mounted volume",
                          "tokenizer.path-required")
