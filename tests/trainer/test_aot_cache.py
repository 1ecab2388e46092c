"""The AOTAutograd cache serves the recipe's graphs (kubetitan_trainer.compile.aot_cache, issue 29 item 3).

A fresh interpreter captures one FP8 TransformerBlock of the debug model with Dynamo (a backend that only
inspects the graph: no Inductor, ~seconds) and applies the AOTAutograd cache's own node check
(``check_cacheable``) plus the pickling by reference that its key needs, first as torch 2.11 ships, then after
:func:`kubetitan_trainer.compile.aot_cache.enable`. Without it the graph is refused (so every restart traces the joint
graph again); with it nothing is. The full round trip (a second process hitting the cache) is
``bench/aot_cache_probe.py``; it compiles with Inductor and takes minutes on CPU.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import kubetitan_trainer.compile
from kubetitan_trainer import compat
from kubetitan_trainer.compile import aot_cache

from support import warm

PROBE = textwrap.dedent('''
    import json, pickle, torch
    from torch._functorch._aot_autograd import autograd_cache
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchtitan.models.llama3 import Transformer, llama3_args

    def refused(gm):
        """The targets the cache would refuse (its node check, then pickling each by reference for the key)."""
        out = []
        for node in gm.graph.nodes:
            try:
                autograd_cache.check_node_safe(node)
                if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
                    pickle.dumps(node.target)
            except Exception:
                out.append(f"{getattr(node.target, '__module__', '?')}.{getattr(node.target, '__name__', node.target)}")
        return sorted(set(out))

    def capture():
        seen = []
        def backend(gm, example_inputs):
            seen.append(refused(gm))
            return gm.forward
        torch._dynamo.reset()
        model = Transformer(llama3_args["debugmodel"])
        convert_to_float8_training(model.layers, config=Float8LinearConfig())
        block = torch.compile(model.layers["0"], backend=backend, fullgraph=True)
        x = torch.randn(2, 16, model.model_args.dim, requires_grad=True)
        block(x, model.freqs_cis[:16], None)
        return seen

    before = capture()
    from kubetitan_trainer.compile import aot_cache
    aot_cache.enable()
    aot_cache.enable()  # idempotent
    after = capture()
    print(json.dumps({"before": before, "after": after}))
''')


def test_enable_makes_an_fp8_blocks_graph_cacheable(tmp_path) -> None:
    code, output = warm.run_code(PROBE, tmp_path)  # a fresh process: forked from the warm parent, nothing compiled
    assert code == 0, output[-3000:]
    got = warm.last_json(output)
    assert len(got["before"]) == 1 and len(got["after"]) == 1  # one graph each time: the block, fullgraph
    before = set(got["before"][0])
    # as shipped: the SDPA backend selection, torchao's configs and its Functions' closures are refused
    assert {"torch.nn.attention._sdpa_kernel", "torch.nn.attention._backend_from_string"} <= before
    assert any(name.endswith("trampoline_autograd_apply") for name in before)
    assert any(name.startswith("torchao.float8.") for name in before)
    assert got["after"] == [[]]


def test_every_marked_name_is_keyed_by_the_versions_of_its_package() -> None:
    names = aot_cache.cacheable_names()
    assert set(names) == set(aot_cache.TORCH_PURE) | set(aot_cache.TORCHAO_PURE)
    assert all(v.startswith("torch ") for v in names.values())
    assert all("torchao " in names[n] for n in aot_cache.TORCHAO_PURE)


STAND_INS = textwrap.dedent('''
    import json, torch
    from kubetitan_trainer.compile import aot_cache
    aot_cache.enable()

    def make(scale):
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * scale

            @staticmethod
            def backward(ctx, g):
                return g * scale
        return torch._dynamo.allow_in_graph(F)

    out = {}
    x = torch.ones(3)
    for scale in (2.0, 3.0):  # two classes with one qualified name: each runs its own code
        F = make(scale)
        torch._dynamo.reset()
        out[str(scale)] = torch.compile(lambda x, F=F: F.apply(x), backend="eager", fullgraph=True)(x).tolist()

    @torch._dynamo.allow_in_graph
    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 5

        @staticmethod
        def backward(ctx, g):
            return g * 5

    graphs = []
    torch.compile(lambda x: G.apply(x) + 1, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(x)
    out["stand_in"] = [n.target.__module__ for n in graphs[0].graph.nodes if n.op == "call_function"][0]
    torch._dynamo.reset()  # Dynamo traces the graph it made again (a stand-in in it)
    out["retraced"] = torch.compile(graphs[0], backend="eager", fullgraph=True)(x)[0].tolist()
    print(json.dumps(out))
''')


def test_stand_ins_never_run_another_class_and_dynamo_traces_them_again(tmp_path) -> None:
    code, output = warm.run_code(STAND_INS, tmp_path)
    assert code == 0, output[-3000:]
    got = warm.last_json(output)
    assert got["2.0"] == [2.0] * 3 and got["3.0"] == [3.0] * 3
    assert got["stand_in"] == "kubetitan_trainer.compile.aot_cache" and got["retraced"] == [6.0] * 3


def test_a_functions_key_holds_the_versions_and_its_source() -> None:
    from importlib import metadata

    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    key = aot_cache.function_key(matmul_with_hp_or_float8_args)
    assert key.startswith(f"torch {metadata.version('torch')}, torchao {metadata.version('torchao')}, source ")
    assert "source unknown" not in key


KERNEL = '''import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * {factor}

    @staticmethod
    def backward(ctx, g):
        return g * {factor}
'''


def test_a_changed_kernel_source_makes_a_new_cache_key(tmp_path, monkeypatch) -> None:
    """The key a Function's stand-in is marked with in torch's ``unsafe_marked_cacheable_functions`` holds a hash of
    its source: an edited kernel under the same package versions (an editable install) is a new key, so the cache
    never serves the graph traced from the old one; the same source keeps its key."""
    import importlib

    marked: dict[str, str] = {}
    monkeypatch.setattr(compat, "mark_cacheable", marked.update)
    source = tmp_path / "kt_kernel_probe.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    source.write_text(KERNEL.format(factor=2))
    module = importlib.import_module("kt_kernel_probe")
    aot_cache._trampoline_named("trampoline_probe", module.Scale)
    first = marked["kubetitan_trainer.compile.aot_cache.trampoline_probe"]
    assert aot_cache.function_key(module.Scale) == first and "source unknown" not in first
    source.write_text(KERNEL.format(factor=2.5))  # the kernel changed (and the file's size: linecache sees it)
    module = importlib.reload(module)
    aot_cache._trampoline_named("trampoline_probe", module.Scale)
    second = marked["kubetitan_trainer.compile.aot_cache.trampoline_probe"]
    assert second != first and second.split(", source ")[0] == first.split(", source ")[0]  # same versions
    source.write_text(KERNEL.format(factor=2))
    assert aot_cache.function_key(importlib.reload(module).Scale) == first


class _Compile:
    enable, components, backend = True, ["model"], "inductor"


class _JobConfig:
    compile = _Compile()


class _Dims:
    def __init__(self, pp_enabled: bool = False) -> None:
        self.pp_enabled = pp_enabled


def test_the_aot_modules_are_imported_and_torch_marked_only_with_the_runtime_switch(monkeypatch, tmp_path) -> None:
    """A default compiled run (``[kubetitan.runtime] aot_compile`` off) neither imports ``compile.aot_cache`` and
    ``compile.aot_precompile`` (made unimportable here: an import would raise) nor marks anything in torch's
    ``unsafe_marked_cacheable_functions``; with the switch on the TrainSpec's parallelize imports them and marks the
    recipe's functions. With it on, reductions also keep their compiled block size (``dynamic_scale_rblock`` off: not
    benchmarked again in every new process), unless the environment sets it. In-process (a second once torchtitan is
    loaded, as it is in the suite)."""
    import torch._inductor.config as inductor_config

    from kubetitan_core.contract.trainer_toml import KubetitanRuntime
    from kubetitan_trainer import runtime, train_spec, trainer

    parallelize = train_spec.wrap_parallelize(lambda model, dims, job_config: model)
    model = torch.nn.Module()
    with inductor_config.patch(unsafe_marked_cacheable_functions={}, dynamic_scale_rblock=True):
        for name in ("aot_cache", "aot_precompile"):  # importing either now raises ImportError
            monkeypatch.setitem(sys.modules, f"kubetitan_trainer.compile.{name}", None)
            monkeypatch.delattr(kubetitan_trainer.compile, name, raising=False)
        monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime())
        assert parallelize(model, None, _JobConfig()) is model and trainer.aot_blocks() is None
        assert inductor_config.unsafe_marked_cacheable_functions == {} and inductor_config.dynamic_scale_rblock
        monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=True))
        with pytest.raises(ImportError, match="aot_cache"):
            parallelize(model, None, _JobConfig())
        monkeypatch.undo()
        monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=True))
        monkeypatch.setattr(compat, "name_autograd_trampolines", lambda namespace, on_new: lambda fn_cls: None)
        assert parallelize(model, _Dims(), _JobConfig()) is model  # no compiled blocks: no artefact, as before
        assert set(aot_cache.cacheable_names()) <= set(inductor_config.unsafe_marked_cacheable_functions)
        assert inductor_config.dynamic_scale_rblock is False
        inductor_config.dynamic_scale_rblock = True
        compat.fix_reduction_blocks({"TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "1"})  # the user's own choice stands
        assert inductor_config.dynamic_scale_rblock is True
        compat.fix_reduction_blocks({})
        assert inductor_config.dynamic_scale_rblock is False
        assert trainer.aot_blocks() is not None
        # compiled blocks get their artefact's dispatch, except under pipeline parallelism (each stage's model part
        # is parallelised on its own, and every rank must vote with all of its blocks)
        from kubetitan_trainer.compile import aot_precompile

        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
        blocks = torch.nn.Module()
        blocks.layers = torch.nn.ModuleDict({"0": torch.compile(torch.nn.Linear(2, 2), fullgraph=True)})
        parallelize(blocks, _Dims(pp_enabled=True), _JobConfig())
        assert aot_precompile.CURRENT == []
        parallelize(blocks, _Dims(), _JobConfig())
        assert [len(p.blocks) for p in aot_precompile.CURRENT] == [1]
