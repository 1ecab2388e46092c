"""Chunked loss (``precision.lossChunks``): the output projection and the cross entropy in chunks of the batch's tokens,
each chunk's gradient computed in the forward pass, so that the logits of the whole batch never exist.

torchtitan's model returns the logits, ``tokens x vocab`` in bf16 (3.9 GiB at batch 2, seq 8192 and Llama 3's 128,256
tokens), the compiled loss keeps them for its backward, and the backward makes their gradient as large again, all at
the peak of the step's memory. Here the output projection's ``forward`` passes the final norm's output through, and the
loss (:class:`_ChunkedHeadCrossEntropy`) projects one chunk of tokens at a time: the chunk's logits, its per-token
losses and the gradient of their sum with respect to the logits (``softmax - onehot``, fused by the compiler when the
run compiles its loss), then the gradients of the chunk's hidden states and of the projection's weight. Its backward
only scales those by the incoming gradient (the loss is a sum, so the gradient of every token's loss is the same
scalar). The matrix products are the unchunked ones split by rows: no recompute, the same FLOPs.

The projection runs in the autocast dtype (bf16): the products are plain ``matmul`` s of its weight, so the renderer
keeps it out of FP8 even where ``precision.float8.filterFqns`` would put it there (the spec warns). Its weight's
gradient accumulates in float32 over the chunks, whatever the parameter's dtype. Under FSDP the weight is the
projection's unsharded parameter: torchtitan shards the final norm and the projection together and keeps them
unsharded between forward and backward, so the loss, which runs right after the model, sees it unsharded and
returns the gradient for it, which FSDP then reduce-scatters as it does a linear's. Not with tensor or pipeline
parallelism (the spec refuses both: their losses are computed in pieces).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX

from kubetitan_trainer import compat


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, want_grad: bool):
    """One chunk: each token's cross entropy (at least float32, 0 where ``labels`` is ``IGNORE_INDEX``) and, with
    ``want_grad``, the gradient of their sum with respect to ``logits`` (in ``logits``' dtype). In place on its
    float32 copy of the logits (``logits`` itself when it is float32 or wider: the caller's temporary), so that
    without the compiler it holds about one float32 chunk, not one for each step of ``softmax - onehot``."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    target = x.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - target, 0.0)
    if not want_grad:
        return loss, None
    p = x.sub_(lse.unsqueeze(1)).exp_()  # softmax
    p.scatter_add_(1, safe.unsqueeze(1), -valid.to(p.dtype).unsqueeze(1))  # - onehot (nothing where ignored)
    p.mul_(valid.unsqueeze(1))
    return loss, p.to(logits.dtype)


@functools.cache
def _compiled(backend: str):
    return torch.compile(_chunk_loss_and_grad, backend=backend, dynamic=False)


def _accumulate(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g.T @ h`` into the float32 (or wider) ``grad_w``: on CUDA without a temporary of the weight's size
    (``addmm``'s ``out_dtype``, a CUDA overload in torch 2.11), elsewhere through one."""
    if grad_w.dtype == g.dtype:
        grad_w.addmm_(g.t(), h)
    elif grad_w.is_cuda:
        torch.addmm(grad_w, g.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w.add_(g.t() @ h)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return weight.dtype


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """``(loss sum, per-token losses)`` of ``h @ weight.T`` against ``labels``; the gradients are made in forward,
    only when ``grad_enabled`` (the caller's grad mode: inside ``forward`` it is always off, and
    ``needs_input_grad`` follows ``requires_grad``, which an evaluation under ``no_grad`` keeps)."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunks, chunk_fn, grad_enabled):  # noqa: D417 - see the class docstring
        dtype = _compute_dtype(h, weight)
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[0]), (grad_enabled and ctx.needs_input_grad[1])
        wide = torch.promote_types(dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            hc, w = h.to(dtype), weight.to(dtype)
            n = hc.shape[0]
            step = -(-n // chunks)
            per_token = torch.empty(n, dtype=wide, device=h.device)
            grad_h = torch.empty_like(hc) if need_h else None
            # float32 whatever the parameter's dtype: rounding a running bf16 sum once per chunk loses precision
            # with every chunk (the unchunked product rounds once)
            grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_w else None
            for start in range(0, n, step):
                rows = slice(start, min(start + step, n))
                loss, g = chunk_fn(hc[rows] @ w.t(), labels[rows], need_h or need_w)
                per_token[rows] = loss
                if grad_h is not None:
                    torch.matmul(g, w, out=grad_h[rows])
                if grad_w is not None:
                    _accumulate(grad_w, g, hc[rows])
                del g
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.used = False
        ctx.mark_non_differentiable(per_token)
        return per_token.sum(), per_token

    @staticmethod
    def backward(ctx, grad_sum, _grad_per_token):
        if ctx.used:
            raise RuntimeError("precision.lossChunks: the chunked loss's gradients were made for one backward pass; "
                               "it cannot be differentiated twice")
        ctx.used = True  # the saved gradients are scaled in place: no second copy of the weight's gradient
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_sum.to(torch.float32 if grad_sum.dtype != torch.float64 else torch.float64)
        out_h = None if grad_h is None else (grad_h.to(scale.dtype) * scale).to(ctx.dtypes[0])
        out_w = None if grad_w is None else grad_w.mul_(scale).to(ctx.dtypes[1])
        return out_h, out_w, None, None, None, None


class ChunkedHead:
    """The output projection of one model, applied by the loss in ``chunks`` chunks (see the module docstring)."""

    def __init__(self, head: torch.nn.Module, chunks: int, compile_backend: str | None) -> None:
        self.head, self.chunks = head, chunks
        self.chunk_fn = _compiled(compile_backend) if compile_backend else _chunk_loss_and_grad

    def per_token(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum, per-token losses)`` of the batch: ``hidden`` is the model's output ``[batch, seq, dim]``."""
        weight = self.head.weight
        if isinstance(weight, DTensor):
            raise RuntimeError(
                "precision.lossChunks: the output projection's weight is sharded when the loss runs (FSDP resharded it "
                "after the forward pass, or it is tensor-parallel); set precision.lossChunks to 0")
        return _ChunkedHeadCrossEntropy.apply(hidden.flatten(0, 1), weight, labels.flatten(0, 1), self.chunks,
                                              self.chunk_fn, torch.is_grad_enabled())


def install(model: torch.nn.Module, loss_fn: Any, chunks: int, compile_backend: str | None) -> ChunkedHead:
    """Make ``model``'s output projection pass the final norm's output through and ``loss_fn`` (a
    :class:`kubetitan_trainer.source_loss.SourceLoss`) project it in ``chunks`` chunks. Parameter names, hooks (FSDP's)
    and checkpoints are unchanged: only the projection's ``forward`` is replaced."""
    head = getattr(model, "output", None)
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise RuntimeError("precision.lossChunks: the model has no output projection on this rank "
                           "(pipeline parallelism?); set precision.lossChunks to 0")
    if type(head).__name__ == "Float8Linear":  # the renderer keeps it out of FP8 (kubetitan_core.render._float8)
        raise RuntimeError("precision.lossChunks: the output projection was converted to FP8 (Float8Linear), whose "
                           "weight FSDP may all-gather in FP8; add \"output\" to quantize.linear.float8.filter_fqns")
    chunked = ChunkedHead(head, chunks, compile_backend)
    compat.set_forward(head, _passthrough)
    loss_fn.bind_head(chunked)
    return chunked


def _passthrough(h: torch.Tensor) -> torch.Tensor:
    """The output projection's ``forward`` under a chunked loss: the loss projects (``ChunkedHead.per_token``)."""
    return h
