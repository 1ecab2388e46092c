"""bench/fast_components.py against torchtitan 0.2.2's reference implementation (CPU, small shapes).

Forward and backward: real-valued RoPE vs torchtitan's complex ``apply_rotary_emb``; the fused
chunked linear + cross-entropy vs torchtitan's ``cross_entropy_loss`` on the output ``Linear``; the
whole ``FastTransformer`` vs torchtitan's ``Transformer`` (same init, same state dict, same loss
and parameter gradients).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer, apply_rotary_emb, precompute_freqs_cis

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/fast_components.py
from fast_components import (  # noqa: E402
    FastTransformer,
    HiddenAndHead,
    RealRopeTransformer,
    _chunk_loss_and_grad,
    apply_rotary_emb_real,
    build_fused_loss,
    fused_linear_cross_entropy,
    rope_cache,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,seqlen,scaling,tol",
    [
        pytest.param(torch.float32, 4, 2, 16, 32.0, 1e-6, id="fp32-gqa-llama32-scaling"),
        pytest.param(torch.float32, 2, 2, 33, 8.0, 1e-6, id="fp32-mha-odd-seqlen"),
        pytest.param(torch.bfloat16, 4, 1, 24, 32.0, 1e-2, id="bf16-mqa"),
    ],
)
def test_rope_real_matches_torchtitan_complex(dtype, heads, kv_heads, seqlen, scaling, tol):
    torch.manual_seed(seqlen)
    hd, bs = 16, 2
    scaling_args = RoPEScalingArgs(scaling_factor=scaling)
    freqs_cis = precompute_freqs_cis(hd, 64, 500000.0, scaling_args)
    cache = rope_cache(hd, 64, 500000.0, scaling_args)
    assert torch.equal(cache[..., 0], freqs_cis.real) and torch.equal(cache[..., 1], freqs_cis.imag)

    xq0 = torch.randn(bs, seqlen, heads, hd, dtype=dtype, requires_grad=True)
    xk0 = torch.randn(bs, seqlen, kv_heads, hd, dtype=dtype, requires_grad=True)
    xq1, xk1 = (t.detach().clone().requires_grad_() for t in (xq0, xk0))
    rq, rk = apply_rotary_emb(xq0, xk0, freqs_cis)
    fq, fk = apply_rotary_emb_real(xq1, xk1, cache)
    assert fq.dtype == dtype and fq.shape == rq.shape and fk.shape == rk.shape
    # fp32: the same products and sums, so the same values up to the last bit or two
    assert rel(fq, rq) < tol and rel(fk, rk) < tol
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    ((rq * gq).sum() + (rk * gk).sum()).backward()
    ((fq * gq).sum() + (fk * gk).sum()).backward()
    assert rel(xq1.grad, xq0.grad) < tol and rel(xk1.grad, xk0.grad) < tol


def _reference_loss(h, w, labels):
    return cross_entropy_loss(F.linear(h, w).unflatten(0, (1, -1)), labels.unflatten(0, (1, -1)))


@pytest.mark.parametrize(
    "n,vocab,chunk,ignored",
    [
        pytest.param(64, 97, 16, 0, id="chunks-divide"),
        pytest.param(70, 128, 16, 5, id="ragged-last-chunk-with-ignored-labels"),
        pytest.param(40, 50, 4096, 3, id="one-chunk"),
    ],
)
def test_fused_linear_ce_fp32_matches_reference(n, vocab, chunk, ignored):
    torch.manual_seed(n + vocab)
    d = 32
    h0 = torch.randn(n, d, requires_grad=True)
    w0 = (torch.randn(vocab, d) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    labels[torch.randperm(n)[:ignored]] = IGNORE_INDEX
    h1, w1 = (t.detach().clone().requires_grad_() for t in (h0, w0))

    ref = _reference_loss(h0, w0, labels)
    got = fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=chunk)
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
    # torchtitan divides the summed loss by the global token count before backward
    (ref / 123.0).backward()
    (got / 123.0).backward()
    assert rel(h1.grad, h0.grad) < 1e-5 and rel(w1.grad, w0.grad) < 1e-5
    assert w1.grad.dtype == w0.dtype and h1.grad.dtype == h0.dtype
    if ignored:  # ignored tokens get no gradient at all
        assert torch.all(h1.grad[labels == IGNORE_INDEX] == 0)


def test_fused_linear_ce_under_bf16_autocast_matches_autocast_reference():
    torch.manual_seed(0)
    n, d, vocab = 96, 64, 200
    h0 = torch.randn(2, n // 2, d, requires_grad=True)  # fp32 residual stream, as under autocast
    w0 = (torch.randn(vocab, d) * 0.2).requires_grad_()  # fp32 parameters
    labels = torch.randint(0, vocab, (2, n // 2))
    h1, w1 = (t.detach().clone().requires_grad_() for t in (h0, w0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy_loss(F.linear(h0, w0), labels)  # torchtitan: output Linear under autocast
        got = fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=40)
    assert abs(got.item() - ref.item()) <= 2e-3 * abs(ref.item())
    ref.backward()
    got.backward()
    assert h1.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32
    assert rel(h1.grad, h0.grad) < 2e-2 and rel(w1.grad, w0.grad) < 2e-2


def test_chunk_grad_is_softmax_minus_onehot():
    torch.manual_seed(1)
    logits = torch.randn(5, 11, requires_grad=True)
    labels = torch.tensor([3, IGNORE_INDEX, 0, 10, 7])
    loss, grad = _chunk_loss_and_grad(logits.detach(), labels)
    ref = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6) and torch.allclose(grad, logits.grad, atol=1e-7)


def _tiny_args(**kw) -> TransformerModelArgs:
    return TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                                rope_theta=500000.0, max_seq_len=32, rope_scaling_args=RoPEScalingArgs(32.0), **kw)


def _build(cls, seed=7):
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = cls(_tiny_args())
    m.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_weights()
    return m.train()


class _Cfg:  # the slice of JobConfig that build_fused_loss reads
    class compile:  # noqa: N801
        enable, components, backend = False, ["model", "loss"], "inductor"


@pytest.mark.parametrize("chunk_seq", [pytest.param(False, id="one-sample"), pytest.param(True, id="batch-of-3")])
def test_fast_transformer_matches_torchtitan_transformer(chunk_seq):
    ref, fast = _build(Transformer), _build(FastTransformer)
    # same parameters, names and init: checkpoints are interchangeable
    assert list(ref.state_dict()) == list(fast.state_dict())
    for (k, a), b in zip(ref.state_dict().items(), fast.state_dict().values()):
        assert torch.equal(a, b), k
    bs = 3 if chunk_seq else 1
    torch.manual_seed(3)
    tokens = torch.randint(0, 256, (bs, 32))
    labels = torch.randint(0, 256, (bs, 32))

    ref_loss = cross_entropy_loss(ref(tokens), labels)
    pred = fast(tokens)
    assert isinstance(pred, HiddenAndHead)
    fast_loss = build_fused_loss(_Cfg())(pred, labels)
    assert abs(fast_loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    ref_loss.backward()
    fast_loss.backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert rel(q.grad, p.grad) < 1e-4, name

    fast.eval()  # evaluation returns logits, like torchtitan's model
    with torch.no_grad():
        assert rel(fast(tokens), ref.eval()(tokens)) < 1e-5


def test_real_rope_transformer_returns_logits_matching_torchtitan():
    """The RoPE-only variant: torchtitan's logits, loss and parameter gradients, in training mode."""
    ref, fast = _build(Transformer), _build(RealRopeTransformer)
    torch.manual_seed(4)
    tokens, labels = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    logits = fast(tokens)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 32, 256)
    ref_loss, fast_loss = cross_entropy_loss(ref(tokens), labels), cross_entropy_loss(logits, labels)
    assert abs(fast_loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    ref_loss.backward()
    fast_loss.backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert rel(q.grad, p.grad) < 1e-4, name


def test_fused_loss_backward_scales_by_upstream_gradient():
    """torchtitan divides the summed loss by the token count: the in-place backward must apply that scale."""
    torch.manual_seed(5)
    h0 = torch.randn(12, 16, requires_grad=True)
    w0 = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (12,))
    h1, w1 = h0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
    (F.cross_entropy(h0 @ w0.t(), labels, reduction="sum") / 7.0).backward()
    (fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=5) / 7.0).backward()
    assert rel(h1.grad, h0.grad) < 1e-5 and rel(w1.grad, w0.grad) < 1e-5
