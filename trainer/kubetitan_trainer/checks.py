"""Static checks of a parsed job config before any process group exists (exit code 2 on failure).

Each check names the torchtitan key and the LlamaPretrain field it comes from, and the fix.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.config import JobConfig

from kubetitan_trainer.errors import ConfigError


def check(job_config: JobConfig, world_size: int, cuda: bool) -> None:
    """Raise the first :class:`ConfigError` found."""
    from kubetitan_trainer.train_spec import model_args_for
    from kubetitan_core.render import TRAIN_SPEC_NAME

    if job_config.model.name != TRAIN_SPEC_NAME:
        raise ConfigError("model.name", f"is {job_config.model.name!r}", f"set it to {TRAIN_SPEC_NAME!r} (kubetitan's TrainSpec)")
    model_args_for(job_config)  # unknown flavour, bad custom dims
    t, p = job_config.training, job_config.parallelism
    if t.steps < 1:
        raise ConfigError("training.steps (spec.training.steps)", f"is {t.steps}", "set at least 1")
    if t.seq_len < 2:
        raise ConfigError("training.seq_len (spec.training.seqLen)", f"is {t.seq_len}", "set at least 16")
    others = p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    dp_shard = p.data_parallel_shard_degree
    if world_size % others:
        raise ConfigError(
            "parallelism (spec.parallelism)",
            f"replicate x tensor x pipeline x context degrees = {others} does not divide the {world_size} training processes",
            "make the product of the degrees equal nodes x processesPerNode",
        )
    if dp_shard == -1:
        dp_shard = world_size // others
    if dp_shard * others != world_size:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree (spec.parallelism.dataParallelShardDegree)",
            f"{dp_shard} x {others} (other degrees) != {world_size} training processes",
            f"set it to {world_size // others} or -1",
        )
    dp = dp_shard * p.data_parallel_replicate_degree
    if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
        raise ConfigError(
            "training.global_batch_size (spec.training.globalBatchSize)",
            f"{t.global_batch_size} is not a multiple of local batch {t.local_batch_size} x data-parallel degree {dp}",
            f"use a multiple of {t.local_batch_size * dp}",
        )
    if "quantize.linear.float8" in job_config.model.converters:
        f8 = job_config.quantize.linear.float8
        if not cuda and not f8.emulate:
            raise ConfigError(
                "quantize.linear.float8.emulate (spec.precision.float8.emulate)",
                "FP8 is on but there is no GPU",
                "set emulate: true for CPU runs, or run on H100/H200/L40S GPUs",
            )
        if f8.emulate and job_config.compile.enable and "model" in job_config.compile.components:
            raise ConfigError(
                "compile.enable (spec.precision.compile)",
                "torchao's FP8 emulation only runs in eager mode",
                "set compile: false when float8.emulate is true",
            )
        if f8.enable_fsdp_float8_all_gather and f8.recipe_name is not None:
            raise ConfigError(
                "quantize.linear.float8.enable_fsdp_float8_all_gather (spec.precision.float8.fsdpFloat8AllGather)",
                f"needs the plain tensorwise path, but recipe_name is {f8.recipe_name}",
                "set recipe: tensorwise (rendered without recipe_name) or turn fsdpFloat8AllGather off",
            )
    d = job_config.kubetitan.data
    if d.source == "shards":
        if not d.shards_path:
            raise ConfigError("kubetitan.data.shards_path (spec.data.shards.path)", "is empty",
                              "set it to a directory written by `kubetitan prepare-data`")
        from kubetitan_trainer.data import read_index

        read_index(d.shards_path)
    if d.source == "huggingface" and d.hf_dataset.startswith("/") and not Path(d.hf_dataset).exists():
        raise ConfigError("kubetitan.data.hf_dataset (spec.data.huggingface.dataset)",
                          f"the local path {d.hf_dataset} does not exist",
                          "mount the volume that holds it (spec.data.volume) or fix the path")
    tk = job_config.kubetitan.tokenizer
    if tk.source == "path" and not (Path(tk.path) / "tokenizer.json").is_file():
        raise ConfigError("kubetitan.tokenizer.path (spec.tokenizer.path)", f"no tokenizer.json in {tk.path or '(unset)'}",
                          "point it at a directory holding tokenizer.json inside the image or a mounted volume")
    if not 0 <= job_config.kubetitan.metrics_port <= 65535:
        raise ConfigError("kubetitan.metrics_port (spec.monitoring.metricsPort)", "is out of range", "use 1024-65535")
