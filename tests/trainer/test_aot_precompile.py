"""Ahead-of-time compiled blocks (kubetitan_trainer.aot_precompile) on CPU: rank 0 makes the artefact after its first
step; a fresh process loads it and its blocks run it without a Dynamo trace, with the eager model's numbers; what
its guards do not cover falls back to the block's own compile; a worker that died using it makes the next one
delete it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from kubetitan_trainer import anatomy, aot_precompile, compat

PROBE = textwrap.dedent("""
    import json, os
    import torch
    import torch._inductor.cpu_vec_isa as cpu_vec_isa
    from kubetitan_trainer import aot_precompile, compat

    cpu_vec_isa.valid_vec_isa_list = list  # scalar C++ kernels: no per-process gcc probes of the CPU (~9 s each)

    torch.set_num_threads(1)

    class Block(torch.nn.Module):  # a transformer block's signature (a default argument too) and a few of its parts
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(16)
            self.wq = torch.nn.Linear(16, 16, bias=False)

        def forward(self, x, freqs_cis, attention_masks, positions=None):
            if positions is not None:
                x = x + positions
            return x + torch.nn.functional.silu(self.wq(self.norm(x))) * freqs_cis

    def model():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleDict({str(i): Block() for i in range(2)})
        return m

    def run(m, x, freqs):
        h = x
        for b in m.layers.values():
            h = b(h, freqs, None)
        h.square().mean().backward()
        return h.detach(), x.grad.clone(), m.layers["0"].wq.weight.grad.clone()

    freqs = torch.rand(8, 16, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run(model(), x.clone().requires_grad_(), freqs)
    m = model()
    for name, b in list(m.layers.named_children()):
        m.layers.register_module(name, torch.compile(b, fullgraph=True))
    p = aot_precompile.install(m, rank=0)
    before = compat.compile_counts().get("stats.unique_graphs", 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the recipe trains (mixed precision without FSDP)
        got = run(m, x.clone().requires_grad_(), freqs)
    traced = compat.compile_counts().get("stats.unique_graphs", 0) - before
    summary = aot_precompile.after_first_step()
    no_grad = None
    if p.artefact is not None:  # not what the artefact was made for: its guards refuse it, and name the guard
        inner = compat.compiled_module_parts(m.layers["0"])[0]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            no_grad = [compat.aot_run(p.artefact.get(), inner, (x.clone(), freqs, None), {})[0],
                       compat.aot_guard_failure(p.artefact.get(), inner, (x.clone(), freqs, None), {})]
    print(json.dumps({"summary": summary, "traced": traced, "no_grad": no_grad,
                      "diff": [float((a - b).abs().max()) for a, b in zip(got, ref)],
                      "files": sorted(os.listdir(aot_precompile.folder()))}))
""")



def _probe(cache, env=None):
    e = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
         aot_precompile.ENV: "1", **(env or {})}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=e)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rank_0_makes_the_artefact_and_a_fresh_process_runs_it_without_tracing(tmp_path):
    first = _probe(tmp_path)
    assert first["summary"]["made"]["saved"] is True, first
    assert first["summary"]["loaded"] is False and first["summary"]["served"] == 0 and first["traced"] >= 1
    assert max(first["diff"]) < 5e-2  # bf16 autocast: the compiled blocks against the eager ones
    artefacts = [f for f in first["files"] if f.endswith(".aot")]
    assert len(artefacts) == 1 and artefacts[0].startswith("Block-")
    assert first["summary"]["made"]["autocast"] == ["cpu", "bfloat16"] and artefacts[0] + ".json" in first["files"]

    second = _probe(tmp_path)
    s = second["summary"]
    assert s["loaded"] is True and s["served"] == 2 and s["fell_back"] == 0 and "made" not in s, second
    assert second["traced"] == 0  # no Dynamo trace on the artefact's path
    assert second["diff"] == first["diff"]  # output, input's and a weight's gradient: as the first process compiled
    served, why = second["no_grad"]  # a no_grad call: refused (the block's own compile runs it), the guard named
    assert served is False and "grad_mode" in why, why
    assert not [f for f in second["files"] if ".trying-" in f]  # the first step ended: its marker is gone


def _compiled_holder():
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleDict({str(i): torch.compile(torch.nn.Linear(4, 4), fullgraph=True) for i in range(2)})
    return m


def test_a_worker_that_died_using_the_artefact_makes_the_next_one_delete_it(tmp_path, monkeypatch):
    env = {aot_precompile.ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: None)
    first = aot_precompile.install(_compiled_holder(), rank=1, env=env)
    assert first.artefact is None and not first.capture  # no artefact, and rank 1 does not make one
    first.path.parent.mkdir(parents=True)
    first.path.write_bytes(b"artefact")
    rank0 = aot_precompile.install(_compiled_holder(), rank=0, env=env)
    assert rank0.artefact is not None and rank0.marker.read_text() == str(os.getpid())
    # another model part of the same process (pipeline stages) and another rank's live worker keep it
    assert aot_precompile.install(_compiled_holder(), rank=0, env=env).artefact is not None
    assert aot_precompile.install(_compiled_holder(), rank=1, env=env).artefact is not None
    rank0.marker.write_text("999999")  # ... rank 0's worker died before its first step ended: a new process finds
    nxt = aot_precompile.install(_compiled_holder(), rank=0, env=env)
    assert not nxt.path.exists() and not nxt.marker.exists()
    assert nxt.artefact is None and nxt.capture  # rank 0 makes a new one after its first step


def test_several_ranks_compile_as_usual(tmp_path):
    env = {aot_precompile.ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "WORLD_SIZE": "2"}
    assert aot_precompile.install(_compiled_holder(), rank=0, env=env) is None


def test_a_served_call_uses_the_artefact_and_anything_else_the_blocks_own_compile(tmp_path, monkeypatch):
    env = {aot_precompile.ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    (tmp_path / aot_precompile.SUBDIR).mkdir()
    holder = _compiled_holder()
    inner = compat.compiled_module_parts(holder.layers["0"])[0]
    (tmp_path / aot_precompile.SUBDIR / f"Linear-{aot_precompile.source_key(inner)}.aot").write_bytes(b"x")
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    calls = []

    def run(compiled, module, args, kwargs):
        calls.append((compiled, module))
        return (args[0].shape[0] == 3), "served"

    monkeypatch.setattr(compat, "aot_run", run)
    monkeypatch.setattr(compat, "aot_guard_failure", lambda compiled, module, args, kwargs: "size mismatch at index 0")
    p = aot_precompile.install(holder, rank=0, env=env)
    assert holder.layers["0"](torch.ones(3, 4)) == "served" and calls[-1] == ("compiled", inner)
    fallback = holder.layers["1"](torch.ones(2, 4))  # guards refuse: the block's own torch.compile forward
    assert isinstance(fallback, torch.Tensor) and fallback.shape == (2, 4)
    summary = aot_precompile.after_first_step()
    assert summary["loaded"] and summary["served"] == 1 and summary["fell_back"] == 1 and not p.capture
    assert summary["refused"] == "size mismatch at index 0"  # why the artefact was not used, in the record
    assert not p.marker.exists()


def test_blocks_sharded_over_several_ranks_are_not_made_ahead_of_time(tmp_path, monkeypatch):
    env = {aot_precompile.ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder = _compiled_holder()
    gathered = []
    for block in holder.layers.values():
        block.unshard = lambda: gathered.append(1)  # an FSDP2 block: gathering it is a collective
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: pytest.fail("compiled a sharded block"))
    p = aot_precompile.install(holder, rank=0, env=env)
    p.dispatch[0].seen = aot_precompile._record((torch.ones(2, 4),), {})
    summary = aot_precompile.after_first_step()
    assert summary["made"] == {"saved": False, "why": "the blocks are sharded over 2 ranks (FSDP): not supported yet"}
    assert not gathered and not p.path.exists()
    assert "not made (the blocks are sharded" in anatomy.aot_note(summary)


@pytest.mark.parametrize("env", [{}, {aot_precompile.ENV: "0"}, {aot_precompile.ENV: "1"}])
def test_off_by_default_and_nothing_without_a_cache_folder(env):
    assert aot_precompile.install(_compiled_holder(), rank=0, env=env) is None


CANARY = ("import pickle; from torch._dynamo.source import DefaultsSource, GlobalSource; "
          "s = DefaultsSource(GlobalSource('f'), 0); pickle.loads(pickle.dumps(s))")


def test_a_guard_on_a_default_argument_pickles_with_the_fix_and_torch_still_needs_it():
    """A torchtitan block's artefact holds guards on functions' default arguments (``DefaultsSource``); torch 2.11
    writes them so that they cannot be loaded (compat._fix_defaults_source_pickling). When this canary fails, torch
    pickles them right: delete the fix."""
    from torch._dynamo.source import DefaultsSource, GlobalSource

    broken = subprocess.run([sys.executable, "-c", CANARY], capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0 and "positional arguments" in broken.stderr, "torch fixed it: remove the shim"
    compat._fix_defaults_source_pickling()
    source = DefaultsSource(GlobalSource("f"), 1, is_kw=False)
    assert pickle.loads(pickle.dumps(source)) == source
