"""Spec -> the trainer's config file (``trainer.toml``).

The file is a torchtitan 0.2.2 job config (the same TOML you would pass to
``torchtitan.train --job.config_file``) plus one ``[kubetitan]`` table, typed in
``kubetitan_core.contract.trainer_toml`` and declared to torchtitan through its ``job.custom_config_module``
extension point (``kubetitan_trainer.job_config``). Keys are torchtitan's own; a contract test parses every
rendered example with torchtitan's ``ConfigManager``.

Pure: no I/O, no torch.
"""

from __future__ import annotations

from typing import Any

import tomli_w

from kubetitan_core import contract
from kubetitan_core.api import (HuggingFaceDataSpec, LlamaPretrain, LlamaPretrainSpec, S3Access, reads_s3_shards,
                                resolved_dp_shard, weight_schedules)
from kubetitan_core.catalog import FLAVOURS, INSTANCE_TYPES
from kubetitan_core.contract.trainer_toml import (Kubetitan, KubetitanCheckpointStorage, KubetitanData,
                                                  KubetitanDataS3, KubetitanModel, KubetitanPreflight, KubetitanRuntime,
                                                  KubetitanTokenizer, to_table)

TRAIN_SPEC_NAME = "kubetitan_llama3"
"""The torchtitan TrainSpec the trainer registers (Llama 3 + kubetitan's data and metrics)."""
CUSTOM_CONFIG_MODULE = "kubetitan_trainer.job_config"


def trainer_config(lpt: LlamaPretrain, dump_folder: str | None = None,
                   kubetitan: Kubetitan | None = None) -> dict[str, Any]:
    """The trainer config as a dict of TOML tables.

    ``dump_folder`` overrides where checkpoints, TensorBoard logs and traces go; it defaults
    to the checkpoint mount inside the pod (local runs pass a directory of their own). ``kubetitan``: the
    ``[kubetitan]`` table to write instead of :func:`kubetitan_table`'s (``kubetitan run`` changes its metrics
    endpoint).
    """
    s: LlamaPretrainSpec = lpt.spec
    meta = lpt.metadata
    cfg: dict[str, Any] = {
        "job": {
            "dump_folder": dump_folder or s.checkpoint.mount_path,
            "description": f"{meta.namespace or 'default'}/{meta.name}",
            "custom_config_module": CUSTOM_CONFIG_MODULE,
        },
        **_training_tables(s),
        **_runtime_tables(s),
    }
    if s.data.eval is not None:
        # torchtitan's own validation loop (kubetitan's held-out loader, kubetitan_trainer.evaluation); steps -1:
        # the whole held-out set, finite and equal on every rank.
        cfg["validation"] = {"enable": True, "freq": s.data.eval.interval_steps, "steps": -1}
    if s.training.decay_ratio is not None:
        cfg["lr_scheduler"]["decay_ratio"] = s.training.decay_ratio
    if s.training.seed is not None:
        cfg["debug"] = {"seed": s.training.seed}
    if s.precision.float8.enabled:
        cfg["quantize"] = {"linear": {"float8": _float8(s)}}
    cfg["kubetitan"] = to_table(kubetitan or kubetitan_table(lpt))
    return cfg


def _training_tables(s: LlamaPretrainSpec) -> dict[str, Any]:
    """torchtitan's ``model``, ``optimizer``, ``lr_scheduler``, ``training`` and ``parallelism`` tables."""
    t, p, pr = s.training, s.parallelism, s.precision
    return {
        "model": {
            "name": TRAIN_SPEC_NAME,
            "flavor": "custom" if s.model.flavor == "custom" else FLAVOURS[s.model.flavor][0],
            "converters": ["quantize.linear.float8"] if pr.float8.enabled else [],
        },
        "optimizer": {
            "name": "AdamW",
            "lr": t.learning_rate,
            "eps": 1e-8,
            "weight_decay": t.weight_decay,
        },
        "lr_scheduler": {
            "warmup_steps": t.warmup_steps,
            "decay_type": t.decay_type,
            "min_lr_factor": t.min_lr_factor,
        },
        "training": {
            "local_batch_size": t.local_batch_size,
            "global_batch_size": t.global_batch_size or -1,
            "seq_len": t.seq_len,
            "max_norm": t.max_norm,
            "steps": t.steps,
            "mixed_precision_param": pr.mixed_precision_param,
            "dataset": f"kubetitan_{s.data.source}",
        },
        "parallelism": {
            "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
            "data_parallel_shard_degree": p.data_parallel_shard_degree,
            "tensor_parallel_degree": p.tensor_parallel_degree,
            "pipeline_parallel_degree": p.pipeline_parallel_degree,
            "context_parallel_degree": p.context_parallel_degree,
        },
    }


def _runtime_tables(s: LlamaPretrainSpec) -> dict[str, Any]:
    """torchtitan's ``checkpoint``, ``activation_checkpoint``, ``compile``, ``metrics`` and ``comm`` tables."""
    pr, ck, mon = s.precision, s.checkpoint, s.monitoring
    return {
        "checkpoint": {
            "enable": ck.enabled,
            "folder": contract.CHECKPOINT_SUBDIR,
            "interval": ck.interval_steps,
            "async_mode": ck.async_mode,
            "keep_latest_k": ck.keep_latest_k,
            # A final checkpoint must be resumable too (torchtitan's default saves weights only).
            "last_save_model_only": False,
        },
        "activation_checkpoint": {
            "mode": pr.activation_checkpointing,
            "selective_ac_option": pr.selective_activation_checkpointing,
        },
        "compile": {"enable": pr.compile, "components": ["model", "loss"]},
        "metrics": {
            "log_freq": mon.log_frequency_steps,
            "enable_tensorboard": mon.tensorboard,
            "save_tb_folder": "tb",
            # Plain step lines: the end of the log becomes the pod's termination message, and from it the
            # restart's message in status.restarts and its Event (colour codes made them unreadable there).
            "disable_color_printing": True,
        },
        "comm": {
            # Let a stuck collective crash the process well before the operator's own hang
            # detector fires, so that the cause is a clear error in the log.
            "init_timeout_seconds": s.run_policy.startup_timeout_seconds,
            "train_timeout_seconds": max(60, s.run_policy.hang_timeout_seconds // 2),
        },
    }


def _float8(s: LlamaPretrainSpec) -> dict[str, Any]:
    """``[quantize.linear.float8]``; FSDP FP8 all-gather and precomputed scales only where FSDP shards (dp_shard > 1)."""
    f8 = s.precision.float8
    dp_shard = resolved_dp_shard(s) or 1
    float8: dict[str, Any] = {}
    if f8.recipe != "tensorwise":
        # torchtitan 0.2.2: any recipe_name selects torchao's recipe path, which rejects FSDP FP8
        # all-gather; tensorwise with all-gather is the plain (recipe_name unset) path.
        float8["recipe_name"] = f8.recipe
    return {
        **float8,
        "enable_fsdp_float8_all_gather": f8.fsdp_float8_all_gather and dp_shard > 1,
        "precompute_float8_dynamic_scale_for_fsdp": f8.precompute_dynamic_scale and dp_shard > 1,
        "filter_fqns": _float8_filter(s),
        "emulate": f8.emulate,
    }


def _float8_filter(s: LlamaPretrainSpec) -> list[str]:
    """``filter_fqns``: the spec's, plus ``output`` under ``precision.lossChunks`` (the chunked loss multiplies by the
    projection's weight itself, in bf16: an FP8 projection would only convert, and all-gather, a weight it never
    uses as FP8; the spec warns, ``precision.loss-chunks-fp8-head``)."""
    f8 = s.precision.float8
    return list(f8.filter_fqns) + (["output"] if s.precision.loss_chunks > 1 and not f8.filters_output() else [])


def efa_per_node(s: LlamaPretrainSpec) -> int:
    """EFA interfaces each pod requests: the spec's count, else the instance type's on eks/hyperpod."""
    r = s.resources
    if r.efa_per_node is not None:
        return r.efa_per_node
    if r.platform in ("eks", "hyperpod") and r.instance_type in INSTANCE_TYPES and r.gpus_per_node > 0:
        return INSTANCE_TYPES[r.instance_type].efa
    return 0


def _mixture(s: LlamaPretrainSpec) -> dict[str, Any]:
    """A mixture as parallel lists (one entry per source): a shards source's path and dtype, a hub source's dataset
    in ``mixture_paths`` and its settings in the ``mixture_hf_*`` lists (set only when a hub source is there); weight
    schedules as flat lists of points (``mixture_schedule_*``, set only when a source has one; percentages resolved
    to steps)."""
    mixture = s.data.mixture
    hub = [m.huggingface for m in mixture]
    keys: dict[str, Any] = {
        "mixture_paths": [m.shards.path if m.shards else h.dataset for m, h in zip(mixture, hub)],  # type: ignore[union-attr]
        "mixture_weights": [m.weight for m in mixture],
        "mixture_names": [m.name or "" for m in mixture],
        "mixture_dtypes": [m.shards.dtype if m.shards else "auto" for m in mixture],
    }
    if any(hub):
        keys.update({"mixture_kinds": ["huggingface" if h else "shards" for h in hub],
                     "mixture_hf_configs": [(h.config or "") if h else "" for h in hub],
                     "mixture_hf_splits": [h.split if h else "" for h in hub],
                     "mixture_hf_text_fields": [h.text_field if h else "" for h in hub],
                     "mixture_hf_streaming": [h.streaming if h else True for h in hub]})
    if any(m.schedule for m in mixture):
        schedules = weight_schedules(s)
        points = [(i, step, w) for i, sch in enumerate(schedules) for step, w in sch.points]
        keys.update({"mixture_schedule_interpolations": [sch.interpolation if m.schedule else ""
                                                         for m, sch in zip(mixture, schedules)],
                     "mixture_schedule_sources": [p[0] for p in points],
                     "mixture_schedule_steps": [p[1] for p in points],
                     "mixture_schedule_weights": [p[2] for p in points]})
    return keys


def _data(s: LlamaPretrainSpec) -> KubetitanData:
    """``[kubetitan.data]``: the source and its settings, the read order, the held-out evaluation."""
    d = s.data
    keys: dict[str, Any] = {"source": d.source, "order": d.order, "ledger": d.ledger, "attention_mask": d.attention_mask}
    if d.source == "huggingface":
        hf = d.huggingface or HuggingFaceDataSpec()
        keys.update(hf_dataset=hf.dataset, hf_config=hf.config or "", hf_split=hf.split, hf_streaming=hf.streaming,
                    hf_text_field=hf.text_field)
    if d.source == "shards" and d.shards is not None:
        keys.update(shards_path=d.shards.path, shards_dtype=d.shards.dtype)
    if d.source == "mixture" and d.mixture:
        keys.update(_mixture(s))
    if d.eval is not None:
        keys["eval_samples"] = d.eval.samples
        if d.eval.shards is not None:
            keys["eval_shards_path"] = d.eval.shards.path
        else:
            keys["held_out_percent"] = d.eval.held_out_percent
    return KubetitanData(**keys)


def _model(s: LlamaPretrainSpec) -> KubetitanModel:
    """``[kubetitan.model]``: the custom flavour's dimensions (the defaults for a named flavour, which ignores them)."""
    c = s.model.custom
    if s.model.flavor != "custom" or c is None:
        return KubetitanModel()
    return KubetitanModel(dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads or c.n_heads,
                          ffn_dim_multiplier=c.ffn_dim_multiplier or 1.0, multiple_of=c.multiple_of,
                          rope_theta=c.rope_theta, vocab_size=c.vocab_size)


def _storage(s: LlamaPretrainSpec) -> tuple[KubetitanCheckpointStorage, KubetitanDataS3]:
    """``[kubetitan.checkpoint_storage]`` (checkpoints in S3; ``job.dump_folder`` stays the pod's local scratch,
    kubetitan_trainer.storage; the failed-saves budget of any storage) and ``[kubetitan.data_s3]`` (s3:// shards staged to the pod's staging emptyDir,
    kubetitan_trainer.data.s3shards); each the defaults when not used."""
    ck_s3 = s.checkpoint.storage.s3
    checkpoints = KubetitanCheckpointStorage(max_failed_saves=s.checkpoint.max_failed_saves)
    if s.checkpoint.enabled and ck_s3 is not None:
        checkpoints = KubetitanCheckpointStorage(s3_uri=ck_s3.uri, region=ck_s3.region, endpoint=ck_s3.endpoint or "",
                                                 force_path_style=ck_s3.force_path_style,
                                                 max_failed_saves=s.checkpoint.max_failed_saves)
    data = KubetitanDataS3()
    if reads_s3_shards(s):
        ds3 = s.data.s3 or S3Access()
        data = KubetitanDataS3(region=ds3.region, endpoint=ds3.endpoint or "", force_path_style=ds3.force_path_style,
                               stage_dir=contract.DATA_STAGE_MOUNT)
    return checkpoints, data


def _runtime(s: LlamaPretrainSpec) -> KubetitanRuntime:
    """``[kubetitan.runtime]``: ``spec.runtime``, field for field."""
    return KubetitanRuntime(**s.runtime.model_dump())


def kubetitan_table(lpt: LlamaPretrain) -> Kubetitan:
    """The ``[kubetitan]`` table of ``lpt``, typed (:mod:`kubetitan_core.contract.trainer_toml`): what torchtitan's
    own sections cannot say."""
    s = lpt.spec
    tok = s.tokenizer
    checkpoint_storage, data_s3 = _storage(s)
    return Kubetitan(
        job_name=lpt.metadata.name,
        namespace=lpt.metadata.namespace or "default",
        metrics_port=s.monitoring.metrics_port,
        gpu_product=s.resources.gpu_product or "",
        instance_type=s.resources.instance_type or "",
        platform=s.resources.platform,
        efa_per_node=efa_per_node(s),
        network_fallback=s.resources.network_fallback,
        requested_fsdp_float8_all_gather=s.precision.float8.fsdp_float8_all_gather,
        requested_precompute_float8_scale=s.precision.float8.precompute_dynamic_scale,
        data=_data(s),
        tokenizer=KubetitanTokenizer(source=tok.source, path=tok.path or "", repo=tok.repo or ""),
        model=_model(s),
        checkpoint_storage=checkpoint_storage,
        data_s3=data_s3,
        preflight=KubetitanPreflight(enabled=s.run_policy.preflight == "Enabled", gpus=s.resources.gpus_per_node),
        runtime=_runtime(s),
        inprocess_restarts=s.run_policy.in_process_restarts,
        inprocess_progress_timeout_seconds=s.run_policy.in_process_hang_seconds or 0,
        loss_chunks=s.precision.loss_chunks,
    )


def trainer_toml(lpt: LlamaPretrain, dump_folder: str | None = None) -> str:
    """The rendered ``trainer.toml`` text."""
    header = (
        f"# Rendered by kubetitan for LlamaPretrain {lpt.metadata.namespace or 'default'}/"
        f"{lpt.metadata.name}. torchtitan 0.2.2 keys plus [kubetitan]; do not edit.\n"
    )
    return header + tomli_w.dumps(trainer_config(lpt, dump_folder))
