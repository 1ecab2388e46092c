"""The restore tier's parallel load (issue 29, item 2): every byte of every tensor lands once, on any number of
threads and any chunk size; the thread count's knob and its default. The CUDA path (pinned buffers, a stream per thread) runs the
same chunk plan; its speed is measured on the H200 (bench/teardown_probe.py, docs/reliability.md)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer.recovery import restore_tier


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(37, generator=g), torch.randn(3, 5, generator=g).to(torch.bfloat16),
            torch.randint(0, 1 << 40, (11,), generator=g), torch.zeros(0), torch.randn(64, 3, generator=g)]


def _as_bytes(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().reshape(-1).view(torch.uint8).clone() for t in ts]


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
def test_chunks_cover_every_byte_once_in_order(size: int) -> None:
    src = _as_bytes(_tensors())
    dst = [torch.empty_like(s) for s in src]
    got = restore_tier.chunks(list(zip(src, dst)), size)
    assert all(0 < s.numel() <= size and s.numel() == d.numel() for s, d in got)
    for s, d in got:
        d.copy_(s)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert sum(s.numel() for s, _d in got) == sum(s.numel() for s in src)


def test_chunks_refuse_a_size_mismatch() -> None:
    with pytest.raises(restore_tier.TierMismatch, match="8 bytes for a tensor of 4 bytes"):
        restore_tier.chunks([(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))], 4)


@pytest.mark.parametrize(("threads", "chunk"), [(1, 1 << 20), (3, 7), (8, 64)])
def test_parallel_load_fills_every_tensor_exactly(threads: int, chunk: int) -> None:
    want = _tensors()
    targets = [torch.full_like(t, 0) for t in want]
    strided = torch.zeros(5, 3).t()  # not contiguous: copied whole on the calling thread
    pairs = [(b, t) for b, t in zip(_as_bytes(want), targets)]
    pairs.append((_as_bytes([torch.arange(15.0).reshape(3, 5)])[0], strided))
    restore_tier._ParallelLoad(threads, chunk, bounce_cpu=True).run(pairs)
    assert all(torch.equal(a, b) for a, b in zip(want, targets))
    assert torch.equal(strided, torch.arange(15.0).reshape(3, 5))


def test_a_failing_thread_fails_the_load(monkeypatch) -> None:
    """An error on a loading thread (here: its bounce buffers cannot be allocated) is raised by the load itself."""
    def no_memory(*a, **k):
        raise RuntimeError("CUDA error: out of memory (pinned)")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        restore_tier._ParallelLoad(2, 8, bounce_cpu=True).run([(torch.zeros(16, dtype=torch.uint8),
                                                               torch.ones(16, dtype=torch.uint8))])


@pytest.mark.parametrize(("threads", "intra_op", "want"), [(0, 1, 4), (0, 16, 1), (8, 16, 8), (1, 1, 1)])
def test_load_threads_when_mapped(threads, intra_op, want) -> None:
    """``map`` mode, 0 (automatic): one thread when torch's own copies are parallel (measured fastest on the H200),
    four when torchrun gave each worker one intra-op thread; a number in the runtime table wins."""
    s = KubetitanRuntime(restore_tier_read="map", restore_tier_load_threads=threads)
    assert restore_tier.load_threads(intra_op_threads=intra_op, s=s) == want


@pytest.mark.parametrize(("cpus", "workers", "want"), [(16, 1, 16), (64, 1, 16), (16, 8, 2), (192, 8, 16),
                                                        (96, 8, 12), (2, 1, 2), (1, 4, 2)])
def test_pread_threads_share_the_nodes_cpus_among_its_workers(cpus, workers, want) -> None:
    assert restore_tier.default_load_threads(mode="pread", cpus=cpus, local_workers=workers) == want


def test_pread_threads_read_local_world_size(monkeypatch) -> None:
    monkeypatch.setattr(restore_tier, "usable_cpus", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert restore_tier.load_threads() == 8  # the default mode is pread: 32 CPUs over 4 workers
    assert restore_tier.load_threads({"LOCAL_WORLD_SIZE": "2"}) == 16  # a given environment is read, not the process's
    assert restore_tier.load_threads(s=KubetitanRuntime(restore_tier_load_threads=3)) == 3


@pytest.mark.parametrize(("affinity", "cpu_max", "want"), [
    (16, "max 100000", 16), (64, "800000 100000", 8), (64, "150000 100000", 2), (4, "800000 100000", 4),
    (16, None, 16), (16, "garbage", 16), (16, "50000 100000", 1)])
def test_usable_cpus_is_the_affinity_within_the_cgroup_quota(tmp_path, monkeypatch, affinity, cpu_max, want) -> None:
    monkeypatch.setattr(restore_tier.os, "sched_getaffinity", lambda _pid: set(range(affinity)))
    f = tmp_path / "cpu.max"
    if cpu_max is not None:
        f.write_text(cpu_max + "\n")
    assert restore_tier.usable_cpus(f) == want


def test_usable_cpus_without_sched_getaffinity(tmp_path, monkeypatch) -> None:
    monkeypatch.delattr(restore_tier.os, "sched_getaffinity")
    monkeypatch.setattr(restore_tier.os, "cpu_count", lambda: 6)
    assert restore_tier.usable_cpus(tmp_path / "absent") == 6


def _file_of(ts: list[torch.Tensor], path) -> list[tuple[int, int]]:
    """The tensors' bytes one after another in ``path``; (offset, nbytes) of each."""
    spans, off = [], 0
    with open(path, "wb") as f:
        for b in _as_bytes(ts):
            f.write(b.numpy().tobytes())
            spans.append((off, b.numel()))
            off += b.numel()
    return spans


@pytest.mark.parametrize(("threads", "chunk", "bounce"), [(1, 1 << 20, True), (3, 7, True), (4, 64, False)])
def test_pread_load_fills_every_tensor_exactly_without_mapping_the_file(tmp_path, monkeypatch, threads, chunk,
                                                                       bounce) -> None:
    """The ``pread`` mode: file spans cut into chunks like a mapping's bytes, read by the loader threads into
    their buffers (or, for CPU tensors, straight into them); nothing maps the file."""
    import mmap

    want = _tensors() + [torch.arange(15.0).reshape(3, 5)]
    spans = _file_of(want, tmp_path / "tier.bin")
    targets = [torch.full_like(t, 0) for t in want[:-1]] + [torch.zeros(5, 3).t()]  # the last: not contiguous
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: pytest.fail("the pread mode mapped the file"))
    fd = os.open(tmp_path / "tier.bin", os.O_RDONLY)
    try:
        whole = restore_tier.FileSpan(fd, 0, os.fstat(fd).st_size)
        pairs = [(whole[o:o + n], t) for (o, n), t in zip(spans, targets)]
        restore_tier._ParallelLoad(threads, chunk, bounce_cpu=bounce).run(pairs)
    finally:
        os.close(fd)
    assert all(torch.equal(a, b) for a, b in zip(want, targets))


def test_a_short_file_fails_the_pread_load(tmp_path) -> None:
    (tmp_path / "tier.bin").write_bytes(b"\x01" * 10)
    fd = os.open(tmp_path / "tier.bin", os.O_RDONLY)
    try:
        with pytest.raises(restore_tier.TierMismatch, match="6 bytes short"):
            restore_tier._ParallelLoad(2, 8, bounce_cpu=True).run(
                [(restore_tier.FileSpan(fd, 0, 16), torch.zeros(16, dtype=torch.uint8))])
    finally:
        os.close(fd)


def test_read_mode_comes_from_the_runtime_table() -> None:
    assert restore_tier.read_mode() == "pread"  # the default
    assert restore_tier.read_mode(KubetitanRuntime(restore_tier_read="map")) == "map"


@pytest.mark.parametrize(("threads", "want_mib"), [(1, 64), (2, 64), (3, 32), (4, 32), (5, 16), (8, 16), (12, 8),
                                                   (16, 8), (64, 4)])
def test_the_bounce_chunk_keeps_the_pinned_memory_of_all_threads_within_the_budget(threads, want_mib) -> None:
    """One thread keeps the measured 64 MiB chunk; more threads share 256 MiB of pinned buffers (two each), so a
    fresh worker does not pin gigabytes before its first copy."""
    load = restore_tier._ParallelLoad(threads)
    assert load.chunk == want_mib << 20
    assert 2 * threads * load.chunk <= max(restore_tier._ParallelLoad.BOUNCE_BUDGET, 2 * threads * (4 << 20))
