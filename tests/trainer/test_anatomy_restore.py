"""Start-up anatomy accounting (kubetitan_trainer.recovery.anatomy) and the node-local restore tier
(kubetitan_trainer.recovery.restore_tier) against DCP, in one process on CPU."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import runtime
from kubetitan_trainer.recovery import anatomy, restore_tier


# ------------------------------------------------------------------ anatomy
def test_phases_partition_origin_to_first_step_end():
    marks = {"origin": 100.0, "main": 101.5, "pg_begin": 103.0, "pg_end": 103.25, "load_begin": 106.0,
             "load_end": 110.0, "first_step_end": 125.0}
    p = anatomy.split(marks, compile_in_first_step=12.0)
    assert list(p) == list(anatomy.PHASES)
    assert p == {"process_start": 1.5, "preflight": 0.0, "imports": 1.5, "process_group_init": 0.25, "model_init": 2.75,
                 "checkpoint_load": 4.0, "first_step_compile": 12.0, "first_step": 3.0}
    assert sum(p.values()) == pytest.approx(25.0)


def test_warm_launcher_imports_move_from_process_start_to_imports_and_compile_is_capped_by_the_step():
    marks = {"origin": 0.0, "main": 10.0, "pg_begin": 10.5, "pg_end": 11.0, "first_step_end": 14.0}
    p = anatomy.split(marks, compile_in_first_step=99.0, warm_import_seconds=8.0)
    assert p["process_start"] == pytest.approx(2.0) and p["imports"] == pytest.approx(8.5)
    # no load marks: the load phase is 0 and model_init runs to the first step's start
    assert p["checkpoint_load"] == 0 and p["model_init"] == 0
    assert p["first_step_compile"] == pytest.approx(3.0) and p["first_step"] == 0
    assert sum(p.values()) == pytest.approx(14.0)
    # the launcher's wait for the pre-flight gate moves out of process_start too, capped by what is left of it
    g = anatomy.split(marks, compile_in_first_step=0.0, warm_import_seconds=8.0, preflight_seconds=1.5)
    assert (g["process_start"], g["preflight"], g["imports"]) == pytest.approx((0.5, 1.5, 8.5))
    g = anatomy.split(marks, compile_in_first_step=0.0, warm_import_seconds=8.0, preflight_seconds=30.0)
    assert (g["process_start"], g["preflight"]) == pytest.approx((0.0, 2.0)) and sum(g.values()) == pytest.approx(14.0)
    # a mark out of order (a clock step) never makes a negative phase
    q = anatomy.split({"origin": 5.0, "main": 4.0, "first_step_end": 6.0}, 0.0)
    assert min(q.values()) >= 0 and sum(q.values()) == pytest.approx(1.0)


def test_origin_is_the_detected_failure_for_an_in_place_generation_else_the_launcher_start():
    fresh = {"restarts": 0, "failures": [], "started": 50.0}
    assert anatomy.origin_of(fresh, 99.0) == (50.0, "launcher_start", 0)
    restarted = {"restarts": 2, "started": 50.0, "failures": [
        {"time": 60, "detected": 60.4, "restarted": True}, {"time": 80, "detected": 80.2, "restarted": True}]}
    assert anatomy.origin_of(restarted, 99.0) == (80.2, "failure_detected", 2)
    assert anatomy.origin_of({}, 99.0) == (99.0, "worker_start", 0)
    # the launcher's shared generation and the moment this agent began the restart win (a pod restarted
    # because a peer's worker failed records no failure of its own)
    peer = {"restarts": 0, "generation": 1, "started": 50.0, "failures": [], "restart_origin": 70.5,
            "restart_origin_kind": "peer_restart"}
    assert anatomy.origin_of(peer, 99.0) == (70.5, "peer_restart", 1)


def test_launcher_state_records_where_each_restart_began(tmp_path):
    from types import SimpleNamespace

    from kubetitan_trainer.launch.state import LauncherState

    st = LauncherState(str(tmp_path / "s.json"), started=5.0)
    st.failed({0: SimpleNamespace(timestamp=10, exitcode=-9)}, restarting=True, detected=10.25)
    st.restart_begins(now=11.0)
    assert (st.data["restart_origin"], st.data["restart_origin_kind"], st.data["restarts"]) == (10.25, "failure_detected", 1)
    st.restart_begins(now=20.0)  # no failure of its own this time: a peer's restart
    assert (st.data["restart_origin"], st.data["restart_origin_kind"]) == (20.0, "peer_restart")
    assert anatomy.read_launcher_state({anatomy.ENV_LAUNCHER_STATE: st.path})["failures"][0]["detected"] == 10.25


def test_recorder_gives_generation_0_the_warm_imports_and_closes_once(monkeypatch):
    rec = anatomy.Recorder({"restarts": 0, "failures": [], "started": 10.0, "warm_import_seconds": 3.0}, now=15.0)
    rec.mark("pg_begin", 15.5)
    rec.mark("pg_end", 16.0)
    rec.mark("pg_end", 99.0)  # a second mark of the same name is ignored
    rec.mark("load_begin", 16.5)
    rec.mark("load_end", 18.0)
    rec.load_source = "restore_tier"
    monkeypatch.setattr(anatomy, "compile_parts", iter([
        {"total_wall_time": 1.0, "entire_frame_compile": 1.0, "code_gen": 0.75},
        {"total_wall_time": 3.5, "entire_frame_compile": 3.5, "code_gen": 0.75, "backend_compile": 0.25}]).__next__)
    monkeypatch.setattr(anatomy, "compile_counts", iter([
        {"stats.unique_graphs": 3, "inductor.fxgraph_cache_hit": 2},
        {"stats.unique_graphs": 5, "inductor.fxgraph_cache_hit": 2, "aot_autograd.autograd_cache_hit": 2}]).__next__)
    rec.first_step_begins()
    r = rec.first_step_ends(step=11, attempt=2, t=21.0)
    assert r["compile_parts"] == {"backend_compile": 0.25, "entire_frame_compile": 2.5}  # unchanged parts dropped
    assert r["compile_counts"] == {"aot_autograd.autograd_cache_hit": 2, "stats.unique_graphs": 2}  # only growth
    assert anatomy.describe(r).endswith("first-step compile parts: entire_frame_compile 2.50, backend_compile 0.25"
                                        "; compile counts: aot_autograd.autograd_cache_hit 2, stats.unique_graphs 2")
    assert r["phases"]["process_start"] == pytest.approx(2.0) and r["phases"]["imports"] == pytest.approx(3.5)
    assert r["phases"]["first_step_compile"] == pytest.approx(2.5) and r["phases"]["first_step"] == pytest.approx(0.5)
    assert r["total_seconds"] == pytest.approx(11.0)
    assert (r["generation"], r["attempt"], r["first_step"], r["checkpoint_source"]) == (0, 2, 11, "restore_tier")
    assert rec.first_step_ends(step=12, attempt=2, t=30.0) is r
    assert "generation 0" in anatomy.describe(r) and "checkpoint: restore_tier" in anatomy.describe(r)
    # an in-place generation has no warm imports: its worker was forked from an already warm launcher
    gen1 = anatomy.Recorder({"restarts": 1, "started": 10.0, "warm_import_seconds": 3.0, "preflight": GATE,
                             "failures": [{"detected": 40.0, "restarted": True}]}, now=41.0)
    assert gen1.warm_import_seconds == 0 and gen1.marks["origin"] == 40.0 and gen1.generation == 1
    assert gen1.preflight == {}  # the gate ran once, before generation 0


GATE = {"status": "passed", "waited": 0.75, "node": "n1", "seconds": 2.5, "rows": [
    {"check": "matmul", "status": "passed", "detail": "right", "seconds": 0.5},
    {"check": "efa", "status": "skipped", "detail": "no EFA requested", "seconds": 0.0}]}
"""A launcher state's pre-flight record (``kubetitan_trainer.launch.gate.finish``)."""


def test_generation_0_s_record_has_the_gate_s_wait_as_its_preflight_phase_and_its_rows():
    rec = anatomy.Recorder({"restarts": 0, "failures": [], "started": 10.0, "warm_import_seconds": 3.0,
                            "preflight": GATE}, now=15.0)
    r = rec.first_step_ends(step=1, attempt=0, t=16.0)
    assert r["phases"]["process_start"] == pytest.approx(1.25) and r["phases"]["preflight"] == pytest.approx(0.75)
    assert r["total_seconds"] == pytest.approx(6.0) and r["preflight"] == GATE
    assert anatomy.describe(r).endswith("; pre-flight gate: passed in 2.50 s (waited 0.75 s), skipped: efa")
    off = anatomy.Recorder({"started": 10.0, "preflight": {"status": "disabled", "waited": 0.0}}, now=15.0)
    r = off.first_step_ends(step=1, attempt=0, t=16.0)
    assert r["phases"]["preflight"] == 0 and anatomy.describe(r).endswith("; pre-flight gate: off")


def test_compile_counts_count_the_graphs_torch_compile_traces():
    import torch

    before = anatomy.compile_counts()

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * 2 + 1

    f(torch.ones(3))
    f(torch.ones(3))  # the same graph, no new trace
    grown = anatomy.counts_spent(before, anatomy.compile_counts())
    assert grown.get("stats.unique_graphs") == 1 and grown.get("stats.calls_captured", 0) >= 2


def test_process_start_time_of_this_process_is_in_the_past():
    import time

    t = anatomy.process_start_time()
    assert t is not None and t <= time.time()
    assert anatomy.process_start_time(os.getpid()) == pytest.approx(t, abs=0.05)


def test_exporter_serves_each_phase_with_a_label(tmp_path):
    from prometheus_client import generate_latest

    from kubetitan_core import contract
    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=None, total_steps=10, attempt=1, job_start=0.0)
    rec = anatomy.Recorder({"restarts": 1, "failures": [{"detected": 1.0, "restarted": True}]}, now=2.0)
    r = rec.first_step_ends(step=5, attempt=1, t=4.0)
    ex.startup(r)
    text = generate_latest(ex.registry).decode()
    for phase in anatomy.PHASES:
        assert f'{contract.M_STARTUP_PHASE_SECONDS}{{phase="{phase}"}}' in text
    assert f"{contract.M_STARTUP_SECONDS} 3.0" in text and f"{contract.M_RESTART_GENERATION} 1.0" in text
    assert anatomy.append_log(tmp_path, r).read_text().count("\n") == 1


# ------------------------------------------------------------------ restore tier
class Box:
    """A Stateful (what torchtitan's optimizer/scheduler/train-state containers are to DCP)."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = {**self.sd, **sd}


def _trained(seed: int):
    """A model, an AdamW with state after two steps, and torchtitan's containers around them."""
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.components.optimizer import OptimizersContainer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    opt = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    for _ in range(2):
        model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    states = {"optimizer": opt, "train_state": Box({"step": 7 + seed, "note": b"bytes", "seconds": 1.5 * seed}),
              **ModelWrapper(model).state_dict()}
    return model, opt, states


def _flat(model, opt, states) -> dict:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for k, v in opt.state_dict().items():
        out[f"opt.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["train_state"] = dict(states["train_state"].state_dict())
    return out


def _loads_match_dcp(src, tier: Path, checkpoint: Path):
    """Fresh states (other seeds: other weights, optimizer moments and train state) loaded from the DCP checkpoint
    and from the tier both equal ``src``; the tier-loaded one is returned."""
    import torch.distributed.checkpoint as dcp

    via_dcp = _trained(seed=2)
    dcp.load(via_dcp[2], checkpoint_id=str(checkpoint))
    via_dcp[0].load_state_dict({k: v for k, v in via_dcp[2].items() if isinstance(v, torch.Tensor)})
    via_tier = _trained(seed=3)
    assert restore_tier.load(via_tier[2], tier, rank=0) > 0
    want = _flat(*src)
    assert _same(_flat(*via_dcp), want) and _same(_flat(*via_tier), want)
    return via_tier


def _same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    return True


@pytest.mark.parametrize("read", ["map", "pread"])
def test_tier_load_gives_the_same_state_as_a_dcp_load(tmp_path, monkeypatch, read):
    """Through either read of the tier's file (``restore_tier_read``)."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(restore_tier_read=read))

    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", tmp_path / "ckpt"
    dcp.save(restore_tier.materialise(src[2]), checkpoint_id=str(ckpt / "step-8"))
    n = restore_tier.save(src[2], tier, step=8, rank=0, world_size=1, checkpoint_folder=str(ckpt))
    assert n > 0 and restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=str(ckpt))
    if read == "pread":  # the load maps nothing of the tier
        monkeypatch.setattr(restore_tier, "mmap", None)

    via_tier = _loads_match_dcp(src, tier, ckpt / "step-8")
    assert via_tier[2]["train_state"].state_dict()["step"] == 8  # the Stateful got its load_state_dict


def test_a_stale_or_foreign_tier_is_not_used_and_a_misfit_copies_nothing(tmp_path):
    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    restore_tier.save(src[2], tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert not restore_tier.usable(tier, step=12, rank=0, world_size=1, checkpoint_folder=ckpt)  # stale step
    assert not restore_tier.usable(tier, step=8, rank=1, world_size=1, checkpoint_folder=ckpt)  # another rank
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=2, checkpoint_folder=ckpt)  # another world
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt + "x")
    assert not restore_tier.usable("", step=8, rank=0, world_size=1, checkpoint_folder=ckpt)

    torch.manual_seed(0)
    other = torch.nn.Linear(8, 5)  # another shape: the check fails before any tensor is touched
    before = other.weight.detach().clone()
    with pytest.raises(restore_tier.TierMismatch, match="keys differ"):
        restore_tier.prepare(dict(other.state_dict()), tier, rank=0)
    states = dict(src[2])
    states["0.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(restore_tier.TierMismatch, match=r"0.weight: tier bfloat16\[16, 8\]"):
        restore_tier.prepare(states, tier, rank=0)
    assert torch.equal(other.weight, before) and not states["0.weight"].any()

    # a later save overwrites the same file in place (same inode: its pages are reused) and is usable again
    ino = (tier / "rank-0.bin").stat().st_ino
    restore_tier.save(src[2], tier, step=12, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert (tier / "rank-0.bin").stat().st_ino == ino
    assert restore_tier.usable(tier, step=12, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    # a tier whose JSON is gone (a write that was cut off, or discard) is never used
    restore_tier.discard(tier, 0)
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert not list(tier.iterdir())


def test_the_tier_is_skipped_and_the_old_one_dropped_when_the_folder_lacks_room(tmp_path, monkeypatch, caplog):
    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    restore_tier.save(src[2], tier, step=4, rank=0, world_size=1, checkpoint_folder=ckpt)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(restore_tier.shutil, "disk_usage", lambda p: Usage(10, 10, 0))
    assert restore_tier.save(src[2], tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt) == 0
    assert "Restore tier skipped at step 8" in caplog.text and "/dev/shm size" in caplog.text
    assert not restore_tier.usable(tier, step=4, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert not list(tier.iterdir())  # the old one's memory is given back


def test_launcher_turns_the_tier_on_for_in_place_restarts_only():
    from kubetitan_trainer.launch.launcher import parse_args, restore_tier_folder

    base = ["--config=x", "--rdzv-id=ml-run-a0", "--node-rank=1"]
    assert restore_tier_folder(parse_args([*base, "--max-restarts=0"]), {}) == ""
    assert restore_tier_folder(parse_args([*base, "--max-restarts=2"]), {}) == "/dev/shm/kubetitan-restore-ml-run-a0-1"
    assert restore_tier_folder(parse_args([*base, "--max-restarts=2", "--restore-tier=off"]), {}) == ""
    assert restore_tier_folder(parse_args([*base, "--max-restarts=2", "--restore-tier=/x"]), {}) == "/x"
    env = {restore_tier.ENV_RESTORE_TIER: ""}
    assert restore_tier_folder(parse_args([*base, "--max-restarts=2"]), env) == ""


def test_in_place_launcher_keeps_cuda_uninitialised_before_torchrun_s_config(tmp_path, monkeypatch):
    """torchrun's LaunchConfig calls torch.cuda.is_available(): without the NVML-based check that initialises the
    CUDA runtime in the launcher, and every forked worker dies ("Cannot re-initialize CUDA in forked subprocess")."""
    import torch.distributed.run as tdr

    from kubetitan_trainer.launch import launcher as launch

    seen = {}

    def config_from_args(args):
        seen["nvml"] = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
        raise SystemExit(0)

    monkeypatch.setattr(tdr, "config_from_args", config_from_args)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setenv(restore_tier.ENV_RESTORE_TIER, str(tmp_path / "tier"))
    cfg = tmp_path / "t.toml"
    cfg.write_text("[job]\n")
    with pytest.raises(SystemExit):
        launch.main([f"--config={cfg}", "--max-restarts=1", "--dns-timeout=1"])
    assert seen["nvml"] == "1"


def test_compile_cache_folder_is_the_same_for_every_attempt_of_a_run(tmp_path):
    """A re-created gang (next attempt: new pods, same checkpoint volume) on the same GPU model finds the cache
    the previous attempt wrote: the rendered configs of two attempts give one folder."""
    from kubetitan_core import contract
    from kubetitan import plan
    from kubetitan_trainer.compile import compile_cache

    from support.specs import tiny_lpt

    obj = tiny_lpt({"precision": {"compile": True, "activationCheckpointing": "none", "mixedPrecisionParam": "float32"}})
    folders = set()
    for attempt in (0, 1, 7):
        cm, _svc, pod = plan.attempt_children(obj, attempt)
        cfg = tmp_path / f"a{attempt}.toml"
        cfg.write_text(cm["data"][contract.CONFIG_KEY])  # what the attempt's pods mount
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        assert env[contract.ENV_ATTEMPT] == str(attempt)
        folders.add(compile_cache.configure(str(cfg), env, gpus=["NVIDIA H200"]))
    assert len(folders) == 1 and "/compile-cache/" in folders.pop()


def test_the_tier_is_written_in_the_background_from_the_staged_copy_and_the_next_stage_waits(tmp_path):
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    from kubetitan_trainer.recovery.staging import ReusableStager
    from torch.distributed.checkpoint.staging import StagingOptions

    src = _trained(seed=1)
    stager = ReusableStager(StagingOptions(False, False, False, False))  # CPU: no pinning, synchronous staging
    writer = restore_tier.BackgroundWriter()
    calls = []
    stager.before_stage = lambda: calls.append("wait")
    staged = stager.stage(restore_tier.materialise(src[2]))
    assert calls == ["wait"] and stager.last_staged is staged
    fut: Future = Future()
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    writer.start(fut, str(tier), step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)  # staging not done
    fut.set_result(staged)
    writer.wait()
    assert restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    dcp.save(restore_tier.materialise(src[2]), checkpoint_id=ckpt + "/step-8")
    loaded = _trained(seed=3)
    restore_tier.load(loaded[2], tier, rank=0)
    assert _same(_flat(*loaded), _flat(*src))
    # a staging that failed leaves no tier (and raises nothing into training)
    bad: Future = Future()
    bad.set_exception(RuntimeError("staging failed"))
    writer.start(bad, str(tier), step=12, rank=0, world_size=1, checkpoint_folder=ckpt)
    writer.wait()
    assert not restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)


# ------------------------------------------------------------------ faster in-place restarts (issue 17)
def test_a_tier_newer_than_every_complete_checkpoint_is_agreed_only_when_every_rank_holds_that_step(tmp_path):
    """The tier is written before DCP's save, so a failure that cuts the step-N save off (no .metadata) still has
    N in every rank's tier: that step is loaded (no lost steps) only when every rank holds the same one."""
    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    assert restore_tier.tier_step(tier, rank=0, world_size=2, checkpoint_folder=ckpt) == -1  # none yet
    restore_tier.save(src[2], tier, step=8, rank=0, world_size=2, checkpoint_folder=ckpt)
    assert restore_tier.tier_step(tier, rank=0, world_size=2, checkpoint_folder=ckpt) == 8
    assert restore_tier.tier_step(tier, rank=0, world_size=1, checkpoint_folder=ckpt) == -1  # another world
    assert restore_tier.tier_step(tier, rank=0, world_size=2, checkpoint_folder=ckpt + "x") == -1  # another run
    assert restore_tier.tier_step("", rank=0, world_size=2, checkpoint_folder=ckpt) == -1

    every = lambda *steps: (lambda v: (min(v, *steps), max(v, *steps)))  # noqa: E731 - the other ranks' steps
    assert restore_tier.agreed_newer_step(8, 4, every(8)) == 8  # step-8's DCP save was cut off
    assert restore_tier.agreed_newer_step(8, -1, every(8)) == 8  # ... and it was the first save
    assert restore_tier.agreed_newer_step(8, 8, every(8)) == -1  # DCP's newest is that step: the usual path
    assert restore_tier.agreed_newer_step(8, 4, every(4)) == -1  # a peer died before its step-8 tier write
    assert restore_tier.agreed_newer_step(8, 4, every(-1)) == -1  # a peer has none
    restore_tier.discard(tier, 0)
    assert restore_tier.tier_step(tier, rank=0, world_size=2, checkpoint_folder=ckpt) == -1


def test_agents_rejoin_the_same_gang_through_one_counter_and_time_out_without_a_peer():
    import threading

    from torch.distributed import HashStore

    from kubetitan_trainer.launch.store import REJOIN_KEY, rejoin

    store = HashStore()
    assert not store.check([REJOIN_KEY.format(generation=1)])
    peer = threading.Thread(target=rejoin, args=(store, 1, 2, 60.0))
    peer.start()  # whichever agent adds first waits for the other; its add is the announcement peers poll for
    rejoin(store, 1, 2, 60.0)
    peer.join(timeout=60)
    assert not peer.is_alive() and store.add(REJOIN_KEY.format(generation=1), 0) == 2

    now = [0.0]
    with pytest.raises(TimeoutError, match="only 1 of 2 nodes rejoined for worker generation 2 within 5 s"):
        rejoin(store, 2, 2, 5.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + 1.0))


def test_each_worker_generation_gets_its_own_prefix_in_the_agents_store(monkeypatch):
    """Workers share the agents' TCPStore (up before any worker starts: no reconnect back-off), each generation
    under its own prefix, so a restarted generation never reads the previous one's process-group keys."""
    from datetime import timedelta
    import importlib

    from torch.distributed import TCPStore

    from kubetitan_trainer.launch.launcher import generation_scoped_agent_store

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setattr(rdzv, "_create_c10d_store", rdzv._create_c10d_store)  # restored after the test
    server = TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    generation_scoped_agent_store(3)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    client = rdzv._create_c10d_store("127.0.0.1", server.port, 1, 2, timedelta(seconds=10))
    client.set("rank_1", "addr")
    assert server.get("kubetitan/generation-3/rank_1") == b"addr" and not server.check(["rank_1"])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a worker's own store (static path): unprefixed
    assert not isinstance(rdzv._create_c10d_store("127.0.0.1", server.port, 1, 2, timedelta(seconds=10)),
                          type(client))


def test_a_warm_launcher_parses_the_config_once_for_every_forked_worker(tmp_path, monkeypatch):
    from torchtitan.config import ConfigManager

    from kubetitan_trainer.launch.launcher import memoize_config_parse

    monkeypatch.setattr(ConfigManager, "parse_args", ConfigManager.parse_args)  # restored after the test
    calls = []
    original = ConfigManager.parse_args

    def counted(self, args):
        calls.append(list(args))
        return original(self, args)

    monkeypatch.setattr(ConfigManager, "parse_args", counted)
    cfg = tmp_path / "t.toml"
    cfg.write_text('[training]\nsteps = 7\n')
    argv = ["--job.config_file", str(cfg)]
    memoize_config_parse(argv)  # the launcher's one parse
    a, b = ConfigManager().parse_args(argv), ConfigManager().parse_args(list(argv))  # two workers'
    assert len(calls) == 1 and a.training.steps == b.training.steps == 7
    a.training.steps = 99  # each worker gets its own copy
    assert ConfigManager().parse_args(argv).training.steps == 7
    cfg.write_text('[training]\nsteps = 8\n')  # another file (size, mtime): parsed again
    assert ConfigManager().parse_args(argv).training.steps == 8 and len(calls) == 2
