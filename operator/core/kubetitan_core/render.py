"""Spec -> the trainer's config file (``trainer.toml``).

The file is a torchtitan 0.2.2 job config (the same TOML you would pass to
``torchtitan.train --job.config_file``) plus one ``[kubetitan]`` table that the trainer
declares through torchtitan's ``job.custom_config_module`` extension point
(``kubetitan_trainer.job_config``). Keys are torchtitan's own; a contract test parses every
rendered example with torchtitan's ``ConfigManager``.

Pure: no I/O, no torch.
"""

from __future__ import annotations

from typing import Any

import tomli_w

from kubetitan_core import contract
from kubetitan_core.api import (HuggingFaceDataSpec, LlamaPretrain, LlamaPretrainSpec, MixtureSourceSpec, S3Access,
                                reads_s3_shards, resolved_dp_shard)
from kubetitan_core.catalog import FLAVOURS, INSTANCE_TYPES

TRAIN_SPEC_NAME = "kubetitan_llama3"
"""The torchtitan TrainSpec the trainer registers (Llama 3 + kubetitan's data and metrics)."""
CUSTOM_CONFIG_MODULE = "kubetitan_trainer.job_config"


def trainer_config(lpt: LlamaPretrain, dump_folder: str | None = None) -> dict[str, Any]:
    """The trainer config as a dict of TOML tables.

    ``dump_folder`` overrides where checkpoints, TensorBoard logs and traces go; it defaults
    to the checkpoint mount inside the pod (local runs pass a directory of their own).
    """
    s: LlamaPretrainSpec = lpt.spec
    meta = lpt.metadata
    t, p, pr, ck, mon = s.training, s.parallelism, s.precision, s.checkpoint, s.monitoring
    flavor = "custom" if s.model.flavor == "custom" else FLAVOURS[s.model.flavor][0]
    f8 = pr.float8
    dp_shard = resolved_dp_shard(s) or 1

    converters = ["quantize.linear.float8"] if f8.enabled else []
    cfg: dict[str, Any] = {
        "job": {
            "dump_folder": dump_folder or ck.mount_path,
            "description": f"{meta.namespace or 'default'}/{meta.name}",
            "custom_config_module": CUSTOM_CONFIG_MODULE,
        },
        "model": {
            "name": TRAIN_SPEC_NAME,
            "flavor": flavor,
            "converters": converters,
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
    if s.data.eval is not None:
        # torchtitan's own validation loop (kubetitan's held-out loader, kubetitan_trainer.evaluation); steps -1:
        # the whole held-out set, finite and equal on every rank.
        cfg["validation"] = {"enable": True, "freq": s.data.eval.interval_steps, "steps": -1}
    if t.decay_ratio is not None:
        cfg["lr_scheduler"]["decay_ratio"] = t.decay_ratio
    if t.seed is not None:
        cfg["debug"] = {"seed": t.seed}
    if f8.enabled:
        float8: dict[str, Any] = {}
        if f8.recipe != "tensorwise":
            # torchtitan 0.2.2: any recipe_name selects torchao's recipe path, which rejects FSDP FP8
            # all-gather; tensorwise with all-gather is the plain (recipe_name unset) path.
            float8["recipe_name"] = f8.recipe
        cfg["quantize"] = {
            "linear": {
                "float8": {
                    **float8,
                    "enable_fsdp_float8_all_gather": f8.fsdp_float8_all_gather and dp_shard > 1,
                    "precompute_float8_dynamic_scale_for_fsdp": f8.precompute_dynamic_scale
                    and dp_shard > 1,
                    "filter_fqns": list(f8.filter_fqns),
                    "emulate": f8.emulate,
                }
            }
        }
    cfg["kubetitan"] = _kubetitan_table(lpt)
    return cfg


def efa_per_node(s: LlamaPretrainSpec) -> int:
    """EFA interfaces each pod requests: the spec's count, else the instance type's on eks/hyperpod."""
    r = s.resources
    if r.efa_per_node is not None:
        return r.efa_per_node
    if r.platform in ("eks", "hyperpod") and r.instance_type in INSTANCE_TYPES and r.gpus_per_node > 0:
        return INSTANCE_TYPES[r.instance_type].efa
    return 0


def _mixture_keys(mixture: list[MixtureSourceSpec]) -> dict[str, Any]:
    """A mixture as parallel lists (one entry per source): a shards source's path and dtype, a hub source's dataset
    in ``mixture_paths`` and its settings in the ``mixture_hf_*`` lists (written only when a hub source is there)."""
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
    return keys


# long: a flat mapping of spec fields to [kubetitan] keys, one key per line; splitting it would scatter the table
def _kubetitan_table(lpt: LlamaPretrain) -> dict[str, Any]:
    """The ``[kubetitan]`` table: what torchtitan's own sections cannot say."""
    s = lpt.spec
    d, tok = s.data, s.tokenizer
    table: dict[str, Any] = {
        "job_name": lpt.metadata.name,
        "namespace": lpt.metadata.namespace or "default",
        "metrics_port": s.monitoring.metrics_port,
        "gpu_product": s.resources.gpu_product or "",
        "instance_type": s.resources.instance_type or "",
        "platform": s.resources.platform,
        "efa_per_node": efa_per_node(s),
        "network_fallback": s.resources.network_fallback,
        "requested_fsdp_float8_all_gather": s.precision.float8.fsdp_float8_all_gather,
        "requested_precompute_float8_scale": s.precision.float8.precompute_dynamic_scale,
        "data": {"source": d.source},
        "tokenizer": {"source": tok.source},
    }
    if d.source == "huggingface":
        hf = d.huggingface or HuggingFaceDataSpec()
        table["data"].update(
            {
                "hf_dataset": hf.dataset,
                "hf_config": hf.config or "",
                "hf_split": hf.split,
                "hf_streaming": hf.streaming,
                "hf_text_field": hf.text_field,
            }
        )
    if d.source == "shards" and d.shards is not None:
        table["data"].update({"shards_path": d.shards.path, "shards_dtype": d.shards.dtype})
    if d.source == "mixture" and d.mixture:
        table["data"].update(_mixture_keys(d.mixture))
    table["data"]["order"] = d.order
    if d.eval is not None:
        table["data"]["eval_samples"] = d.eval.samples
        if d.eval.shards is not None:
            table["data"]["eval_shards_path"] = d.eval.shards.path
        else:
            table["data"]["held_out_percent"] = d.eval.held_out_percent
    if reads_s3_shards(s):  # shards staged from S3 to the pod's staging emptyDir (kubetitan_trainer.s3shards)
        ds3 = d.s3 or S3Access()
        table["data_s3"] = {"region": ds3.region, "endpoint": ds3.endpoint or "",
                            "force_path_style": ds3.force_path_style, "stage_dir": contract.DATA_STAGE_MOUNT}
    s3 = s.checkpoint.storage.s3
    if s.checkpoint.enabled and s3 is not None:
        # checkpoints in S3 (kubetitan_trainer.storage); job.dump_folder stays the pod's local scratch
        table["checkpoint_storage"] = {"s3_uri": s3.uri, "region": s3.region, "endpoint": s3.endpoint or "",
                                       "force_path_style": s3.force_path_style}
    if tok.path:
        table["tokenizer"]["path"] = tok.path
    if tok.repo:
        table["tokenizer"]["repo"] = tok.repo
    if s.model.flavor == "custom" and s.model.custom is not None:
        c = s.model.custom
        table["model"] = {
            "dim": c.dim,
            "n_layers": c.n_layers,
            "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads or c.n_heads,
            "ffn_dim_multiplier": c.ffn_dim_multiplier or 1.0,
            "multiple_of": c.multiple_of,
            "rope_theta": c.rope_theta,
            "vocab_size": c.vocab_size,
        }
    return table


def trainer_toml(lpt: LlamaPretrain, dump_folder: str | None = None) -> str:
    """The rendered ``trainer.toml`` text."""
    header = (
        f"# Rendered by kubetitan for LlamaPretrain {lpt.metadata.namespace or 'default'}/"
        f"{lpt.metadata.name}. torchtitan 0.2.2 keys plus [kubetitan]; do not edit.\n"
    )
    return header + tomli_w.dumps(trainer_config(lpt, dump_folder))
