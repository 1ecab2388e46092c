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

The tier costs one device-to-host copy of the state per save (training waits for it) and host memory equal
to the state (the pod's ``/dev/shm`` size limit must hold it; when the folder lacks the space the tier is
skipped with a warning and an older one deleted). The launcher turns it on for in-place restarts
(``KUBETITAN_RESTORE_TIER``) and removes the folder when it exits.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from kubetitan_trainer import compat, storage

ENV_RESTORE_TIER = "KUBETITAN_RESTORE_TIER"
"""Folder of the restore tier (set by the launcher; unset or empty: off)."""

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
    """Copies between the memory-mapped tier and device tensors through two pinned bounce buffers (pageable
    copies run at a fraction of the link's speed); CPU tensors are copied directly."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.pinned: list[torch.Tensor] = []
        self.events: list = []
        self.slot = 0

    def _buffers(self) -> bool:
        if not self.pinned:
            try:
                self.pinned = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                self.events = [None, None]
            except RuntimeError:
                return False
        return True

    def _next(self) -> tuple[torch.Tensor, int]:
        i = self.slot
        self.slot ^= 1
        if self.events[i] is not None:
            self.events[i].synchronize()  # that buffer's last copy has finished
        return self.pinned[i], i

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``src``: a flat uint8 view of a tensor; ``dst``: its bytes in the tier."""
        if not src.is_cuda or not self._buffers():
            dst.copy_(src)
            return
        for off in range(0, src.numel(), self.CHUNK):
            n = min(self.CHUNK, src.numel() - off)
            buf, i = self._next()
            buf[:n].copy_(src[off:off + n], non_blocking=True)
            torch.cuda.current_stream().synchronize()
            dst[off:off + n].copy_(buf[:n])

    def to_device(self, src: torch.Tensor, local: torch.Tensor) -> None:
        """``src``: the tier's bytes of ``local`` (filled in place)."""
        if not local.is_cuda or not local.is_contiguous() or not self._buffers():
            local.copy_(src.view(local.dtype).view(local.shape))
            return
        dst = local.view(-1).view(torch.uint8)
        for off in range(0, dst.numel(), self.CHUNK):
            n = min(self.CHUNK, dst.numel() - off)
            buf, i = self._next()
            buf[:n].copy_(src[off:off + n])
            dst[off:off + n].copy_(buf[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[i] = ev

    def sync(self) -> None:
        if self.pinned and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _paths(folder: str | Path, rank: int) -> tuple[Path, Path]:
    folder = Path(folder)
    return folder / f"rank-{rank}.bin", folder / f"rank-{rank}.json"


def discard(folder: str | Path, rank: int) -> None:
    for p in _paths(folder, rank)[::-1]:  # the JSON first: what is left is incomplete, never used
        p.unlink(missing_ok=True)


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
    tmp = meta.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"step": step, "rank": rank, "world_size": world_size,
                               "checkpoint_folder": storage.folder_key(checkpoint_folder), "layout": layout,
                               "skeleton": pickle.dumps(skeleton).hex()}))
    os.replace(tmp, meta)
    return offset


def usable(folder: str | Path, *, step: int, rank: int, world_size: int, checkpoint_folder: str) -> bool:
    """Does this rank's tier hold ``step`` of this run (same checkpoint folder, rank and world size)?"""
    if not folder:
        return False
    binf, meta = _paths(folder, rank)
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return (m.get("step") == step and m.get("rank") == rank and m.get("world_size") == world_size
            and m.get("checkpoint_folder") == storage.folder_key(checkpoint_folder) and binf.is_file())


def tier_step(folder: str | Path, *, rank: int, world_size: int, checkpoint_folder: str) -> int:
    """The step this rank's tier holds for this run (same checkpoint folder, rank and world size); -1 for none."""
    if not folder:
        return -1
    binf, meta = _paths(folder, rank)
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return -1
    ok = (m.get("rank") == rank and m.get("world_size") == world_size and isinstance(m.get("step"), int)
          and m.get("checkpoint_folder") == storage.folder_key(checkpoint_folder) and binf.is_file())
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
        plan.append((local, entry))
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

    def __init__(self, states: dict[str, Any], binf: Path, filled: dict[str, Any], plan: list) -> None:
        self.states, self.binf, self.filled, self.plan = states, binf, filled, plan

    def apply(self) -> int:
        """Copy the tier into the state in place, then each Stateful's ``load_state_dict``; the bytes read."""
        total = 0
        with open(self.binf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            with warnings.catch_warnings():  # a read-only mapping: only read from here
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.frombuffer(mm, dtype=torch.uint8)
            mover = _Mover()
            with torch.no_grad():
                for local, entry in self.plan:
                    if entry["nbytes"]:
                        mover.to_device(buf[entry["offset"]:entry["offset"] + entry["nbytes"]], local)
                        total += entry["nbytes"]
            mover.sync()
            del buf
        for k, v in self.states.items():
            if _is_stateful(v):
                v.load_state_dict(self.filled[k])
            else:
                self.states[k] = self.filled[k]
        return total


def prepare(states: dict[str, Any], folder: str | Path, *, rank: int) -> Prepared:
    """Check this rank's tier against ``states`` (structure, shapes, dtypes) without copying anything.

    Raises TierMismatch when it does not fit, OSError/ValueError when it cannot be read."""
    binf, meta = _paths(folder, rank)
    m = json.loads(meta.read_text())
    skeleton = pickle.loads(bytes.fromhex(m["skeleton"]))
    plan: list = []
    filled = _fill_plan(materialise(states), skeleton, m["layout"], "state", plan)
    if binf.stat().st_size < max([e["offset"] + e["nbytes"] for e in m["layout"]], default=0):
        raise TierMismatch(f"{binf} is shorter than its layout")
    return Prepared(states, binf, filled, plan)


def load(states: dict[str, Any], folder: str | Path, *, rank: int) -> int:
    """Load this rank's tier into ``states`` in place (as ``dcp.load`` does); the bytes read."""
    return prepare(states, folder, rank=rank).apply()


class BackgroundWriter:
    """Writes the tier from DCP's pinned staged copy in a thread, so that training does not wait for it.

    ``start`` takes what the stager returned (a Future of the staged copy, or the copy); ``wait`` blocks until
    the write has ended (the stager calls it before it reuses its buffers for the next save)."""

    def __init__(self) -> None:
        self._thread = None

    def start(self, staged: Any, folder: str, **kw) -> None:
        import threading
        import time as _time

        self.wait()

        def run() -> None:
            begin = _time.perf_counter()
            try:
                sd = staged.result() if hasattr(staged, "result") else staged
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
