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
    total, per_token = _ChunkedHeadCrossEntropy.apply(h, w, labels, chunks, _chunk_loss_and_grad)
    (0.37 * total).backward()
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-10, atol=1e-12)
    assert per_token[3] == 0 and per_token[9] == 0 and not per_token.requires_grad
    torch.testing.assert_close(per_token, F.cross_entropy(h @ w.t(), labels, reduction="none"), rtol=1e-12, atol=1e-12)


def test_without_gradients_only_the_losses_are_made():
    torch.manual_seed(1)
    h, w = torch.randn(9, 8), torch.randn(20, 8)
    labels = torch.randint(0, 20, (9,))
    with torch.no_grad():
        total, _ = _ChunkedHeadCrossEntropy.apply(h, w, labels, 4, _chunk_loss_and_grad)
    torch.testing.assert_close(total, _reference(h, w, labels))
    assert _chunk_loss_and_grad(h @ w.t(), labels, False)[1] is None


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


def test_under_autocast_the_weights_gradient_accumulates_in_the_parameters_float32():
    torch.manual_seed(6)
    h = torch.randn(24, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)  # a float32 parameter, as torchtitan keeps it under AMP
    labels = torch.randint(0, 40, (24,))
    ref = _reference(h, w, labels)
    ref.backward()
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = _ChunkedHeadCrossEntropy.apply(h, w, labels, 3, _chunk_loss_and_grad)
    total.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(total, ref, rtol=2e-2, atol=0.0)  # bf16 products
    torch.testing.assert_close(h.grad, want_h, rtol=5e-2, atol=5e-2 * float(want_h.abs().max()))
    torch.testing.assert_close(w.grad, want_w, rtol=5e-2, atol=5e-2 * float(want_w.abs().max()))
