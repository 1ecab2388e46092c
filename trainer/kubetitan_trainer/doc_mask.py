"""Document masking (``[kubetitan.data] attention_mask = "document"``): block-causal attention at the document
boundaries the shards' ``.idx`` files store, through torchtitan's flex attention (docs/data.md, "Document masking").

- **The switch** is torchtitan's: every flavour's args are :class:`~kubetitan_trainer.flavours.KubetitanModelArgs`,
  which set ``attn_type = "flex"`` and ``attn_mask_type = "block_causal"`` for such a job, so the model builds
  ``FlexAttentionWrapper`` modules and the trainer (and the validator) ask the model for its masks before each
  forward (``post_dataloading_process`` -> ``get_attention_masks``).
- **The masks**: :class:`DocumentMaskedTransformer` (the TrainSpec's ``model_cls``) answers ``get_attention_masks``
  from the loader's segment ids (``data.SEGMENT_KEY``: the document of each input token within its sample, read from
  the ``.idx``) rather than torchtitan's search for EOS tokens, which would also split a document whose text holds the
  EOS token's string; it takes the loader's tags out of the forward's keyword arguments.
- **CPU**: torch 2.11's FlexAttention has no backward on CPU (``NotImplementedError: FlexAttention does not support
  backward on CPU``) and torchtitan builds its block masks for ``cuda``. Without a GPU each attention module's
  ``inner_attention`` is :class:`DenseMaskAttention` (the same mask, materialised once per batch as a boolean matrix,
  through ``scaled_dot_product_attention``), and the block mask is built on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, create_mask
from torchtitan.models.attention import create_attention_mask, get_causal_mask_mod
from torchtitan.models.llama3.model.model import Transformer

from kubetitan_trainer import cpu_bridge
from kubetitan_trainer.data.loaders import SEGMENT_KEY, SOURCE_KEY

TAGS = (SOURCE_KEY, SEGMENT_KEY)


def segment_mask_mod(segments: torch.Tensor):
    """flex attention's ``mask_mod``: query and key in the same document (``segments``: [batch, seq] ids)."""

    def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return segments[b, q_idx] == segments[b, kv_idx]

    return same_document


def document_block_mask(segments: torch.Tensor) -> BlockMask:
    """The block-causal BlockMask of a batch whose tokens belong to the documents ``segments`` says."""
    b, s = segments.shape
    mask_mod = and_masks(get_causal_mask_mod(), segment_mask_mod(segments))
    if segments.device.type == "cpu":  # torchtitan's compiled builder targets cuda
        return create_block_mask(mask_mod, b, None, s, s, device="cpu")
    return create_attention_mask(mask_mod, b, None, s, s, device=segments.device)


class DenseMaskAttention(torch.nn.Module):
    """FlexAttentionWrapper's interface on CPU: the block mask's ``mask_mod`` as a boolean matrix (made once per
    mask) through scaled-dot-product attention, which has a backward on CPU."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask,
                scale: float | None = None, enable_gqa: bool = False, **_: Any) -> torch.Tensor:
        dense = getattr(block_mask, "kubetitan_dense", None)
        if dense is None:
            b, s = q.shape[0], q.shape[2]
            dense = create_mask(block_mask.mask_mod, b, 1, s, k.shape[2], device=q.device)
            block_mask.kubetitan_dense = dense  # every layer of this batch uses the same mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=enable_gqa)


class DocumentMaskedTransformer(Transformer):
    """torchtitan's Llama 3 Transformer whose block-causal masks come from the ``.idx`` (see the module docstring)."""

    def __init__(self, model_args) -> None:
        super().__init__(model_args)
        if model_args.attn_type == "flex" and cpu_bridge.needed():
            for block in self.layers.values():
                block.attention.inner_attention = DenseMaskAttention()

    def get_attention_masks(self, input_batch: torch.Tensor, tokenizer, extra_inputs: dict | None = None):
        segments = (extra_inputs or {}).get(SEGMENT_KEY)
        if segments is not None and self.model_args.attn_mask_type == "block_causal":
            return document_block_mask(segments.to(input_batch.device))
        return super().get_attention_masks(input_batch, tokenizer, extra_inputs)

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None, **tags):
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        return super().forward(tokens, attention_masks, positions)
