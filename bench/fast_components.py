"""Bench-only model and loss components for torchtitan 0.2.2's Llama 3, same model and same numerics.

Moved out of the trainer package (it was ``kubetitan_trainer.fast``): both lost on the H200 (the
launch-overhead runs, docs/benchmarks.md), so kubetitan's TrainSpec does not use them; the GPU bench still can
(``spec=fast``, ``spec=rope``).

Used through torchtitan's own extension point (a TrainSpec variant: ``fast_train_spec(base)``),
not a fork. Each piece is a drop-in for torchtitan's and is checked against it in ``tests/fast/``
(forward and backward, small shapes, CPU):

- :func:`apply_rotary_emb_real` / :class:`FastAttention`: RoPE on real numbers (cos/sin pairs).
  torchtitan's ``apply_rotary_emb`` goes through ``view_as_complex``; inductor cannot generate
  code for complex tensors, so every block runs those multiplies as separate eager kernels
  (seen in the H200 profile, ``bench/results/gpu/plain_torchtitan_reference``). The real form is the same arithmetic
  (the complex product written out) and fuses into the neighbouring kernels. The cache holds the
  same numbers: ``view_as_real`` of torchtitan's ``freqs_cis``.
- :func:`fused_linear_cross_entropy`: the output projection and the cross-entropy over the
  128k vocabulary in chunks of tokens, with the gradients computed chunk by chunk in the forward
  (as Liger's fused linear cross-entropy does), so that the ``tokens x 128k`` logits (bf16, then
  fp32 in torchtitan's loss) never exist in full: at seq 8192 that is 6 GiB per sample of batch.
  Same FLOPs as the unfused path (no recomputation).
- :class:`FastTransformer`: torchtitan's ``Transformer`` with both; its forward returns
  ``HiddenAndHead(h, output.weight)`` instead of logits, which :func:`build_fused_loss`'s loss
  consumes (torchtitan's train loop only passes ``pred`` from the model to the loss). Parameters,
  names, init and state dict are torchtitan's: checkpoints are interchangeable.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss
from torchtitan.models.llama3.model.model import Attention, Transformer, precompute_freqs_cis
from torchtitan.tools.logging import logger

__all__ = [
    "apply_rotary_emb_real", "FastAttention", "FastTransformer", "HiddenAndHead",
    "fused_linear_cross_entropy", "build_fused_loss", "fast_train_spec", "DEFAULT_CHUNK_TOKENS",
    "RealRopeTransformer",
]

DEFAULT_CHUNK_TOKENS = 4096
"""Tokens per loss chunk: 4096 x 128256 bf16 logits = 1 GiB live at a time."""


# --------------------------------------------------------------------------------------------- RoPE
def rope_cache(head_dim: int, end: int, theta: float, scaling_args) -> torch.Tensor:
    """``(end, head_dim // 2, 2)`` float32 [cos, sin]: ``view_as_real`` of torchtitan's ``freqs_cis``."""
    return torch.view_as_real(precompute_freqs_cis(head_dim, end, theta, scaling_args)).contiguous()


def apply_rotary_emb_real(xq: torch.Tensor, xk: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's ``apply_rotary_emb`` (interleaved pairs, float32 math) without complex numbers.

    ``xq``/``xk``: ``(bs, seqlen, heads, head_dim)``; ``cache``: ``(>= seqlen, head_dim // 2, 2)``.
    (a + ib)(c + id) = (ac - bd) + i(ad + bc), per pair (a, b) = (x[2j], x[2j+1]).
    """
    seqlen = xq.shape[1]
    c = cache[:seqlen, None, :, 0]  # (seqlen, 1, hd/2)
    s = cache[:seqlen, None, :, 1]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)

    return rot(xq), rot(xk)


class FastAttention(Attention):
    """torchtitan's ``Attention`` (same parameters) with :func:`apply_rotary_emb_real`; SDPA only."""

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        if self.attn_type != "sdpa" or positions is not None:
            raise NotImplementedError("FastAttention supports attn_type='sdpa' without positions; use the plain model")
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb_real(xq, xk, freqs_cis)
        out = self.inner_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), enable_gqa=self.enable_gqa)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


# --------------------------------------------------------------------------------------------- loss
class HiddenAndHead(NamedTuple):
    """What :class:`FastTransformer` returns in place of logits: final hidden states and the head."""

    hidden: torch.Tensor  # (bs, seqlen, dim), after the final norm
    weight: torch.Tensor  # (vocab, dim), the output projection's weight


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of cross-entropy over a chunk, and d(sum)/d(logits) in the logits' dtype.

    Math in float32 as torchtitan's loss (``pred.float()``); ignored labels contribute nothing.
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    target = lf.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, 0.0).sum()
    p = torch.exp(lf - lse[:, None])
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == safe[:, None]
    grad = torch.where(valid[:, None], p - onehot.float(), 0.0)
    return loss, grad.to(logits.dtype)


_compiled_chunk = None


def _chunk_fn(compiled: bool):
    global _compiled_chunk
    if not compiled:
        return _chunk_loss_and_grad
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_grad, fullgraph=True)
    return _compiled_chunk


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, compute_dtype, chunk, compiled):
        n = h.shape[0]
        hc_all = h.to(compute_dtype)
        wc = w.to(compute_dtype)
        grad_h = torch.empty_like(hc_all)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        fn = _chunk_fn(compiled)
        low = compute_dtype in (torch.bfloat16, torch.float16) and h.is_cuda
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            hc = hc_all[s:e]
            logits = hc @ wc.t()  # (c, vocab) in compute dtype, as torchtitan's output Linear under autocast
            l, g = fn(logits, labels[s:e])
            del logits
            loss += l
            torch.mm(g, wc, out=grad_h[s:e])
            if low:  # fp32 accumulation in the GEMM's epilogue (beta = 1): no chunk-sized fp32 temporary
                try:
                    torch.addmm(grad_w, g.t(), hc, out_dtype=torch.float32, out=grad_w)
                except (RuntimeError, NotImplementedError):  # a build without addmm(out_dtype=) for this dtype
                    low = False
                    grad_w += (g.t() @ hc).float()
            else:
                grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # In place: both buffers were made for this backward alone (the weight gradient is ~1.6 GB fp32
        # for a 128k vocabulary); the loss's grad_out is a scalar.
        gh = grad_h.mul_(grad_out.to(grad_h.dtype)).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None
        gw = grad_w.mul_(grad_out).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, compute_dtype: torch.dtype | None = None, compiled: bool = False,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=-100)`` in chunks.

    ``compute_dtype``: the matmul dtype; by default the active autocast dtype of the hidden
    states' device (bf16 in torchtitan's single-GPU training), else ``hidden.dtype``.
    """
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    h = hidden.reshape(-1, hidden.shape[-1])
    with torch.autocast(hidden.device.type, enabled=False):
        return _FusedLinearCE.apply(h, weight, labels.reshape(-1), compute_dtype, chunk_tokens, compiled)


def build_fused_loss(job_config, **kwargs):
    """TrainSpec ``build_loss_fn``: fused chunked loss for :class:`HiddenAndHead`, else torchtitan's."""
    del kwargs
    compiled = job_config.compile.enable and "loss" in job_config.compile.components
    plain = torch.compile(cross_entropy_loss, backend=job_config.compile.backend) if compiled else cross_entropy_loss
    logger.info(f"Fused chunked linear + cross-entropy loss ({DEFAULT_CHUNK_TOKENS} tokens a chunk, compiled={compiled})")

    def loss_fn(pred, labels):
        if isinstance(pred, HiddenAndHead):
            return fused_linear_cross_entropy(pred.hidden, pred.weight, labels, compiled=compiled)
        return plain(pred, labels)

    return loss_fn


# --------------------------------------------------------------------------------------------- model
class FastTransformer(Transformer):
    """torchtitan's Llama 3 ``Transformer`` with real-valued RoPE and the head left to the loss.

    ``freqs_cis`` holds ``(max_seq_len, head_dim // 2, 2)`` float32 [cos, sin] instead of complex64.
    ``fuse_head_into_loss`` (default True): forward returns :class:`HiddenAndHead`; set it to
    False for logits (e.g. evaluation or generation).
    """

    fuse_head_into_loss: bool = True

    def __init__(self, model_args):
        super().__init__(model_args)
        for layer in self.layers.values():
            if getattr(layer, "attention", None) is not None:
                layer.attention.__class__ = FastAttention

    def _precompute_freqs_cis(self) -> torch.Tensor:
        a = self.model_args
        return rope_cache(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, a.rope_scaling_args)

    def forward(self, tokens, attention_masks=None, positions=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if self.fuse_head_into_loss and self.training and type(self.output) is torch.nn.Linear:
            return HiddenAndHead(h, self.output.weight)
        return self.output(h)


class RealRopeTransformer(FastTransformer):
    """:class:`FastTransformer` with the real-valued RoPE only: forward returns logits as torchtitan's."""

    fuse_head_into_loss = False


def fast_train_spec(base, fused_loss: bool = True):
    """A copy of a Llama 3 TrainSpec (torchtitan's or kubetitan's) with the components above.

    ``fused_loss=False``: real-valued RoPE only, torchtitan's output projection and loss.
    """
    if not fused_loss:
        return dataclasses.replace(base, model_cls=RealRopeTransformer)
    return dataclasses.replace(base, model_cls=FastTransformer, build_loss_fn=build_fused_loss)
