"""Ahead-of-time compiled blocks (kubetitan_trainer.compile.aot_precompile) on CPU: each rank makes its artefact after its first
step; a fresh process loads it and its blocks run it without a Dynamo trace, with the eager model's numbers; what
its guards do not cover falls back to the block's own compile; a worker that died using it makes the next one
delete it."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import compat, runtime
from kubetitan_trainer.compile import aot_precompile, compile_cache
from kubetitan_trainer.recovery import anatomy
from kmockx.harness import free_port

from support import warm
from support.paths import REPO

@pytest.fixture(autouse=True)
def _aot_compile_on(monkeypatch):
    """``[kubetitan.runtime] aot_compile = true`` in this process (a test of the off switch sets it back)."""
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=True))


PROBE = textwrap.dedent("""
    import json, os
    import torch
    import torch._inductor.cpu_vec_isa as cpu_vec_isa
    from kubetitan_core.contract.trainer_toml import KubetitanRuntime
    from kubetitan_trainer import compat, runtime
    from kubetitan_trainer.compile import aot_precompile
    from tests.trainer.aot_rank import Block  # a transformer block's signature and a few of its parts

    runtime.use(KubetitanRuntime(aot_compile=True))  # [kubetitan.runtime] aot_compile = true
    cpu_vec_isa.valid_vec_isa_list = list  # scalar C++ kernels: no per-process gcc probes of the CPU (~9 s each)

    torch.set_num_threads(1)

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
    p = p[0] if p else None
    before = compat.compile_counts().get("stats.unique_graphs", 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the recipe trains (mixed precision without FSDP)
        got = run(m, x.clone().requires_grad_(), freqs)
    traced = compat.compile_counts().get("stats.unique_graphs", 0) - before
    summary = aot_precompile.after_first_step()
    aot_precompile.step_ended()  # as the trainer calls it after each step: the crash marker outlives step 1 ...
    markers = [sorted(f for f in os.listdir(aot_precompile.folder()) if ".trying-" in f)]
    aot_precompile.step_ended()  # ... and goes after step 2
    markers.append(sorted(f for f in os.listdir(aot_precompile.folder()) if ".trying-" in f))
    no_grad = None
    if p.artefact is not None:  # not what the artefact was made for: its guards refuse it, and name the guard
        inner = compat.compiled_module_parts(m.layers["0"])[0]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            no_grad = [compat.aot_run(p.artefact.get(), inner, (x.clone(), freqs, None), {})[0],
                       compat.aot_guard_failure(p.artefact.get(), inner, (x.clone(), freqs, None), {})]
    print(json.dumps({"summary": summary, "traced": traced, "no_grad": no_grad, "markers": markers,
                      "diff": [float((a - b).abs().max()) for a, b in zip(got, ref)],
                      "files": sorted(os.listdir(aot_precompile.folder()))}))
""")



def _install(model, **kwargs):
    """``aot_precompile.install`` for a model whose blocks are all of one kind: that kind's ``Precompiled``."""
    got = aot_precompile.install(model, **kwargs)
    if got is None:
        return None
    assert len(got) == 1, got
    return got[0]


def _probe(cache, env=None):
    """PROBE in a fresh process (forked from the tests' warm parent: torch imported, nothing compiled)."""
    e = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
         **(env or {})}
    code, output = warm.run_code(PROBE, cache, e)
    assert code == 0, output[-3000:]
    return warm.last_json(output)


def test_a_single_process_makes_the_artefact_and_a_fresh_process_runs_it_without_tracing(tmp_path):
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
    assert second["markers"] == [[artefacts[0] + ".trying-rank0"], []]  # the crash marker goes after step 2
    assert not [f for f in second["files"] if ".making" in f]


def _ranks(tmp_path: Path, cache: Path, launch: str) -> list[dict]:
    """tests/trainer/aot_rank.py as two gloo ranks of one node (torchrun's variables), forked from the warm parent."""
    out = tmp_path / launch
    out.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton")}
    logs = [out / f"rank{i}.log" for i in (0, 1)]
    procs = [warm.popen("tests.trainer.aot_rank", [str(out)], {**env, "RANK": str(i), "LOCAL_RANK": str(i)}, logs[i],
                        cwd=REPO) for i in (0, 1)]
    codes = warm.wait_all(procs, timeout=300)
    for code, log in zip(codes, logs):
        assert code == 0, log.read_text(errors="replace")[-4000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]


def test_every_rank_of_an_fsdp_gang_makes_its_own_artefact_and_a_restarted_gang_runs_them_without_tracing(tmp_path):
    first = _ranks(tmp_path, tmp_path / "cache", "first")
    for r in first:  # each rank made its own, for its local rank and device, while both gathered the sharded block
        assert r["summary"]["made"]["saved"] is True and r["summary"]["loaded"] is False, r["summary"]
        assert r["traced"] >= 1 and r["device"] == "cpu"
    files = lambda: sorted(os.listdir(tmp_path / "cache" / aot_precompile.SUBDIR))  # noqa: E731 - both ranks ended
    artefacts = [f for f in files() if f.endswith(".aot")]
    assert sorted(f[-8:] for f in artefacts) == ["-lr0.aot", "-lr1.aot"], files()
    assert len({f[:-8] for f in artefacts}) == 2  # the local rank is in the hash too

    second = _ranks(tmp_path, tmp_path / "cache", "second")
    for a, b in zip(first, second):  # every block call of every rank ran its own artefact: no trace, the same numbers
        s = b["summary"]
        assert s["loaded"] is True and s["served"] == 2 and s["fell_back"] == 0 and "made" not in s, s
        assert b["traced"] == 0
        assert (b["out"], b["x_grad"], b["w_grad"]) == (a["out"], a["x_grad"], a["w_grad"])
    assert second[0]["w_grad"] == second[1]["w_grad"]  # one reduced gradient
    assert not [f for f in files() if ".making" in f or ".trying-" in f]

    # A node whose rank 1 lost its artefact (a replaced disk, a new node): that rank makes one again while rank 0,
    # which has its own and serves from it, only joins the gather of the sharded block.
    (tmp_path / "cache" / aot_precompile.SUBDIR / next(f for f in artefacts if f.endswith("-lr1.aot"))).unlink()
    third = _ranks(tmp_path, tmp_path / "cache", "third")
    assert third[0]["summary"]["served"] == 2 and "made" not in third[0]["summary"] and third[0]["traced"] == 0
    assert third[1]["summary"]["loaded"] is False and third[1]["summary"]["made"]["saved"] is True
    assert (third[1]["out"], third[1]["w_grad"]) == (first[1]["out"], first[1]["w_grad"])


def _compiled_holder(backend: str = "inductor"):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleDict({str(i): torch.compile(torch.nn.Linear(4, 4), fullgraph=True, backend=backend)
                                    for i in range(2)})
    return m


def test_a_worker_that_died_using_the_artefact_makes_the_next_one_delete_it(tmp_path, monkeypatch):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: None)
    first = _install(_compiled_holder(), rank=1, env=env)
    assert first.artefact is None and first.capture  # no artefact yet: every rank makes its own
    first.path.parent.mkdir(parents=True)
    first.path.write_bytes(b"artefact")
    rank0 = _install(_compiled_holder(), rank=0, env=env)
    assert rank0.artefact is not None and rank0.marker.read_text() == aot_precompile.process_token()
    # another model part of the same process (pipeline stages) and another rank's live worker keep it
    assert _install(_compiled_holder(), rank=0, env=env).artefact is not None
    assert _install(_compiled_holder(), rank=1, env=env).artefact is not None
    # ... rank 0's worker died before its second step ended, and the next worker is another process: with another
    # pid, or with the same one (a container restarted in a new PID namespace starts its processes in the same order)
    for same_pid in (False, True):
        first.path.write_bytes(b"artefact")
        dead = aot_precompile.process_token()
        if same_pid:  # this process plays the next one: the same pid, a token of its own
            monkeypatch.setattr(aot_precompile, "_TOKENS", {})
        else:
            dead = "999999-0123456789ab"
        rank0.marker.write_text(dead)
        nxt = _install(_compiled_holder(), rank=0, env=env)
        assert not nxt.path.exists() and not nxt.marker.exists(), dead
        assert nxt.artefact is None and nxt.capture  # rank 0 makes a new one after its first step
        assert nxt.crashed.read_text() == "1"  # (the count of such deletions in a row: tested below)
        nxt.crashed.unlink()


def test_each_local_rank_and_device_has_an_artefact_of_its_own(tmp_path):
    inner = compat.compiled_module_parts(_compiled_holder().layers["0"])[0]
    base = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    names = {aot_precompile.artefact_name(inner, {**base, "LOCAL_RANK": str(r)}, f"cuda:{r}") for r in range(8)}
    assert len(names) == 8 and all(n.startswith("Linear-") for n in names)
    assert aot_precompile.artefact_name(inner, {**base, "LOCAL_RANK": "3"}, "cuda:3").endswith("-lr3.aot")
    # the same local rank on another device (the guards check it) is another artefact
    assert (aot_precompile.artefact_name(inner, {**base, "LOCAL_RANK": "0"}, "cuda:0")
            != aot_precompile.artefact_name(inner, {**base, "LOCAL_RANK": "0"}, "cpu"))
    p = _install(_compiled_holder(), rank=9, env={**base, "LOCAL_RANK": "1", "RANK": "9"})
    assert p is not None and p.capture and p.path.name.endswith("-lr1.aot") and p.device == "cpu"
    assert p.marker.name.endswith(".trying-rank9")


class _Wrapper(torch.nn.Module):
    """Another kind of block (as activation checkpointing's ``CheckpointWrapper`` wraps every N-th one)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_each_kind_of_block_has_its_own_artefact_and_every_call_of_both_is_served(tmp_path, monkeypatch):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def holder():  # blocks 0 and 2 plain, block 1 wrapped: two kinds, as the H100 recipe's every-7th-block AC
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleDict({str(i): torch.compile(_Wrapper(torch.nn.Linear(4, 4)) if i == 1 else
                                                             torch.nn.Linear(4, 4), fullgraph=True) for i in range(3)})
        return m

    made = []
    monkeypatch.setattr(compat, "aot_compile_module", lambda wrapper, *a: made.append(wrapper) or "compiled")
    monkeypatch.setattr(compat, "aot_serialize", lambda c: b"artefact")
    first = aot_precompile.install(holder(), rank=0, env=env)
    assert [len(p.blocks) for p in first] == [2, 1]
    assert [p.path.name.split("-")[0] for p in first] == ["Linear", "_Wrapper"]
    for block in first[0].blocks + first[1].blocks:
        block(torch.ones(2, 4))
    summary = aot_precompile.after_first_step()
    assert [compat.compiled_module_parts(w)[0].__class__.__name__ for w in made] == ["Linear", "_Wrapper"]
    assert summary["made"]["saved"] is True and summary["fell_back"] == 3 and all(p.path.exists() for p in first)
    assert set(summary["kinds"]) == {"Linear", "_Wrapper"}

    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    monkeypatch.setattr(compat, "aot_run", lambda compiled, module, args, kwargs: (True, type(module).__name__))
    second = aot_precompile.install(holder(), rank=0, env=env)
    assert [p.artefact is not None for p in second] == [True, True]
    layers = [second[0].blocks[0], second[1].blocks[0], second[0].blocks[1]]
    assert [b(torch.ones(2, 4)) for b in layers] == ["Linear", "_Wrapper", "Linear"]
    summary = aot_precompile.after_first_step()
    assert (summary["loaded"], summary["served"], summary["fell_back"], "made" in summary) == (True, 3, 0, False)
    assert "3 calls served, 0 compiled as usual" in anatomy.aot_note(summary)

    # one kind's artefact gone (a partial copy of the folder): that kind is made again, the other one still loads
    second[1].path.unlink()
    third = aot_precompile.install(holder(), rank=0, env=env)
    for block in third[0].blocks + third[1].blocks:
        block(torch.ones(2, 4))
    summary = aot_precompile.after_first_step()
    assert summary["kinds_loaded"] == [1, 2] and summary["made"]["saved"] is True and third[1].path.exists()
    note = anatomy.aot_note(summary)
    assert "loaded 1 of 2 kinds in" in note and "2 calls served, 1 compiled as usual; made in" in note, note

    # making one kind fails: the record says which part was made and why the other was not
    third[1].path.unlink()
    monkeypatch.setattr(compat, "aot_compile_module", lambda wrapper, *a: (_ for _ in ()).throw(
        RuntimeError("no graph")) if isinstance(compat.compiled_module_parts(wrapper)[0], _Wrapper) else "compiled")
    third[0].path.unlink()
    fourth = aot_precompile.install(holder(), rank=0, env=env)
    for block in fourth[0].blocks + fourth[1].blocks:
        block(torch.ones(2, 4))
    note = anatomy.aot_note(aot_precompile.after_first_step())
    assert "none to load" in note and "made 1 of 2 kinds in" in note and "not made (RuntimeError: no graph)" in note, \
        note


def test_blocks_still_on_the_meta_device_are_named_for_the_processs_gpu(monkeypatch):
    with torch.device("meta"):
        block = torch.nn.Linear(4, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert aot_precompile._device(block) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert aot_precompile._device(block) == "cuda:3"  # torchtitan materialises them on the rank's GPU later
    assert aot_precompile._device(torch.nn.Linear(4, 4)) == "cpu"  # real parameters: theirs


def test_a_served_call_uses_the_artefact_and_anything_else_the_blocks_own_compile(tmp_path, monkeypatch):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    (tmp_path / aot_precompile.SUBDIR).mkdir()
    holder = _compiled_holder()
    inner = compat.compiled_module_parts(holder.layers["0"])[0]
    (tmp_path / aot_precompile.SUBDIR / aot_precompile.artefact_name(inner, env)).write_bytes(b"x")
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    calls = []

    def run(compiled, module, args, kwargs):
        calls.append((compiled, module))
        return (args[0].shape[0] == 3), "served"

    monkeypatch.setattr(compat, "aot_run", run)
    monkeypatch.setattr(compat, "aot_guard_failure", lambda compiled, module, args, kwargs: "size mismatch at index 0")
    p = _install(holder, rank=0, env=env)
    assert holder.layers["0"](torch.ones(3, 4)) == "served" and calls[-1] == ("compiled", inner)
    fallback = holder.layers["1"](torch.ones(2, 4))  # guards refuse: the block's own torch.compile forward
    assert isinstance(fallback, torch.Tensor) and fallback.shape == (2, 4)
    summary = aot_precompile.after_first_step()
    assert summary["loaded"] and summary["served"] == 1 and summary["fell_back"] == 1 and not p.capture
    assert summary["refused"] == "size mismatch at index 0"  # why the artefact was not used, in the record
    assert p.path.exists() and "made" not in summary  # it served a call: kept
    aot_precompile.step_ended()
    assert p.marker.exists()
    aot_precompile.step_ended()
    assert not p.marker.exists()


@pytest.mark.parametrize("case", ["this-rank-makes", "another-rank-makes", "nobody-makes", "a-rank-without-aot"])
def test_a_sharded_block_is_gathered_by_every_rank_when_any_rank_makes_an_artefact(tmp_path, monkeypatch, case):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder = _compiled_holder()
    calls = []
    for block in holder.layers.values():  # an FSDP2 block: gathering it is a collective every rank must join
        block.unshard = lambda: calls.append("unshard")
        block.reshard = lambda: calls.append("reshard")
    compiled = []
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: compiled.append(1) or "compiled")
    monkeypatch.setattr(compat, "aot_serialize", lambda c: b"artefact")
    p = _install(holder, rank=1, env=env)
    p.dispatch[0].seen = aot_precompile._record((torch.ones(2, 4),), {})
    votes = []
    others = {"this-rank-makes": (False, True), "another-rank-makes": (True, True), "nobody-makes": (False, True),
              "a-rank-without-aot": (True, False)}[case]  # (another rank makes one, every other rank installed)
    if case != "this-rank-makes":  # this rank has its artefact already, or cannot make one
        p.capture = case == "a-rank-without-aot"

    def agree(makes, installed):
        votes.append((makes, installed))
        return makes or others[0], installed and others[1]

    monkeypatch.setattr(aot_precompile, "agree", agree)
    summary = aot_precompile.after_first_step()
    assert votes == [(case in ("this-rank-makes", "a-rank-without-aot"), True)]
    gathered = case in ("this-rank-makes", "another-rank-makes")
    assert calls == (["unshard", "reshard"] if gathered else [])
    assert bool(compiled) == (case == "this-rank-makes") and p.path.exists() == (case == "this-rank-makes")
    if case == "a-rank-without-aot":
        assert summary["made"] == {"saved": False, "why": aot_precompile.NOT_EVERY_RANK}
        assert "not made (not every rank could take part: another rank has no compiled blocks" in \
            anatomy.aot_note(summary)


def test_the_trainers_agreement_decides_and_a_rank_not_at_its_first_step_stops_every_gather(tmp_path, monkeypatch):
    """The trainer votes with the first step's own all-reduce (``vote`` then ``after_first_step(decision)``, no
    collective of its own): when another rank was not at its first step (an in-process restart between the step's
    agreement and its record on one rank), no rank gathers, so none waits on a collective the others never call."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder = _compiled_holder()
    calls = []
    for block in holder.layers.values():
        block.unshard = lambda: calls.append("unshard")
        block.reshard = lambda: calls.append("reshard")
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: pytest.fail("made an artefact"))
    monkeypatch.setattr(aot_precompile, "agree", lambda *a: pytest.fail("a collective of its own"))
    p = _install(holder, rank=0, env=env)
    holder.layers["0"](torch.ones(2, 4))
    assert aot_precompile.vote() == (True, True)  # this rank makes one and is ready
    summary = aot_precompile.after_first_step((True, False))  # ... but another rank is not ready
    assert calls == [] and not p.path.exists()
    assert summary["made"] == {"saved": False, "why": aot_precompile.NOT_EVERY_RANK} and summary["fell_back"] == 1
    assert aot_precompile.after_first_step((True, True)) is None  # once per vote


def test_a_rank_that_installed_nothing_still_joins_the_vote(monkeypatch):
    votes = []
    monkeypatch.setattr(aot_precompile, "CURRENT", [])
    monkeypatch.setattr(aot_precompile, "agree", lambda makes, installed: votes.append((makes, installed)) or (1, 0))
    assert aot_precompile.after_first_step() is None and votes == [(False, False)]


@pytest.mark.parametrize("on", [False, True])
def test_off_by_default_and_nothing_without_a_cache_folder(on, monkeypatch):
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(aot_compile=on))
    assert _install(_compiled_holder(), rank=0, env={}) is None


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


def _with_artefact(tmp_path, env, body=b"x"):
    """A holder of two compiled blocks and an artefact file for them (loading it is monkeypatched by the caller);
    the blocks' own compile is Dynamo's with the eager backend (no C++ build on CPU)."""
    holder = _compiled_holder("eager")
    inner = compat.compiled_module_parts(holder.layers["0"])[0]
    path = tmp_path / aot_precompile.SUBDIR / aot_precompile.artefact_name(inner, env)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(body)
    return holder, inner, path


@pytest.mark.parametrize("where", ["block", "submodule", "global"])
def test_a_block_with_hooks_is_never_served_nor_made_into_an_artefact_and_keeps_a_good_one(tmp_path, monkeypatch,
                                                                                          where):
    """The artefact holds the graph traced without hooks, and Dynamo does not guard on them: a block with a hook on
    it, on a module inside it, or on every module runs its own compile (a pre-hook that doubles the input of the
    block's linear must double it), rank 0 makes no artefact of it, and an artefact already there is not blamed."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({str(i): torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                                               fullgraph=True, backend="eager") for i in range(2)})
    inner = compat.compiled_module_parts(holder.layers["0"])[0]
    path = tmp_path / aot_precompile.SUBDIR / aot_precompile.artefact_name(inner, env)
    path.parent.mkdir()
    path.write_bytes(b"good")
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    monkeypatch.setattr(compat, "aot_run", lambda *a: pytest.fail("served a block that has hooks"))
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: pytest.fail("made an artefact of a hooked block"))
    double = lambda module, args: (args[0] * 2,)  # noqa: E731
    if where == "global":
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: (args[0] * 2,) if isinstance(module, torch.nn.Linear) else None)
    else:
        handle = (inner if where == "block" else inner[0]).register_forward_pre_hook(double)
    try:
        p = _install(holder, rank=0, env=env)
        x = torch.ones(3, 4)
        with torch.enable_grad():
            got = holder.layers["0"](x)
        assert torch.allclose(got, torch.nn.functional.linear(2 * x, inner[0].weight, inner[0].bias))
        summary = aot_precompile.after_first_step()
        assert summary["served"] == 0 and "hooks" in summary["refused"], summary
        assert {"block": "forward_pre_hooks", "submodule": "forward_pre_hooks on 0",
                "global": "global forward_pre_hooks"}[where] in summary["refused"]
        assert path.read_bytes() == b"good" and "made" not in summary  # not blamed: kept, and nothing made
        path.unlink()  # without an artefact, rank 0 would make one: not of a hooked block
        p = _install(holder, rank=0, env=env)
        with torch.enable_grad():
            holder.layers["0"](x)
        made = aot_precompile.after_first_step()["made"]
        assert made["saved"] is False and made["why"].startswith("the block has hooks the artefact would skip")
    finally:
        handle.remove()


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_a_cache_folder_that_cannot_be_written_never_stops_the_run(tmp_path, monkeypatch, err):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder, _, path = _with_artefact(tmp_path, env)

    def refuse(p, body):
        raise OSError(err, os.strerror(err), str(p))

    monkeypatch.setattr(aot_precompile, "_write", refuse)
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: pytest.fail("compiled without a .making marker"))
    p = _install(holder, rank=0, env=env)  # the crash marker cannot be written: not used
    assert p.artefact is None and path.exists()
    path.unlink()
    p.dispatch[0].seen = aot_precompile._record((torch.ones(2, 4),), {})
    summary = aot_precompile.after_first_step()
    assert summary["made"]["saved"] is False and os.strerror(err) in summary["made"]["why"]


def test_the_write_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "a" / "artefact.aot"

    def full(fd):  # the data written, the flush to the disk fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        aot_precompile._write(target, b"body")
    assert os.listdir(target.parent) == []


def test_a_worker_that_died_making_the_artefact_stops_the_next_ones_from_trying(tmp_path, monkeypatch):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    made = []

    def compile_module(wrapper, args, kwargs, contexts):
        made.append(p.making.read_text())  # the marker is there while it compiles
        return "compiled"

    monkeypatch.setattr(compat, "aot_compile_module", compile_module)
    monkeypatch.setattr(compat, "aot_serialize", lambda compiled: b"artefact")
    p = _install(_compiled_holder(), rank=0, env=env)
    p.dispatch[0].seen = aot_precompile._record((torch.ones(2, 4),), {})
    assert aot_precompile.after_first_step()["made"]["saved"] is True
    assert made == [aot_precompile.process_token()] and not p.making.exists() and p.path.read_bytes() == b"artefact"
    p.path.unlink()
    p.making.write_text("999999-0123456789ab")  # a worker died while it compiled
    nxt = _install(_compiled_holder(), rank=0, env=env)
    assert not nxt.capture and nxt.making.exists()  # nobody tries again until the file is deleted
    nxt.making.unlink()
    assert _install(_compiled_holder(), rank=0, env=env).capture


@pytest.mark.parametrize("why", ["load-error", "refused-every-call"])
def test_an_artefact_that_cannot_serve_is_replaced_by_rank_0(tmp_path, monkeypatch, why):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder, _, path = _with_artefact(tmp_path, env, body=b"stale")

    def load(data):
        if why == "load-error":
            raise RuntimeError("unpickling a stale artefact")
        return "compiled"

    monkeypatch.setattr(compat, "aot_deserialize", load)
    monkeypatch.setattr(compat, "aot_run", lambda *a: (False, None))
    monkeypatch.setattr(compat, "aot_guard_failure", lambda *a: "a guard of another run")
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: "compiled")
    monkeypatch.setattr(compat, "aot_serialize", lambda compiled: b"fresh")
    p = _install(holder, rank=0, env=env)
    with torch.enable_grad():
        holder.layers["0"](torch.ones(2, 4))  # falls back to the block's own compile, and is recorded
    summary = aot_precompile.after_first_step()
    assert summary["served"] == 0 and summary["made"]["saved"] is True
    assert path.read_bytes() == b"fresh" and not p.marker.exists()


def test_the_artefact_is_named_by_the_compile_cache_key_even_when_the_pod_chose_the_folder(tmp_path):
    inner = torch.nn.Linear(2, 2)
    names = {aot_precompile.artefact_name(inner, {compile_cache.KEY_ENV: k}) for k in ("a", "b", "")}
    assert len(names) == 3 and all(n.startswith("Linear-") and n.endswith(".aot") for n in names)
    assert aot_precompile.artefact_name(inner, {compile_cache.KEY_ENV: "a"}) in names  # stable
    import torch._inductor.config as inductor_config

    for scale in (True, False):  # kernels compiled under another Inductor setting kubetitan changes: another artefact
        with inductor_config.patch(dynamic_scale_rblock=scale):
            names.add(aot_precompile.artefact_name(inner, {compile_cache.KEY_ENV: "a"}))
    assert len(names) == 4
    keys = []
    for backend in ("inductor", "aot_eager"):  # a [compile] change: another key, so another artefact
        cfg = tmp_path / f"{backend}.toml"
        cfg.write_text(f'[job]\ndump_folder = "{tmp_path}"\n[compile]\nenable = true\nbackend = "{backend}"\n')
        env = {"TORCHINDUCTOR_CACHE_DIR": "/users/own/cache"}  # the pod's env chose the folder: kept
        compile_cache.configure(str(cfg), env, gpus=[])
        assert env["TORCHINDUCTOR_CACHE_DIR"] == "/users/own/cache"
        keys.append(aot_precompile.artefact_name(inner, env))
    assert keys[0] != keys[1]


def _next_process(monkeypatch):
    """This test process plays the next worker: the same pid, a token of its own."""
    monkeypatch.setattr(aot_precompile, "_TOKENS", {})


def test_an_artefact_that_kills_every_worker_running_it_is_made_again_once_then_never(tmp_path, monkeypatch):
    """A deterministic fault in the artefact: each crash deletes it and rank 0 would make the same one again after
    its first step, for a crash every other restart. After MAX_CRASHES deletions in a row nobody makes it."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    monkeypatch.setattr(compat, "aot_compile_module", lambda *a: "compiled")
    monkeypatch.setattr(compat, "aot_serialize", lambda compiled: b"artefact")
    made, crashes = [], 0
    for generation in range(8):
        _next_process(monkeypatch)
        p = _install(_compiled_holder("eager"), rank=0, env=env)
        if p.artefact is not None:  # this worker runs the artefact and dies in its first step
            crashes += 1
            continue
        p.dispatch[0].seen = aot_precompile._record((torch.ones(2, 4),), {})
        summary = aot_precompile.after_first_step()  # trains without one; rank 0 makes one unless told not to
        made.append(summary["made"]["saved"])
        aot_precompile.step_ended()
        aot_precompile.step_ended()
    assert crashes == aot_precompile.MAX_CRASHES and made[:2] == [True, True] and not any(made[2:])
    assert "artefacts in a row were deleted" in summary["made"]["why"] and p.crashed.read_text() == "2"


def test_an_artefact_that_serves_past_the_second_step_resets_the_count_and_a_clean_end_removes_the_marker(
        tmp_path, monkeypatch):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder, _, path = _with_artefact(tmp_path, env)
    monkeypatch.setattr(compat, "aot_deserialize", lambda data: "compiled")
    monkeypatch.setattr(compat, "aot_run", lambda *a: (True, torch.zeros(1)))
    p = _install(holder, rank=0, env=env)
    p.crashed.write_text("1")  # one crash before: this worker runs it through its second step
    holder.layers["0"](torch.ones(2, 4))
    aot_precompile.after_first_step()
    aot_precompile.step_ended()
    assert p.marker.exists() and p.crashed.exists()
    aot_precompile.step_ended()
    assert not p.marker.exists() and not p.crashed.exists()
    # a worker that stops cleanly after one step (SIGTERM, or the run's last step) is no crash either
    _next_process(monkeypatch)
    p = _install(holder, rank=0, env=env)
    holder.layers["0"](torch.ones(2, 4))
    aot_precompile.after_first_step()
    aot_precompile.step_ended()
    assert p.marker.exists()
    aot_precompile.training_ended()
    assert not p.marker.exists()
    _next_process(monkeypatch)
    assert _install(holder, rank=0, env=env).artefact is not None and path.exists()


def test_a_crashed_artefact_in_a_read_only_folder_is_not_run(tmp_path, monkeypatch):
    """It cannot be deleted, nor a marker written: the worker compiles as usual and nothing raises."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    holder, _, path = _with_artefact(tmp_path, env)
    marker = path.with_name(path.name + ".trying-rank0")
    marker.write_text("999999-0123456789ab")  # a worker died running it
    real_unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self.parent == path.parent:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    def refuse(p, body):
        raise OSError(errno.EROFS, "Read-only file system", str(p))

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(aot_precompile, "_write", refuse)
    p = _install(holder, rank=0, env=env)
    assert p.artefact is None and path.exists() and marker.exists()
