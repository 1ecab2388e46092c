"""The ``kubetitan_llama3`` TrainSpec: torchtitan's Llama 3 plus kubetitan's flavours, data and metrics.

One change to the training core: with compile on and the output projection in FP8
(``precision.float8.filterFqns`` without ``output``), the final norm and the output projection are
compiled too (:func:`compile_fp8_head`). torchtitan 0.2.2 compiles only the transformer blocks, so an
FP8 head runs torchao's casts eagerly, through float32 temporaries of the logits' size (out of
memory at 3B, batch 4, on an H200; docs/benchmarks.md).

Registered at import through ``torchtitan.protocols.train_spec.register_train_spec``. The worker
entry point imports this module; plain torchtitan runs load it with
``--experimental.custom_import kubetitan_trainer.train_spec``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from torchtitan.config import JobConfig
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools.logging import logger

from kubetitan_core.catalog import FLAVOURS
from kubetitan_core.render import TRAIN_SPEC_NAME

from kubetitan_trainer import compat, cpu_bridge
from kubetitan_trainer.data import build_dataloader
from kubetitan_trainer.errors import ConfigError
from kubetitan_trainer.evaluation import build_validator
from kubetitan_trainer.metrics import build_metrics_processor
from kubetitan_trainer.tokenizer import build_tokenizer


@dataclasses.dataclass
class CustomTransformerModelArgs(TransformerModelArgs):
    """The ``custom`` flavour: Llama 3 dimensions read from ``[kubetitan.model]``."""

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        apply_custom_dims(self, job_config)
        super().update_from_config(job_config, **kwargs)


def apply_custom_dims(args: TransformerModelArgs, job_config: JobConfig) -> None:
    m = job_config.kubetitan.model
    if m.dim % m.n_heads:
        raise ConfigError("kubetitan.model.dim (spec.model.custom.dim)", f"{m.dim} is not divisible by n_heads {m.n_heads}",
                          "choose dim as a multiple of nHeads")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("kubetitan.model.n_kv_heads (spec.model.custom.nKvHeads)",
                          f"{m.n_kv_heads} does not divide n_heads {m.n_heads}", "choose a divisor of nHeads")
    args.dim, args.n_layers, args.n_heads, args.n_kv_heads = m.dim, m.n_layers, m.n_heads, m.n_kv_heads
    args.ffn_dim_multiplier, args.multiple_of = m.ffn_dim_multiplier, m.multiple_of
    args.rope_theta, args.vocab_size = m.rope_theta, m.vocab_size


def _llama32(dims) -> TransformerModelArgs:
    # Llama 3.2 1B/3B: rope scaling factor 32 (3.1 uses 8); embeddings untied in torchtitan's Transformer.
    return TransformerModelArgs(
        dim=dims.dim, n_layers=dims.n_layers, n_heads=dims.n_heads, n_kv_heads=dims.n_kv_heads,
        ffn_dim_multiplier=dims.ffn_dim_multiplier, multiple_of=dims.multiple_of, rope_theta=dims.rope_theta,
        vocab_size=dims.vocab_size, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0),
    )


def model_args() -> dict[str, TransformerModelArgs]:
    """torchtitan's Llama 3 flavours, plus 1B, 3B (Llama 3.2) and ``custom``."""
    args = dict(llama3_args)
    for name in ("1B", "3B"):
        args[FLAVOURS[name][0]] = _llama32(FLAVOURS[name][1])
    args["custom"] = CustomTransformerModelArgs()
    return args


def compile_fp8_head(model: torch.nn.Module, job_config: JobConfig) -> bool:
    """Compile the final norm and the output projection when the projection is an FP8 linear.

    Only their ``forward`` is compiled (hooks such as FSDP's stay eager) and the modules stay in
    place, so parameter names and checkpoints do not change. Inductor then fuses torchao's amax,
    scale and cast of the logits' gradient into two kernels with FP8 outputs, instead of the eager
    ``abs``/``float()``/``clamp`` passes over a float32 copy of the logits. Returns whether it did.
    """
    c = job_config.compile
    if not (c.enable and "model" in c.components):
        return False
    from torchao.float8.float8_linear import Float8Linear

    head = getattr(model, "output", None)
    if not isinstance(head, Float8Linear):
        return False
    for module in (getattr(model, "norm", None), head):
        if module is not None:
            module.forward = torch.compile(module.forward, backend=c.backend, fullgraph=True)
    logger.info("Compiling the final norm and the FP8 output projection with torch.compile")
    return True


def wrap_parallelize(parallelize_fn: Callable) -> Callable:
    """torchtitan's parallelize (with the CPU bridge), then :func:`compile_fp8_head`."""
    parallelize_fn = cpu_bridge.wrap_parallelize(parallelize_fn)

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config, *args, **kwargs):
        model = parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)
        compile_fp8_head(model, job_config)
        return model

    return parallelize


def build_train_spec() -> TrainSpec:
    base = llama3_train_spec()
    return dataclasses.replace(
        base,
        model_args=model_args(),
        parallelize_fn=wrap_parallelize(base.parallelize_fn),
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_metrics_processor_fn=build_metrics_processor,
        build_validator_fn=build_validator,
    )


def model_args_for(job_config: JobConfig) -> TransformerModelArgs:
    """The (configured) model args of the job's flavour; ConfigError for an unknown flavour."""
    spec = get_train_spec(job_config.model.name)
    flavor = job_config.model.flavor
    if flavor not in spec.model_args:
        raise ConfigError("model.flavor (spec.model.flavor)", f"unknown flavour {flavor!r}",
                          f"use one of {', '.join(sorted(spec.model_args))}")
    args = dataclasses.replace(spec.model_args[flavor])
    if isinstance(args, CustomTransformerModelArgs):
        apply_custom_dims(args, job_config)
    return args


def register() -> None:
    """Register the TrainSpec once (torchtitan rejects duplicates)."""
    if not compat.train_spec_registered(TRAIN_SPEC_NAME):
        register_train_spec(TRAIN_SPEC_NAME, build_train_spec())


register()
