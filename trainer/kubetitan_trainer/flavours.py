"""The model flavours of the ``kubetitan_llama3`` TrainSpec and a job's model args, with nothing of the TrainSpec's
data, tokenizer or checks: those modules, and ``train_spec`` that builds the TrainSpec from them, import this one.

torchtitan's Llama 3 flavours, plus 1B and 3B (Llama 3.2) and ``custom`` (dimensions from ``[kubetitan.model]``).
"""

from __future__ import annotations

import dataclasses

from torchtitan.config import JobConfig
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.protocols.train_spec import get_train_spec

from kubetitan_core.catalog import FLAVOURS
from kubetitan_core.render import TRAIN_SPEC_NAME

from kubetitan_trainer.errors import ConfigError


@dataclasses.dataclass
class KubetitanModelArgs(TransformerModelArgs):
    """A flavour's args; with document masking (``[kubetitan.data] attention_mask = "document"``) torchtitan's own
    switch to block-causal flex attention (``attn_type``, ``attn_mask_type``: :mod:`kubetitan_trainer.doc_mask`)."""

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        super().update_from_config(job_config, **kwargs)
        if job_config.kubetitan.data.attention_mask == "document":
            self.attn_type, self.attn_mask_type = "flex", "block_causal"


def kubetitan_args(args: TransformerModelArgs) -> KubetitanModelArgs:
    """``args`` as :class:`KubetitanModelArgs` (the same values)."""
    return KubetitanModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})


@dataclasses.dataclass
class CustomTransformerModelArgs(KubetitanModelArgs):
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
    """torchtitan's Llama 3 flavours, plus 1B, 3B (Llama 3.2) and ``custom`` (a new table each call)."""
    args = {name: kubetitan_args(a) for name, a in llama3_args.items()}
    for name in ("1B", "3B"):
        args[FLAVOURS[name][0]] = kubetitan_args(_llama32(FLAVOURS[name][1]))
    args["custom"] = CustomTransformerModelArgs()
    return args


def model_args_for(job_config: JobConfig) -> TransformerModelArgs:
    """The (configured) model args of the job's flavour; ConfigError for an unknown flavour. kubetitan's own
    TrainSpec's flavours are :func:`model_args` (what ``train_spec`` registers), read without registering it; any
    other ``model.name`` is looked up in torchtitan's registry."""
    name = job_config.model.name
    table = model_args() if name == TRAIN_SPEC_NAME else get_train_spec(name).model_args
    flavor = job_config.model.flavor
    if flavor not in table:
        raise ConfigError("model.flavor (spec.model.flavor)", f"unknown flavour {flavor!r}",
                          f"use one of {', '.join(sorted(table))}")
    args = dataclasses.replace(table[flavor])
    if isinstance(args, CustomTransformerModelArgs):
        apply_custom_dims(args, job_config)
    return args
