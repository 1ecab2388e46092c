"""A node-local restore tier: the last saved training state in memory files that outlive the worker processes.

An in-place restart (``--max-restarts``) keeps the pod, so its ``/dev/shm`` (an emptyDir of medium Memory) and
everything in it survive the workers. At each checkpoint save (not the last step's), every rank writes
its local share of the very state that DCP saved (model, optimizer, LR schedulers, data loader, train state)
into ``<tier>/rank-<r>.bin`` (raw tensor bytes, copied straight from the device into a memory-mapped file)
and ``rank-<r>.json`` (step, world size, checkpoint folder, tensor layout, the pickled non-tensor values),
the JSON last: a tier without its JSON is incomplete and never used.

The synchronous path writes the tier **before** DCP's save of the same step (a copy into memory: ~0.03 s for the
CPU debug model against ~0.3 s for DCP), so a failure that cuts the DCP save off still finds the step in every
rank's tier. At the next load, every rank checks its tier: usable when every rank's holds **the same step, newer
than the newest complete DCP checkpoint** (:func:`agreed_newer_step`: the save that was cut off, so the restart
loses no step instead of an interval), or **exactly the step torchtitan is about to load** (the newest complete
DCP checkpoint, :func:`kubetitan_trainer.trainer.resolve_load_step`), for the same checkpoint folder, rank and
world size, with tensors of the shapes and dtypes that rank's state has now. A re-created gang (new pods, an
empty tier) loads the newest complete DCP checkpoint as before. The ranks agree with one all-reduce (MIN): all load from the tier, or all load through DCP (DCP's
load is collective, so a mix would hang). Loading mirrors ``dcp.load``: the state dicts of the ``Stateful``
objects are filled in place, then each one's ``load_state_dict`` runs. A stale or missing tier is ignored
(DCP then), and a tier that fails while loading is deleted before the error ends the worker.

With pinned async saves and the staging arena (:mod:`kubetitan_trainer.recovery.arena`), DCP's staged copy already lies in
files of this folder that outlive the worker (``staging-rank-<r>/<k>.bin``): the tier is then only ``rank-<r>.json``,
whose layout entries name those files (``"file"``, ``"offset"``; :func:`save_from_arena`), and the stager removes the JSON
before each stage writes the arena, so a stage cut off midway leaves no usable, torn tier.

A load reads the files with ``os.preadv`` on several threads (:func:`read_mode`, :func:`load_threads`), so no page
of the tier is mapped into the worker, and copies the optimizer's part in the background while the first step
runs (:func:`defer_keys`); each is a ``[kubetitan.runtime]`` setting (``spec.runtime``) with the other way as its
alternative.

The tier costs one device-to-host copy of the state per save (training waits for it) and host memory equal
to the state (the pod's ``/dev/shm`` size limit must hold it; when the folder lacks the space the tier is
skipped with a warning and an older one deleted). The launcher turns it on for in-place restarts
(``KUBETITAN_RESTORE_TIER``) and removes the folder when it exits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import mmap
import os
import pickle
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import atomic, compat, knobs, runtime, storage

ENV_RESTORE_TIER = "KUBETITAN_RESTORE_TIER"
"""Folder of the restore tier (set by the launcher; unset or empty: off)."""

DEFAULT_LOAD_THREADS = 4
"""``map`` mode: loader threads when torch's CPU copies run on one thread each (``OMP_NUM_THREADS=1``, which
torchrun sets when a node runs several workers). With more intra-op threads one loader thread is fastest there: on
the H200 machine (16 of them), 40 GiB through one thread's pinned bounce buffers ran at 47.7 GB/s, through 4
threads at 29.7 and through 8 at 27.7 (bench/teardown_probe.py, docs/reliability.md)."""
PREAD_THREADS = (2, 16)
"""``pread`` mode: the node's CPUs shared among its workers (``LOCAL_WORLD_SIZE``), within these bounds. Each
thread's ``preadv`` is the kernel's copy from the page cache: on the H100 machine 40 GiB read in 8.2-8.9 s on 1
thread, 2.5-2.7 s on 4, 1.7 s on 8 and 1.47 s on 16 (the same probe)."""

READ_MODES = ("pread", "map")
"""How a load reads the tier's files (``[kubetitan.runtime] restore_tier_read``): ``pread`` (default: ``os.preadv``
straight into the loader threads' pinned buffers: no mapping, so no page fault and no page table to tear down; the
kernel's copy runs on the loader's threads, :func:`load_threads`) or ``map`` (a read-only mapping, copied through
pinned buffers). On an H100 with the 3B state (docs/reliability.md) ``pread`` on 16 threads with the optimizer
deferred loaded in 0.9-1.1 s, against 2.9-4.5 s mapped."""

ALIGN = 64
MARGIN = 1.05

log = logging.getLogger("kubetitan.restore_tier")


class _Ref:
    """A tensor's place in the pickled skeleton of a state dict."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_Ref, (self.index,))


class TierMismatch(Exception):
    """The tier does not fit the state being loaded (structure, shape or dtype)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return compat.local_tensor(t)  # a DTensor's shard on this rank


def _is_stateful(v: Any) -> bool:
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(v, dict)


def materialise(states: dict[str, Any]) -> dict[str, Any]:
    """``dcp``'s view of ``states``: each Stateful's ``state_dict()``, other values as they are."""
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in states.items()}


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(_local(obj))
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_skeleton(v, tensors) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


class _Mover:
    """Copies device tensors into the memory-mapped tier through two pinned bounce buffers (pageable copies run at
    a fraction of the link's speed); CPU tensors are copied directly. (Loads: :class:`_ParallelLoad`.)"""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.pinned: list[torch.Tensor] = []
        self.slot = 0

    def _buffers(self) -> bool:
        if not self.pinned:
            try:
                self.pinned = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            except RuntimeError:
                return False
        return True

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``src``: a flat uint8 view of a tensor; ``dst``: its bytes in the tier."""
        if not src.is_cuda or not self._buffers():
            dst.copy_(src)
            return
        for off in range(0, src.numel(), self.CHUNK):
            n = min(self.CHUNK, src.numel() - off)
            buf = self.pinned[self.slot]
            self.slot ^= 1
            buf[:n].copy_(src[off:off + n], non_blocking=True)
            torch.cuda.current_stream().synchronize()
            dst[off:off + n].copy_(buf[:n])


class FileSpan:
    """Bytes ``[offset, offset + nbytes)`` of an open file, read with ``os.preadv`` (the ``pread`` mode): sliced
    and counted as the flat uint8 views of a mapping are, so :func:`chunks` cuts both the same way."""

    __slots__ = ("fd", "offset", "nbytes")

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        self.fd, self.offset, self.nbytes = fd, offset, nbytes

    def numel(self) -> int:
        return self.nbytes

    def __getitem__(self, part: slice) -> FileSpan:
        start, stop, _ = part.indices(self.nbytes)
        return FileSpan(self.fd, self.offset + start, max(0, stop - start))

    def read_into(self, dst: torch.Tensor) -> None:
        """Fill the first ``nbytes`` of ``dst`` (a contiguous uint8 CPU tensor, pinned or not) from the file."""
        view = memoryview(dst.detach().numpy()).cast("B")
        got = 0
        while got < self.nbytes:
            n = os.preadv(self.fd, [view[got:self.nbytes]], self.offset + got)
            if n <= 0:
                raise TierMismatch(f"the tier's file ended {self.nbytes - got} bytes short of its layout")
            got += n


def _fill(buf: torch.Tensor, src: torch.Tensor | FileSpan) -> None:
    """``buf[:n] = src`` for a mapping's bytes or a file span."""
    if isinstance(src, FileSpan):
        src.read_into(buf)
    else:
        buf[:src.numel()].copy_(src)


def _whole(src: torch.Tensor | FileSpan) -> torch.Tensor:
    if not isinstance(src, FileSpan):
        return src
    out = torch.empty(src.nbytes, dtype=torch.uint8)
    src.read_into(out)
    return out


class _ParallelLoad:
    """Copies the tier's bytes into the state's tensors on several threads (the load at memory speed).

    A load through one thread and one pair of pinned bounce buffers runs at the speed of one ``memcpy`` from the
    mapping (~9-13 GB/s on the H200 machine), far below the host-to-device link. Here each thread owns two bounce
    buffers (pinned for CUDA targets) and, for CUDA targets, its own stream: its ``memcpy`` of one chunk into a
    buffer overlaps the device copy of the previous chunk from the other, and torch's CPU ``copy_`` releases the
    GIL, so the threads' copies run in parallel. Every chunk of every tensor goes to exactly one thread
    (:func:`chunks`). Tensors that are not contiguous are copied whole on the calling thread, and so are CPU
    tensors (read straight into them in the ``pread`` mode).

    In the ``pread`` mode (:class:`FileSpan` sources) a thread fills its buffer with ``os.preadv`` instead of a copy
    from a mapping: the kernel's copy from the page cache runs on that thread (the GIL released), so the threads'
    reads run in parallel and no page of the tier is ever mapped into the worker."""

    CHUNK = 64 << 20
    BOUNCE_BUDGET = 256 << 20
    """Pinned bounce memory of all threads together (two buffers a thread). A fresh worker pins it before its
    first copy, and pinning from scratch cost ~0.75 s a GiB on the H200 machine (40 GiB in 30 s): 16
    threads of 2 x 64 MiB would pin 2 GiB. Whether that is why the 16-thread ``pread`` load ran slower in a
    training run (2.6-3.4 s) than in the probe (1.47 s) is not measured (docs/reliability.md)."""

    def __init__(self, threads: int, chunk: int | None = None, bounce_cpu: bool = False) -> None:
        self.threads, self.bounce_cpu = max(1, threads), bounce_cpu
        self.chunk = chunk if chunk is not None else chunk_for(self.threads, self.CHUNK, self.BOUNCE_BUDGET)

    def run(self, pairs: list[tuple[torch.Tensor | FileSpan, torch.Tensor]]) -> None:
        """``pairs``: (the tier's bytes of a tensor as a flat uint8 view or a :class:`FileSpan`, the tensor to fill
        in place)."""
        flat = []
        for src, local in pairs:
            if local.is_contiguous() and (local.is_cuda or self.bounce_cpu):
                flat.append((src, local.view(-1).view(torch.uint8)))
            elif local.is_contiguous() and isinstance(src, FileSpan):
                src.read_into(local.view(-1).view(torch.uint8))  # a CPU tensor: read straight into it
            else:
                local.copy_(_whole(src).view(local.dtype).view(local.shape))
        work = chunks([(s, d) for s, d in flat], self.chunk)
        if not work:
            return
        n = min(self.threads, len(work))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._part, args=(work[k::n], errors), name=f"kubetitan-tier-load-{k}")
                   for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _part(self, work: list[tuple[Any, torch.Tensor]], errors: list[BaseException]) -> None:
        try:
            cuda = work[0][1].is_cuda
            size = max(s.numel() for s, _d in work)
            bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            if not cuda:
                for i, (s, d) in enumerate(work):
                    b = bufs[i & 1][:s.numel()]
                    _fill(b, s)
                    d.copy_(b)
                return
            device = work[0][1].device
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the targets' allocation and fill come first
            done = [torch.cuda.Event(), torch.cuda.Event()]  # recorded again for each chunk: no event a chunk
            with torch.cuda.stream(stream):
                for i, (s, d) in enumerate(work):
                    b = i & 1
                    if i >= 2:
                        done[b].synchronize()  # that buffer's last device copy has finished
                    _fill(bufs[b], s)
                    d.copy_(bufs[b][:s.numel()], non_blocking=True)
                    done[b].record(stream)
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread by run()
            errors.append(e)


def chunk_for(threads: int, largest: int, budget: int, smallest: int = 4 << 20) -> int:
    """The bounce chunk for ``threads`` loader threads: ``largest`` while two a thread fit ``budget``, else the
    largest power of two that fits (torch's pinned allocator rounds every buffer up to one), at least
    ``smallest``."""
    share = max(1, budget // (2 * max(1, threads)))
    return max(smallest, min(largest, 1 << (share.bit_length() - 1)))


def chunks(pairs: list[tuple[Any, torch.Tensor]], size: int) -> list[tuple[Any, torch.Tensor]]:
    """(source, target) flat uint8 pairs cut into aligned pieces of at most ``size`` bytes, in order."""
    out = []
    for src, dst in pairs:
        if src.numel() != dst.numel():
            raise TierMismatch(f"the tier has {src.numel()} bytes for a tensor of {dst.numel()} bytes")
        out += [(src[o:o + size], dst[o:o + size]) for o in range(0, dst.numel(), size)]
    return out


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: those it may run on (:func:`knobs.affinity_cpus`), at most its cgroup's CPU quota
    rounded up (a pod's CPU limit, cgroup v2 ``cpu.max``: ``<quota> <period>``; none readable: no cap)."""
    n = knobs.affinity_cpus()
    with contextlib.suppress(OSError, ValueError):
        quota, period = cgroup.read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    return n


def default_load_threads(intra_op_threads: int | None = None, *, mode: str = "pread", cpus: int | None = None,
                         local_workers: int | None = None, env: dict | None = None) -> int:
    """``pread``: the pod's CPUs (:func:`usable_cpus`) over its workers (``LOCAL_WORLD_SIZE`` of ``env``, else of the
    process), within :data:`PREAD_THREADS`. ``map``: one loader thread when torch's copies are parallel already,
    else :data:`DEFAULT_LOAD_THREADS`."""
    if mode == "pread":
        cpus = usable_cpus() if cpus is None else cpus
        if local_workers is None:
            local_workers = knobs.whole_number("LOCAL_WORLD_SIZE", 1, "counting one worker on this node", log, env)
        low, high = PREAD_THREADS
        return max(low, min(high, cpus // max(1, local_workers)))
    n = torch.get_num_threads() if intra_op_threads is None else intra_op_threads
    return 1 if n > 1 else DEFAULT_LOAD_THREADS


def load_threads(env: dict | None = None, intra_op_threads: int | None = None, mode: str | None = None,
                 s: KubetitanRuntime | None = None) -> int:
    """How many threads load the tier (``restore_tier_load_threads`` of ``s``, this process's settings by default;
    0: :func:`default_load_threads` for ``mode``, the read mode by default)."""
    s = runtime.settings() if s is None else s
    mode = read_mode(s) if mode is None else mode
    return s.restore_tier_load_threads or default_load_threads(intra_op_threads, mode=mode, env=env)


def read_mode(s: KubetitanRuntime | None = None) -> str:
    """How loads read the tier (``restore_tier_read`` of ``s``, this process's settings by default; :data:`READ_MODES`)."""
    return (runtime.settings() if s is None else s).restore_tier_read


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _paths(folder: str | Path, rank: int) -> tuple[Path, Path]:
    folder = Path(folder)
    return folder / f"rank-{rank}.bin", folder / f"rank-{rank}.json"


def discard(folder: str | Path, rank: int) -> None:
    for p in _paths(folder, rank)[::-1]:  # the JSON first: what is left is incomplete, never used
        p.unlink(missing_ok=True)


def invalidate(folder: str | Path, rank: int) -> None:
    """Remove this rank's tier JSON only (its bytes are about to be overwritten: a tier without its JSON is never
    used). The staging arena calls it before each stage writes into the file the tier points into."""
    _paths(folder, rank)[1].unlink(missing_ok=True)


def _arena_of(folder: str | Path, meta: dict) -> Path | None:
    """The staging arena folder the tier's layout points into (kubetitan_trainer.recovery.arena), or None (``rank-<r>.bin``)."""
    name = meta.get("arena")
    return Path(folder) / name if isinstance(name, str) and name and "/" not in name else None


def _present(folder: str | Path, rank: int, meta: dict) -> bool:
    where = _arena_of(folder, meta)
    return where.is_dir() if where is not None else _paths(folder, rank)[0].is_file()


def _write_meta(meta: Path, **fields: Any) -> None:
    atomic.write_json(meta, fields, fsync=False)  # in the tier's memory-backed folder


def save_from_arena(staged: dict[str, Any], folder: str | Path, arena: Any, *, step: int, rank: int,
                    world_size: int, checkpoint_folder: str) -> int | None:
    """Make the staged copy in ``arena`` (kubetitan_trainer.recovery.arena) this rank's tier for ``step``: only the JSON is
    written, each layout entry naming its staging file and offset. None when a staged tensor with bytes is not a
    contiguous run of one staging file (then the caller copies, :func:`save`); else the bytes the tier holds.

    The stager removed the JSON before it staged (:func:`invalidate`), so the tier is complete from the moment the
    JSON appears; ``rank-<r>.bin`` of an earlier copied tier is deleted (its memory is the state's size)."""
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(materialise(staged), tensors)
    layout, total = [], 0
    for t in tensors:
        n = _nbytes(t)
        place = arena.place(t) if n else ("", 0)
        if place is None:
            return None
        layout.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "file": place[0],
                       "offset": place[1], "nbytes": n})
        total += n
    binf, meta = _paths(folder, rank)
    binf.unlink(missing_ok=True)
    _write_meta(meta, step=step, rank=rank, world_size=world_size, arena=arena.folder.name,
                checkpoint_folder=storage.folder_key(checkpoint_folder), layout=layout,
                skeleton=pickle.dumps(skeleton).hex())
    return total


def save(states: dict[str, Any], folder: str | Path, *, step: int, rank: int, world_size: int,
         checkpoint_folder: str) -> int:
    """Write this rank's share of ``states`` for ``step``; the bytes written (0 when the folder lacks room)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(materialise(states), tensors)
    layout, offset = [], 0
    for t in tensors:
        n = _nbytes(t)
        layout.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset, "nbytes": n})
        offset += -(-n // ALIGN) * ALIGN
    binf, meta = _paths(folder, rank)
    meta.unlink(missing_ok=True)  # the old step is stale from now on
    # The old file is overwritten in place: its pages exist already (a first write into fresh tmpfs pages is
    # several times slower than a copy), and its bytes count as free.
    old = binf.stat().st_size if binf.exists() else 0
    free = shutil.disk_usage(folder).free + old
    if free < offset * MARGIN:
        discard(folder, rank)
        log.warning("Restore tier skipped at step %d: %s has %.1f GiB free, the state needs %.1f GiB (raise the "
                    "pod's /dev/shm size to use it)", step, folder, free / 2**30, offset * MARGIN / 2**30)
        return 0
    with open(binf, "r+b" if old else "w+b") as f:
        f.truncate(max(offset, 1))
        with mmap.mmap(f.fileno(), max(offset, 1)) as mm:
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            mover = _Mover()
            for t, entry in zip(tensors, layout):
                if entry["nbytes"]:
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    mover.to_host(src, buf[entry["offset"]:entry["offset"] + entry["nbytes"]])
            del buf
    _write_meta(meta, step=step, rank=rank, world_size=world_size, checkpoint_folder=storage.folder_key(checkpoint_folder),
                layout=layout, skeleton=pickle.dumps(skeleton).hex())
    return offset


def usable(folder: str | Path, *, step: int, rank: int, world_size: int, checkpoint_folder: str) -> bool:
    """Does this rank's tier hold ``step`` of this run (same checkpoint folder, rank and world size)?"""
    if not folder:
        return False
    meta = _paths(folder, rank)[1]
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return (m.get("step") == step and m.get("rank") == rank and m.get("world_size") == world_size
            and m.get("checkpoint_folder") == storage.folder_key(checkpoint_folder) and _present(folder, rank, m))


def tier_step(folder: str | Path, *, rank: int, world_size: int, checkpoint_folder: str) -> int:
    """The step this rank's tier holds for this run (same checkpoint folder, rank and world size); -1 for none."""
    if not folder:
        return -1
    meta = _paths(folder, rank)[1]
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return -1
    ok = (m.get("rank") == rank and m.get("world_size") == world_size and isinstance(m.get("step"), int)
          and m.get("checkpoint_folder") == storage.folder_key(checkpoint_folder) and _present(folder, rank, m))
    return m["step"] if ok else -1


def agreed_newer_step(local_step: int, newest_complete: int, min_max) -> int:
    """The step every rank's tier holds when it is newer than the newest complete DCP checkpoint, else -1.

    A save that a failure cut off leaves DCP's ``step-N`` without its ``.metadata`` (never loaded), but the tier,
    written *before* DCP's save and in a fraction of its time, already holds step N on every rank that got that
    far. ``min_max(step) -> (min, max)`` over every rank (one collective); only the same step everywhere counts."""
    lo, hi = min_max(local_step)
    return lo if lo == hi and lo > newest_complete else -1


def _fill_plan(target: Any, skel: Any, layout: list[dict], path: str, plan: list) -> Any:
    """Check ``skel`` against ``target``; collect (target tensor, layout entry) copies; the non-tensor values."""
    if isinstance(skel, _Ref):
        if not isinstance(target, torch.Tensor):
            raise TierMismatch(f"{path}: the tier has a tensor, the state has {type(target).__name__}")
        local, entry = _local(target), layout[skel.index]
        if list(local.shape) != entry["shape"] or str(local.dtype).removeprefix("torch.") != entry["dtype"]:
            raise TierMismatch(f"{path}: tier {entry['dtype']}{entry['shape']}, state "
                               f"{str(local.dtype).removeprefix('torch.')}{list(local.shape)}")
        plan.append((local, entry, path.split(".", 2)[1] if path.count(".") else ""))  # + the state's top key
        return target
    if isinstance(skel, dict):
        if not isinstance(target, dict) or set(target) != set(skel):
            raise TierMismatch(f"{path}: keys differ")
        return {k: _fill_plan(target[k], skel[k], layout, f"{path}.{k}", plan) for k in skel}
    if isinstance(skel, (list, tuple)):
        if not isinstance(target, (list, tuple)) or len(target) != len(skel):
            raise TierMismatch(f"{path}: lengths differ")
        out = [_fill_plan(t, s, layout, f"{path}[{i}]", plan) for i, (t, s) in enumerate(zip(target, skel))]
        return out if isinstance(skel, list) else tuple(out)
    if isinstance(target, torch.Tensor):
        raise TierMismatch(f"{path}: the state has a tensor, the tier has {type(skel).__name__}")
    return skel


class Prepared:
    """A checked tier load: :meth:`apply` copies it into the state (see :func:`prepare`)."""

    def __init__(self, states: dict[str, Any], binf: Path, filled: dict[str, Any], plan: list,
                 threads: int | None = None, mode: str | None = None) -> None:
        self.states, self.binf, self.filled, self.plan = states, binf, filled, plan
        self.mode = read_mode() if mode is None else mode
        self.threads = load_threads(mode=self.mode) if threads is None else threads

    def file_of(self, entry: dict) -> Path:
        """The file an entry's bytes are in: its staging file (a tier from the arena), else ``rank-<r>.bin``."""
        return self.binf.parent / entry["file"] if entry.get("file") else self.binf

    def _copy(self, entries: list[tuple[torch.Tensor, dict]], threads: int | None = None,
              bounce_budget: int | None = None) -> None:
        """Copy these (tensor, layout entry) pairs from the tier's files into the tensors (on ``threads`` loader
        threads; None: :attr:`threads`; ``bounce_budget``: the threads' pinned bounce bytes together, None:
        :attr:`_ParallelLoad.BOUNCE_BUDGET`)."""
        with contextlib.ExitStack() as stack:
            bufs: dict[Path, Any] = {}
            pairs = []
            for local, e in entries:
                if not e["nbytes"]:
                    continue
                file = self.file_of(e)
                if file not in bufs:
                    f = stack.enter_context(open(file, "rb"))
                    if self.mode == "pread":
                        bufs[file] = FileSpan(f.fileno(), 0, os.fstat(f.fileno()).st_size)
                    else:
                        mm = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                        with warnings.catch_warnings():  # a read-only mapping: only read from here
                            warnings.simplefilter("ignore", UserWarning)
                            bufs[file] = torch.frombuffer(mm, dtype=torch.uint8)
                pairs.append((bufs[file][e["offset"]:e["offset"] + e["nbytes"]], local))
            with torch.no_grad():
                n = self.threads if threads is None else threads
                chunk = None if bounce_budget is None else \
                    chunk_for(n, _ParallelLoad.CHUNK, bounce_budget)
                _ParallelLoad(n, chunk).run(pairs)
            del bufs, pairs  # before the mappings close

    def apply(self, defer: tuple[str, ...] = ()) -> int:
        """Copy the tier into the state in place, then each Stateful's ``load_state_dict``; the bytes read.

        ``defer``: top-level keys of the state (``"optimizer"``) whose tensors of :data:`DEFER_MIN_BYTES` or more
        are copied in a background thread after the ``load_state_dict`` calls (:attr:`pending`; wait on it before
        anything reads them: the optimizer's step). Only when the object still holds the very tensors that were
        filled after its ``load_state_dict`` (torch's optimizers keep the tensors they are given): otherwise they
        are copied first and ``load_state_dict`` runs again, as without ``defer``."""
        now, later = [], []
        for local, e, key in self.plan:
            (later if key in defer and e["nbytes"] >= DEFER_MIN_BYTES else now).append((local, e))
        self._copy(now)
        for k, v in self.states.items():
            if _is_stateful(v):
                v.load_state_dict(self.filled[k])
            else:
                self.states[k] = self.filled[k]
        total = sum(e["nbytes"] for _local, e, _k in self.plan)
        if not later:
            return total
        keys = [k for k in defer if k in self.states]
        if _held({k: self.states[k] for k in keys}) >= {_local(t).data_ptr() for t, _e in later}:
            self.pending = Pending(functools.partial(self._copy, threads=defer_threads(),
                                                     bounce_budget=DEFER_BOUNCE_BUDGET), later,
                                   sum(e["nbytes"] for _t, e in later), switch_interval=defer_switch_interval())
            return total
        log.info("Restore tier: %s does not keep the tensors it was loaded from; loading it whole first", keys)
        self._copy(later)
        for k in keys:
            self.states[k].load_state_dict(self.filled[k])
        return total

    pending: Pending | None = None
    """The deferred copies of the last :meth:`apply` (None: nothing deferred)."""


DEFER_MIN_BYTES = 1 << 20
"""Smaller tensors of a deferred part are copied at once (an optimizer's step counters may be copied by its
``load_state_dict``; its moments are not)."""

DEFERRED = ("optimizer",)
"""With ``defer_optimizer_load`` (the default): the trainer loads the optimizer's moments from the tier in the background, while the first step's
forward and backward run, and waits for them before the optimizer's step; off: at once. On an
H100 with the 3B state it took kill -> first step end from p50 9.2 s to 6.5-6.7 s together with the ``pread`` load
and the arena's ``pwrite`` (the copy's own times: :data:`DEFAULT_DEFER_THREADS`)."""


DEFAULT_DEFER_THREADS = 4
"""The deferred copy runs while the training thread compiles its first step, and every chunk a loader thread copies
takes the GIL a few times between its system calls, so the two slow each other down. On an H100 with the 3B state
(docs/reliability.md): on 16 threads the optimizer's 26.9 GiB came in 1.9-2.3 s and the warm
compile took 3.4-3.9 s (2.0-2.2 s with no copy running); on 4 threads the compile took 2.2-2.8 s and the copy 4.0-5.4
s, the step waiting 0.8-1.6 s for it. Kill -> first step end was the same (p50 6.7 s on 16 threads, 6.5 s on 4 in
bench/device/recovery_deferred_copy.sh); 4 uses a quarter of the threads, which counts on a node of 8 workers."""


DEFER_BOUNCE_BUDGET = 512 << 20
"""Pinned bounce memory of the deferred copy's threads together: 64 MiB chunks on the default 4 threads, where the
immediate part's :data:`_ParallelLoad.BOUNCE_BUDGET` gives them 32 MiB. While the first step compiles, a copy
thread gets the GIL back after each chunk's system calls only when the compiling thread lets it go (at the latest
after Python's switch interval), so the copy moves about one chunk per switch: ~150-180 chunks a second at the
default 5 ms on the CPU probe (``bench/gil_convoy_probe.py``, bench/results/recovery/gil_convoy_cpu.txt), and
6-7 GB/s for 32 MiB chunks on an H100 (bench/device/recovery_deferred_copy.sh). Twice the chunk is twice the bytes a switch, for the same
number of switches taken from the compile; the 256 MiB more that are pinned cost ~0.2 s in the background. On an
H100 (bench/device/recovery_defer_chunks_and_aot.sh) the first step waited 0.28-0.72 s for the copy, against
0.76-1.60 s with 32 MiB chunks."""


def defer_threads(s: KubetitanRuntime | None = None) -> int:
    """How many threads copy a load's deferred part (``defer_threads`` of ``s``, this process's settings by
    default; :data:`DEFAULT_DEFER_THREADS` is the default)."""
    return (runtime.settings() if s is None else s).defer_threads


def defer_switch_interval(s: KubetitanRuntime | None = None) -> float | None:
    """Seconds for ``sys.setswitchinterval`` during the deferred copy (``defer_switch_interval_ms`` of ``s``); None:
    Python's own.

    The copy's threads take the GIL a few times a chunk, between their system calls, while the training thread
    compiles its first step; a waiting thread gets the GIL only when the holder releases it or the interval runs out,
    so each of those takes up to the interval (the "convoy effect"). A shorter interval shortens every such wait, for
    a few more switches of the training thread. Opt-in, not yet measured on a GPU."""
    ms = (runtime.settings() if s is None else s).defer_switch_interval_ms
    return ms / 1000 if ms else None


def defer_keys(s: KubetitanRuntime | None = None) -> tuple[str, ...]:
    """The state keys a tier load defers (:data:`DEFERRED` with ``defer_optimizer_load`` of ``s``, else none)."""
    return DEFERRED if (runtime.settings() if s is None else s).defer_optimizer_load else ()


def _held(states: dict[str, Any]) -> set[int]:
    """The data pointers of every tensor ``states`` hold now: an optimizer's (or a container of optimizers') from
    its ``state`` directly, anything else from its state dict, read again."""
    tensors: list[torch.Tensor] = []
    for v in states.values():
        optimizers = [v] if isinstance(v, torch.optim.Optimizer) and not hasattr(v, "optimizers") else \
            list(getattr(v, "optimizers", None) or [])
        if optimizers and all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            for o in optimizers:
                _skeleton(list(o.state.values()), tensors)
        else:
            _skeleton(materialise({"x": v}), tensors)
    return {_local(t).data_ptr() for t in tensors}


class Pending:
    """Deferred tier copies running in a background thread; :meth:`wait` ends them and raises their error."""

    def __init__(self, copy: Any, entries: list, nbytes: int, switch_interval: float | None = None) -> None:
        """``switch_interval``: seconds for ``sys.setswitchinterval`` while the copy runs (None: Python's own, 5 ms),
        put back when it ends (:func:`defer_switch_interval`)."""
        import time as _time

        self.nbytes, self.seconds = nbytes, None
        self._errors: list[BaseException] = []
        before = sys.getswitchinterval()
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)

        def run() -> None:
            begin = _time.perf_counter()
            try:
                copy(entries)
            except BaseException as e:  # noqa: BLE001 - raised by wait() on the training thread
                self._errors.append(e)
            finally:
                if switch_interval is not None and sys.getswitchinterval() == switch_interval:
                    sys.setswitchinterval(before)  # unless someone else changed it meanwhile
            self.seconds = _time.perf_counter() - begin

        self._thread: threading.Thread | None = threading.Thread(target=run, name="kubetitan-tier-deferred",
                                                                  daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._errors:
            raise self._errors[0]

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()


def prepare(states: dict[str, Any], folder: str | Path, *, rank: int) -> Prepared:
    """Check this rank's tier against ``states`` (structure, shapes, dtypes) without copying anything.

    Raises TierMismatch when it does not fit, OSError/ValueError when it cannot be read."""
    binf, meta = _paths(folder, rank)
    m = json.loads(meta.read_text())
    skeleton = pickle.loads(bytes.fromhex(m["skeleton"]))
    plan: list = []
    filled = _fill_plan(materialise(states), skeleton, m["layout"], "state", plan)
    prepared = Prepared(states, binf, filled, plan)
    ends: dict[Path, int] = {}
    for e in m["layout"]:
        if e["nbytes"]:
            f = prepared.file_of(e)
            ends[f] = max(ends.get(f, 0), e["offset"] + e["nbytes"])
    for f, end in ends.items():
        if f.stat().st_size < end:
            raise TierMismatch(f"{f} is shorter than its layout")
    return prepared


def load(states: dict[str, Any], folder: str | Path, *, rank: int) -> int:
    """Load this rank's tier into ``states`` in place (as ``dcp.load`` does); the bytes read."""
    return prepare(states, folder, rank=rank).apply()


class BackgroundWriter:
    """Writes the tier from DCP's pinned staged copy in a thread, so that training does not wait for it.

    ``start`` takes what the stager returned (a Future of the staged copy, or the copy); ``wait`` blocks until
    the write has ended (the stager calls it before it reuses its buffers for the next save)."""

    def __init__(self) -> None:
        self._thread = None

    def start(self, staged: Any, folder: str, arena: Any = None, **kw) -> None:
        """``arena``: the staging arena the copy is in (kubetitan_trainer.recovery.arena): the tier is then only its JSON
        (:func:`save_from_arena`), unless a staged tensor lies outside it (then the copy, as without one)."""
        import threading
        import time as _time

        self.wait()

        def run() -> None:
            begin = _time.perf_counter()
            try:
                sd = staged.result() if hasattr(staged, "result") else staged
                n = save_from_arena(sd, folder, arena, **kw) if arena is not None else None
                if n is None:
                    if arena is not None and getattr(arena, "mode", "map") == "pwrite":
                        log.warning("Restore tier: a staged tensor lies outside the staging arena, so the tier is "
                                    "copied through this worker's mappings of the arena (its pages are then in "
                                    "the worker's page tables, and its death takes longer to tear down)")
                    n = save(sd, folder, **kw)
            except Exception as e:  # noqa: BLE001 - the tier is an optimisation; DCP stays the source
                discard(folder, kw.get("rank", 0))
                log.warning("Restore tier not written at step %s: %s", kw.get("step"), e)
                return
            if n:
                log.info("Restore tier: step %s, %.2f GiB in %.2f s in the background (%s)", kw.get("step"),
                            n / 2**30, _time.perf_counter() - begin, folder)

        self._thread = threading.Thread(target=run, name="kubetitan-restore-tier", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
