"""The staging arena (kubetitan_trainer.recovery.arena): DCP's staged copy in a file of the restore tier's folder that outlives
the worker, the stager that stages into it, and the restore tier that points into it (issue 29), on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from torch.distributed.checkpoint.staging import StagingOptions

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import runtime
from kubetitan_trainer.recovery import arena, restore_tier
from kubetitan_trainer.recovery.staging import ReusableStager

from .test_anatomy_restore import _loads_match_dcp, _trained

CPU_STAGING = StagingOptions(False, True, False, False)
"""On CPU: no pinning (no CUDA), shared storages as torchtitan asks, synchronous staging (stage returns the copy)."""

CHILD_PATH = os.pathsep.join(sys.path)


def _child(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": CHILD_PATH},
                            stdout=subprocess.PIPE, text=True, **kw)


def _inside(t: torch.Tensor, a: arena.Arena) -> bool:
    return t.numel() == 0 or a.place(t) is not None


def test_an_arena_is_reused_across_processes_with_its_bytes_and_re_created_at_another_size(tmp_path):
    state = "{'a': torch.zeros(75, dtype=torch.int32), 'b': [torch.zeros(10, 10)]}"
    child = _child(
        "import torch\nfrom kubetitan_trainer.recovery import arena\n"
        f"a = arena.open_arena({str(tmp_path)!r}, 3, {state})\nassert a.count == 2\n"
        "s = a.storage(300); s.copy_(torch.arange(300, dtype=torch.int16).to(torch.uint8).untyped_storage())\n"
        "a.storage(400)\nprint((a.folder / '0.bin').stat().st_ino, a.created, a.reused)\n")
    ino, created, reused = map(int, child.communicate(timeout=120)[0].split())
    assert child.returncode == 0 and (created, reused) == (2, 0)

    state = {"a": torch.zeros(75, dtype=torch.int32), "b": [torch.zeros(10, 10)]}
    again = arena.open_arena(tmp_path, 3, state)  # the same sizes: the same files, their bytes still there
    first = again.storage(300)
    assert again.reused == 1 and (tmp_path / "staging-rank-3" / "0.bin").stat().st_ino == ino
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(first), torch.arange(300, dtype=torch.int16).to(torch.uint8))
    second = again.storage(4000)  # another size: a new file, new (zero) pages
    assert again.created == 1 and (tmp_path / "staging-rank-3" / "1.bin").stat().st_size == 4000
    assert not torch.empty(0, dtype=torch.uint8).set_(second).any()
    assert again.storage(8) is None  # used up: the caller stages as torch does
    # a later state with fewer storages: the files it does not use are removed
    arena.open_arena(tmp_path, 3, {"a": torch.zeros(75, dtype=torch.int32)})
    assert sorted(p.name for p in (tmp_path / "staging-rank-3").iterdir()) == ["0.bin"]


def test_a_staged_copy_sent_to_dcp_s_checkpoint_process_stays_in_the_arena(tmp_path):
    """torchtitan's pinned saves hand the staged copy to DCP's checkpoint process through a torch.multiprocessing pipe:
    torch must pass the staging files' descriptors, not move the storages into fresh worker-owned shared memory."""
    import io
    from multiprocessing.reduction import ForkingPickler

    src = _trained(seed=1)
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tmp_path), rank=0)
    staged = stager.stage(restore_tier.materialise(src[2]))
    before = {k: v.data_ptr() for k, v in staged.items() if isinstance(v, torch.Tensor)}
    ForkingPickler(io.BytesIO()).dump(staged)
    assert {k: v.data_ptr() for k, v in staged.items() if isinstance(v, torch.Tensor)} == before
    assert all(_inside(v, stager.arena) for v in staged.values() if isinstance(v, torch.Tensor))


def _resident_kib(folder) -> int:
    """KiB of this process's mappings of files under ``folder`` that are in its page tables (``Rss`` in smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            inside = len(head) >= 6 and head[5].startswith(str(folder))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.parametrize("write", ["map", "pwrite"])
def test_the_stager_stages_into_the_arena_and_reuses_its_storages(tmp_path, monkeypatch, write):
    """Both ways of writing the arena give the same staged copy; ``pwrite`` never brings the files' pages into this
    process's page tables (so its death has none to tear down), ``map`` does."""
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(staging_write=write))
    monkeypatch.setattr(arena, "CHUNK", 4096)  # several chunks, and several writer threads, per storage
    src = _trained(seed=1)
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tmp_path), rank=0)
    state = restore_tier.materialise(src[2])
    staged = stager.stage(state)
    a = stager.arena
    assert a.mode == write
    mapped_kib = _resident_kib(tmp_path)
    assert (mapped_kib == 0) == (write == "pwrite"), mapped_kib
    assert a is not None and a.count == len(list((tmp_path / "staging-rank-0").iterdir())) > 0
    tensors: list[torch.Tensor] = []
    restore_tier._skeleton(staged, tensors)
    assert tensors and all(_inside(t, a) for t in tensors)
    assert all(torch.equal(staged[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))

    with torch.no_grad():
        for p in src[0].parameters():
            p.add_(1)
    used = a.next
    if write == "pwrite":
        mapped_kib = _resident_kib(tmp_path)  # reading the staged copy above brought pages in; none more below
    again = stager.stage(restore_tier.materialise(src[2]))
    assert a.next == used  # the second stage allocates nothing: the cached arena storages are overwritten
    if write == "pwrite":
        assert _resident_kib(tmp_path) == mapped_kib
    assert torch.equal(again["0.weight"], src[0][0].weight) and again["0.weight"].data_ptr() == staged["0.weight"].data_ptr()
    stager.close()


@pytest.mark.parametrize(("write", "read"), [("map", "map"), ("map", "pread"), ("pwrite", "pread")])
def test_a_tier_from_the_arena_loads_the_same_state_as_a_dcp_load(tmp_path, monkeypatch, write, read):
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(restore_tier_read=read, staging_write=write))

    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", tmp_path / "ckpt"
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tier), rank=0)
    staged = stager.stage(restore_tier.materialise(src[2]))
    dcp.save(staged, checkpoint_id=str(ckpt / "step-8"))
    writer = restore_tier.BackgroundWriter()
    writer.start(staged, str(tier), arena=stager.arena, step=8, rank=0, world_size=1, checkpoint_folder=str(ckpt))
    writer.wait()
    meta = json.loads((tier / "rank-0.json").read_text())
    assert meta["arena"] == "staging-rank-0" and not (tier / "rank-0.bin").exists()  # no copy was written
    assert {e["file"].split("/")[0] for e in meta["layout"] if e["nbytes"]} == {"staging-rank-0"}
    assert restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=str(ckpt))

    _loads_match_dcp(src, tier, ckpt / "step-8")

    # a staged tensor outside the arena (not contiguous, or staged elsewhere): the tier is copied as before
    assert restore_tier.save_from_arena({"x": torch.ones(4, 4).t()}, tier, stager.arena, step=9, rank=0,
                                        world_size=1, checkpoint_folder=str(ckpt)) is None
    assert restore_tier.usable(tier, step=8, rank=0, world_size=1, checkpoint_folder=str(ckpt))


class Probe:
    """A value in the state dict whose staging (a deep copy) records whether the tier's JSON exists then."""

    seen: list[bool] = []
    meta = None

    def __deepcopy__(self, memo):
        Probe.seen.append(Probe.meta.exists())
        return Probe()


def test_the_tier_json_is_gone_while_a_stage_is_in_flight(tmp_path):
    src = _trained(seed=1)
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tier), rank=0)
    Probe.seen, Probe.meta = [], tier / "rank-0.json"
    for step in (4, 8):
        staged = stager.stage({**restore_tier.materialise(src[2]), "probe": Probe()})
        assert restore_tier.save_from_arena(staged, tier, stager.arena, step=step, rank=0, world_size=1,
                                            checkpoint_folder=ckpt)
        assert restore_tier.usable(tier, step=step, rank=0, world_size=1, checkpoint_folder=ckpt)
    assert Probe.seen == [False, False]  # the second stage ran after the step-4 tier was complete: JSON removed first


CHILD_STAGES = """
import os, sys, torch
from torch.distributed.checkpoint.staging import StagingOptions
from kubetitan_trainer.recovery import restore_tier
from kubetitan_trainer.recovery.staging import ReusableStager
state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.arange(7, dtype=torch.bfloat16),
         "extra": {"step": 11, "m": [torch.full((3,), 2.5)]}}
stager = ReusableStager(StagingOptions(False, True, False, False), arena_folder=sys.argv[1], rank=0)
staged = stager.stage(state)
assert restore_tier.save_from_arena(staged, sys.argv[1], stager.arena, step=11, rank=0, world_size=1,
                                    checkpoint_folder="ck")
print("staged", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_killed_worker_leaves_the_arena_and_a_new_process_loads_the_tier_from_it(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD_STAGES, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": CHILD_PATH})
    assert child.stdout.readline().strip() == "staged"
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL

    assert restore_tier.usable(tmp_path, step=11, rank=0, world_size=1, checkpoint_folder="ck")
    fresh = {"w": torch.zeros(64, 64), "b": torch.zeros(7, dtype=torch.bfloat16),
             "extra": {"step": 0, "m": [torch.zeros(3)]}}
    assert restore_tier.load(fresh, tmp_path, rank=0) == 4096 * 4 + 7 * 2 + 3 * 4
    assert torch.equal(fresh["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64))
    assert torch.equal(fresh["b"], torch.arange(7, dtype=torch.bfloat16))
    assert fresh["extra"]["step"] == 11 and torch.equal(fresh["extra"]["m"][0], torch.full((3,), 2.5))
    # the next generation's stager finds the arena with the right size: its pages are reused, not re-created
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tmp_path), rank=0)
    stager.stage(fresh)
    assert stager.arena.reused == 3 and stager.arena.created == 0
    assert not restore_tier.usable(tmp_path, step=11, rank=0, world_size=1, checkpoint_folder="ck")  # being overwritten


def test_without_room_or_a_tier_folder_staging_is_torch_s(tmp_path, monkeypatch, caplog):
    src = _trained(seed=1)
    plain = ReusableStager(CPU_STAGING)  # no tier folder (static launcher): no arena, nothing written
    staged = plain.stage(restore_tier.materialise(src[2]))
    assert plain.arena is None and staged["0.weight"].is_shared() and not list(tmp_path.iterdir())

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(arena.shutil, "disk_usage", lambda p: Usage(10, 10, 0))
    tier, ckpt = tmp_path / "tier", str(tmp_path / "ckpt")
    stager = ReusableStager(CPU_STAGING, arena_folder=str(tier), rank=0)
    staged = stager.stage(restore_tier.materialise(src[2]))
    assert stager.arena is None and "Staging arena not used" in caplog.text and "/dev/shm" in caplog.text
    assert staged["0.weight"].is_shared() and not (tier / "staging-rank-0").exists()
    monkeypatch.undo()
    writer = restore_tier.BackgroundWriter()  # no arena: the tier is the copy, as before
    writer.start(staged, str(tier), arena=stager.arena, step=8, rank=0, world_size=1, checkpoint_folder=ckpt)
    writer.wait()
    assert (tier / "rank-0.bin").exists() and "arena" not in json.loads((tier / "rank-0.json").read_text())


def test_pinned_style_async_saves_through_dcp_s_checkpoint_process_keep_the_staged_copy_in_the_arena(tmp_path):
    """Two ``dcp.async_save``s as torchtitan's async_with_pinned_mem makes them (the checkpoint *process*, the stager
    staging in the background): both checkpoints hold their values, and the staged copy stayed in the arena files
    (the process got their descriptors), so the tier from the arena holds the last save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import torch.distributed as dist

    tier = tmp_path / "tier"
    stager = ReusableStager(StagingOptions(False, True, True, False), arena_folder=str(tier), rank=0)
    w = torch.zeros(1000)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the checkpoint process joins it
    try:
        for step in (1, 2):
            w.fill_(step)
            res = dcp.async_save({"w": w, "train_state": {"step": step}}, checkpoint_id=tmp_path / f"step-{step}",
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
            staged = stager.last_staged.result()
            res.upload_completion.result()
            assert restore_tier.save_from_arena(staged, tier, stager.arena, step=step, rank=0, world_size=1,
                                                checkpoint_folder="ck") == 4000
    finally:  # end this test's checkpoint process (torch keeps one per process, for the process's lifetime)
        from torch.distributed.checkpoint import _async_process_executor as executor

        if executor._CHECKPOINT_PROCESS is not None:
            executor._CHECKPOINT_PROCESS.__del__()
            executor._CHECKPOINT_PROCESS = None
        dist.destroy_process_group()
    for step in (1, 2):
        got = {"w": torch.empty(1000), "train_state": {"step": 0}}
        dcp.load(got, checkpoint_id=tmp_path / f"step-{step}")
        assert got["train_state"]["step"] == step and bool((got["w"] == step).all())
    got = {"w": torch.empty(1000), "train_state": {"step": 0}}
    restore_tier.load(got, tier, rank=0)
    assert got["train_state"]["step"] == 2 and bool((got["w"] == 2).all()) and stager.arena.next == 1
    stager.close()


def test_the_arena_writes_as_the_runtime_table_says() -> None:
    assert (arena.write_mode(), arena.write_threads()) == ("pwrite", arena.WRITE_THREADS)  # the defaults
    assert (arena.write_mode(KubetitanRuntime(staging_write="map")),
            arena.write_threads(KubetitanRuntime(staging_write_threads=3))) == ("map", 3)


def test_a_failed_write_returns_only_after_every_write_of_the_storage_ended(tmp_path, monkeypatch):
    """One chunk's pwrite fails (a full /dev/shm) while the others are still queued: the error comes back only once
    they have all ended, so none writes through the closed descriptor into a file opened afterwards."""
    import threading
    import time

    monkeypatch.setattr(arena, "CHUNK", 4096)
    a = arena.Arena(tmp_path / "staging-rank-0", 1, mode="pwrite", threads=2)
    a.folder.mkdir()
    dst = a.storage(4 * 4096)
    real, started = arena._pwrite_all, threading.Event()

    def flaky(fd, data, off):
        if off == 0:
            assert started.wait(10)  # a later chunk is in flight when this one fails
            raise OSError(28, "No space left on device")
        started.set()
        time.sleep(0.3)
        return real(fd, data, off)

    monkeypatch.setattr(arena, "_pwrite_all", flaky)
    with pytest.raises(OSError, match="No space left"):
        a.write(dst, torch.full((4 * 4096,), 7, dtype=torch.uint8).untyped_storage())
    victim = tmp_path / "unrelated.txt"
    fd = os.open(victim, os.O_RDWR | os.O_CREAT)  # may get the staging file's old descriptor number
    try:
        os.write(fd, b"important")
        a.close()  # every queued write has ended by now
        assert os.fstat(fd).st_size == 9 and victim.read_bytes() == b"important"
    finally:
        os.close(fd)


def test_a_replaced_staging_file_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "CURRENT", KubetitanRuntime(staging_write="pwrite"))
    a = arena.open_arena(tmp_path, 0, {"x": torch.zeros(64)})
    dst = a.storage(256)
    (a.folder / "0.bin").unlink()
    (a.folder / "0.bin").write_bytes(b"\0" * 256)  # another file at the path: DCP reads the old one through dst
    with pytest.raises(OSError, match="was replaced"):
        a.write(dst, torch.ones(64).untyped_storage())
    a.close()
