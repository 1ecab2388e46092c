"""kubetitan_trainer.train_spec.compile_fp8_head: the FP8 output projection compiled, same numbers (CPU).

The compiled head must give torchtitan's eager head's loss and gradients (torchao FP8 emulation on
CPU; the ``aot_eager`` backend traces the same forward and backward graphs that Inductor gets on a
GPU), keep parameter names, and leave every other configuration alone.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from kubetitan_trainer.train_spec import compile_fp8_head, wrap_parallelize

ARGS = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32)


def job(enable=True, components=("model", "loss")):
    return SimpleNamespace(compile=SimpleNamespace(enable=enable, components=list(components), backend="aot_eager"))


def fp8_model(head_in_fp8=True) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ARGS)
    with torch.no_grad():
        m.init_weights()
    keep = (lambda mod, fqn: fqn == "output") if head_in_fp8 else (lambda mod, fqn: False)
    return convert_to_float8_training(m, config=Float8LinearConfig(emulate=True), module_filter_fn=keep)


def loss_and_grads(model: Transformer, tokens, labels):
    model.zero_grad(set_to_none=True)
    loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_fp8_head_matches_the_eager_head():
    eager = fp8_model()
    compiled = copy.deepcopy(eager)
    keys = list(compiled.state_dict())
    assert compile_fp8_head(compiled, job()) is True
    assert list(compiled.state_dict()) == keys  # same names: checkpoints are interchangeable
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # fresh inputs each time; the second call runs the already compiled graphs
        tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=g)
        labels = torch.randint(0, ARGS.vocab_size, (2, 32), generator=g)
        le, ge = loss_and_grads(eager, tokens, labels)
        lc, gc = loss_and_grads(compiled, tokens, labels)
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        assert ge.keys() == gc.keys()
        for name in ge:
            torch.testing.assert_close(gc[name], ge[name], rtol=1e-4, atol=1e-6, msg=name)
    assert gc["output.weight"].abs().sum() > 0


@pytest.mark.parametrize("case", ["compile off", "blocks not compiled", "bf16 head"])
def test_other_configurations_are_left_alone(case):
    model = fp8_model(head_in_fp8=case != "bf16 head")
    cfg = {"compile off": job(enable=False), "blocks not compiled": job(components=("loss",))}.get(case, job())
    forward = model.output.forward
    assert compile_fp8_head(model, cfg) is False
    assert model.output.forward == forward


def test_the_trainspec_parallelize_compiles_the_head_after_torchtitans():
    seen = []

    def base(model, parallel_dims, job_config):
        seen.append(model.output.forward.__func__)  # still the plain method when torchtitan's runs
        return model

    model = fp8_model()
    out = wrap_parallelize(base)(model, None, job())
    assert out is model and len(seen) == 1
    assert getattr(model.output.forward, "__func__", None) is not seen[0]
