"""``precision.lossChunks`` (trainer/kubetitan_trainer/chunked_loss.py): the output projection and the cross entropy in
chunks, their gradients made in the forward pass, give torchtitan's loss and gradients without the whole batch's
logits: the autograd function against ``F.cross_entropy`` in float64, the install on torchtitan's Llama 3 model (the
model then returns the final norm's output; per-source losses and a no-grad evaluation still work), and the real
trainer over two gloo ranks with FSDP2, chunked against unchunked."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.models.llama3 import Transformer, TransformerModelArgs

from kmockx.harness import free_port
from kubetitan_trainer import chunked_loss
from kubetitan_trainer.chunked_loss import _ChunkedHeadCrossEntropy, _chunk_loss_and_grad
from kubetitan_trainer.source_loss import SourceLoss, SourceStats

from support import warm
from support.paths import REPO
from support.specs import tiny_lpt, write_config


def _reference(h, w, labels):
    return F.cross_entropy(h @ w.t(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunks", [1, 3, 4, 14, 64])
def test_the_chunked_loss_and_its_gradients_are_the_cross_entropys(chunks):
    torch.manual_seed(0)
    h = torch.randn(14, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (14,))
    labels[[3, 9]] = IGNORE_INDEX
    ref = _reference(h, w, labels)
    (0.37 * ref).backward()  # the trainer scales the sum by 1 / the global valid tokens
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    total, per_token = _ChunkedHeadCrossEntropy.apply(h, w, labels, chunks, _chunk_loss_and_grad, True)
    (0.37 * total).backward()
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-10, atol=1e-12)
    assert per_token[3] == 0 and per_token[9] == 0 and not per_token.requires_grad
    torch.testing.assert_close(per_token, F.cross_entropy(h @ w.t(), labels, reduction="none"), rtol=1e-12, atol=1e-12)


def test_without_gradients_only_the_losses_are_made():
    """An evaluation under no_grad: the parameters still require grad (needs_input_grad says True), but no chunk makes
    a gradient."""
    torch.manual_seed(1)
    h, w = torch.randn(9, 8), torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (9,))
    asked = []

    def spy(logits, chunk_labels, want_grad):
        asked.append(want_grad)
        return _chunk_loss_and_grad(logits, chunk_labels, want_grad)

    head = chunked_loss.ChunkedHead(torch.nn.Linear(8, 20, bias=False), 4, None)
    head.head.weight = torch.nn.Parameter(w.detach().clone())
    head.chunk_fn = spy
    with torch.no_grad():
        total, _ = head.per_token(h.unsqueeze(0), labels.unsqueeze(0))
    torch.testing.assert_close(total, _reference(h, w.detach(), labels))
    assert asked == [False] * 3
    total, _ = head.per_token(h.unsqueeze(0), labels.unsqueeze(0))  # and with grad mode on, every chunk does
    assert asked[3:] == [True] * 3 and total.requires_grad


def test_the_chunked_loss_is_differentiated_once():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    total, _ = _ChunkedHeadCrossEntropy.apply(h, w, torch.randint(0, 10, (6,)), 2, _chunk_loss_and_grad, True)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        total.backward()


def _rel_err(got, want):
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["amp-float32-param", "bf16-param"])
def test_the_weights_gradient_is_as_precise_chunked_as_unchunked(param_dtype):
    """bf16 products either way (autocast over a float32 parameter, as torchtitan on one device; or a bf16
    parameter, as FSDP's mixed precision): the chunks' sum accumulates in float32, so 64 chunks are as close to the
    float64 answer as one product (a bf16 running sum was ~3x further off at 64 chunks)."""
    torch.manual_seed(6)
    h64, w64 = torch.randn(512, 32, dtype=torch.float64), torch.randn(96, 32, dtype=torch.float64)
    labels = torch.randint(0, 96, (512,))
    h, w = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    _reference(h, w, labels).backward()
    want_w = w.grad

    def grads(chunks):
        hp = h64.to(param_dtype).requires_grad_()
        wp = w64.to(param_dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype == torch.float32):
            total, _ = _ChunkedHeadCrossEntropy.apply(hp, wp, labels, chunks, _chunk_loss_and_grad, True)
        total.backward()
        assert wp.grad.dtype == param_dtype and hp.grad.dtype == param_dtype
        return wp.grad

    one, many = _rel_err(grads(1), want_w), _rel_err(grads(64), want_w)
    assert many <= 1.3 * one + 1e-6, (one, many)


def _model() -> Transformer:
    torch.manual_seed(3)
    model = Transformer(TransformerModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                             multiple_of=16, max_seq_len=32))
    with torch.no_grad():
        model.init_weights()
    return model


class _Job:
    class compile:  # noqa: N801 - torchtitan's JobConfig.compile, the part SourceLoss reads
        enable, components, backend = False, [], "inductor"


def _step(model, loss_fn, tokens, labels):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_installed_on_llama3_the_model_returns_the_norms_output_and_the_step_is_torchtitans():
    plain_model, tokens = _model(), torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(tokens, -1, 1)
    labels[1, :5] = IGNORE_INDEX
    chunked_model = copy.deepcopy(plain_model)
    plain_loss, plain_grads = _step(plain_model, SourceLoss(_Job()), tokens, labels)
    loss_fn = SourceLoss(_Job())
    chunked_loss.install(chunked_model, loss_fn, 5, None)
    assert chunked_model(tokens).shape == (3, 12, 32)  # the final norm's output: no logits
    assert list(chunked_model.state_dict()) == list(plain_model.state_dict())  # names (and checkpoints) unchanged
    loss, grads = _step(chunked_model, loss_fn, tokens, labels)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: the same loss, nothing kept
        torch.testing.assert_close(loss_fn(chunked_model(tokens), labels), plain_loss, rtol=1e-5, atol=1e-5)


def test_per_source_losses_come_from_the_chunks_per_token_losses():
    model, tokens = _model(), torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    labels = torch.roll(tokens, -1, 1)
    sources = torch.tensor([0, 1, 1, 0])
    plain_stats, chunked_stats = SourceStats(["a", "b"]), SourceStats(["a", "b"])
    plain = SourceLoss(_Job())
    plain.tag(sources, plain_stats)
    want = plain(model(tokens), labels)
    chunked_model, loss_fn = copy.deepcopy(model), SourceLoss(_Job())
    chunked_loss.install(chunked_model, loss_fn, 3, None)
    loss_fn.tag(sources, chunked_stats)
    got = loss_fn(chunked_model(tokens), labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    p, c = plain_stats.losses(), chunked_stats.losses()
    assert p.keys() == c.keys() == {"a", "b"}
    for name in p:
        assert c[name]["loss_tokens"] == p[name]["loss_tokens"] == 16
        assert c[name]["loss"] == pytest.approx(p[name]["loss"], rel=1e-5)


def test_a_model_without_an_output_projection_is_refused_with_the_field_to_change():
    model = _model()
    model.output = None  # a pipeline stage that is not the last
    with pytest.raises(RuntimeError, match="precision.lossChunks"):
        chunked_loss.install(model, SourceLoss(_Job()), 4, None)


def _run(tmp_path: Path, chunks: int, ranks: int) -> list[dict]:
    obj = tiny_lpt({"precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32",
                                  "lossChunks": chunks},
                    "parallelism": {"dataParallelShardDegree": ranks},
                    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": ranks},
                    "data": {"source": "synthetic"}, "checkpoint": {"enabled": False}}, name=f"chunks{chunks}")
    out = tmp_path / f"chunks{chunks}"
    out.mkdir()
    cfg = write_config(out / "t.toml", obj, out / "dump", {"kubetitan": {"metrics_port": 0}})
    port, logs = free_port(), [out / f"rank{i}.log" for i in range(ranks)]
    procs = [warm.popen("tests.trainer.chunked_rank", [str(cfg), str(out)],
                        {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(i), "LOCAL_RANK": str(i), "GROUP_RANK": "0",
                         "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port)}, logs[i], cwd=REPO) for i in range(ranks)]
    codes = warm.wait_all(procs, timeout=600)
    for code, log in zip(codes, logs):
        assert code == 0, log.read_text(errors="replace")[-4000:]
    return [torch.load(out / f"rank{i}.pt") for i in range(ranks)]


def test_the_real_trainer_under_fsdp2_on_two_ranks_gets_the_same_loss_and_gradients_with_chunks(tmp_path):
    plain, chunked = _run(tmp_path, 0, 2), _run(tmp_path, 4, 2)
    for rank, (p, c) in enumerate(zip(plain, chunked)):
        dim = p["grads"]["norm.weight"].shape[0]
        assert p["output_shape"][-1] != dim and c["output_shape"][-1] == dim, rank  # logits, then the norm's output
        assert c["loss"] == pytest.approx(p["loss"], rel=1e-5), rank
        assert c["grads"].keys() == p["grads"].keys()
        for name, grad in p["grads"].items():
            torch.testing.assert_close(c["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")


def test_the_compiled_chunk_function_gives_the_eager_ones_numbers():
    """The per-chunk function as a compiled run uses it (``torch.compile``, here the aot_eager backend: Dynamo and
    AOTAutograd without code generation), a last chunk of another size included."""
    torch.manual_seed(7)
    h = torch.randn(22, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (22,))
    labels[4] = IGNORE_INDEX
    ref = _reference(h, w, labels)
    ref.backward()
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    total, _ = _ChunkedHeadCrossEntropy.apply(h, w, labels, 4, chunked_loss._compiled("aot_eager"), True)
    total.backward()
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-10, atol=1e-12)


def test_the_renderer_keeps_the_projection_out_of_fp8_under_a_chunked_loss():
    from kubetitan_core import render

    def fqns(precision):
        obj = tiny_lpt({"precision": {"compile": False, "activationCheckpointing": "none",
                                      "mixedPrecisionParam": "float32", **precision}})
        return render.trainer_config(obj)["quantize"]["linear"]["float8"]["filter_fqns"]

    fp8_head = {"float8": {"enabled": True, "filterFqns": []}}
    assert fqns(fp8_head) == []
    assert fqns({**fp8_head, "lossChunks": 4}) == ["output"]
    assert fqns({"float8": {"enabled": True}, "lossChunks": 4}) == ["output"]  # the default already filters it


def test_an_fp8_output_projection_is_refused_with_the_setting_to_change():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _model()
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    assert type(model.output).__name__ == "Float8Linear"
    with pytest.raises(RuntimeError, match="filter_fqns"):
        chunked_loss.install(model, SourceLoss(_Job()), 4, None)
