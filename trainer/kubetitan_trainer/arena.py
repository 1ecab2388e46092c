"""A staging arena: DCP's staged copy of the training state in a file of the restore tier's folder (issue 29).

torch 2.11's ``StateDictStager`` stages every tensor into its own fresh shared-memory storage and, with CUDA,
``cudaHostRegister``s each one. Those pages belong to the worker: when it dies the kernel frees them all before
its parent sees it dead (6.4 s on the H200 for the 3B model's ~40 GiB, against 0.4 s for a worker that never
saved), and the next generation allocates and pins them again at its first save (a 13-28 s stall).

Here the staged copy lives in ``<tier>/staging-rank-<r>.bin``, a file of the pod's ``/dev/shm`` that the launcher
owns and that outlives the workers: the file is mapped ``MAP_SHARED``, a bump allocator hands out
``UntypedStorage`` views of it (:meth:`Arena.storage`), and with CUDA the whole mapping is registered once. A
worker's death unmaps the file but frees none of its pages, and the next generation finds the file with the right
size and its pages already there. Because the staged copy is in a file that outlives the worker, the restore tier
is that file (:func:`kubetitan_trainer.restore_tier.save_from_arena` writes only the tier's JSON).

Without a tier folder, or when the folder lacks room for the state, there is no arena (:func:`open_arena` warns
and returns None) and staging is torch's.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from kubetitan_trainer import compat

ALIGN = 4096
"""Every staged storage starts at a multiple of this offset (a page: any dtype's alignment holds)."""
MARGIN = 1.02
"""The folder must have this much more free space than the arena (tmpfs metadata, other files of the tier)."""

log = logging.getLogger("kubetitan.arena")


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"staging-rank-{rank}.bin"


def staged_bytes(state: Any) -> int:
    """The arena size ``state`` needs: the aligned bytes of every distinct storage of its tensors (a DTensor's
    local shard), as the stager copies each storage once."""
    seen: dict[tuple[str, int], int] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            s = compat.local_tensor(obj).untyped_storage()
            seen[(str(s.device), s.data_ptr())] = max(seen.get((str(s.device), s.data_ptr()), 0), s.nbytes())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            walk(obj.state_dict())

    walk(state)
    return sum(aligned(max(n, 1)) for n in seen.values())


class Arena:
    """A mapped staging file and a bump allocator over it (the stager keeps its storages across stages, so the
    allocator only grows; a storage that does not fit is staged the way torch does)."""

    def __init__(self, file: Path, nbytes: int, reused: bool) -> None:
        self.file, self.nbytes, self.reused = file, nbytes, reused
        with open(file, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
        self.base = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.top = 0
        self.registered = False

    @property
    def data_ptr(self) -> int:
        return self.base.data_ptr()

    def register_with_cuda(self) -> bool:
        """One ``cudaHostRegister`` of the whole mapping (instead of one per staged storage); False if refused."""
        if self.registered or not torch.cuda.is_available():
            return self.registered
        err = torch.cuda.cudart().cudaHostRegister(self.data_ptr, self.nbytes, 0)
        self.registered = int(err) == 0
        if not self.registered:
            warnings.warn(f"cudaHostRegister of the staging arena {self.file} failed ({err}): staged copies are "
                          "pageable (slower device-to-host copies)", stacklevel=2)
        return self.registered

    def storage(self, nbytes: int) -> torch.UntypedStorage | None:
        """A fresh view of ``nbytes`` of the arena, or None when it is full (the caller stages elsewhere)."""
        if self.top + nbytes > self.nbytes:
            return None
        if not nbytes:
            return torch.UntypedStorage(0)
        view = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=self.top)
        self.top += aligned(nbytes)
        return view.untyped_storage()  # starts at the offset; keeps the mapping alive as long as it lives

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes start in the arena file; None when they are not in it or ``t`` is not contiguous."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        off = t.untyped_storage().data_ptr() - self.data_ptr + t.storage_offset() * t.element_size()
        if t.numel() == 0:
            return 0 if 0 <= off <= self.nbytes else None
        return off if 0 <= off and off + t.numel() * t.element_size() <= self.nbytes else None

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.data_ptr)
            self.registered = False
        del self.base
        try:
            self._mm.close()
        except BufferError:  # staged storages still point into it: the mapping ends with them
            pass


def open_arena(folder: str | Path, rank: int, nbytes: int) -> Arena | None:
    """This rank's arena of ``nbytes`` in ``folder``: the existing file when it has that size (its pages are
    there already), else a new one; None (with a warning) when the folder lacks room."""
    file = path(folder, rank)
    nbytes = max(aligned(nbytes), ALIGN)
    old = file.stat().st_size if file.exists() else 0
    if old == nbytes:
        return Arena(file, nbytes, reused=True)
    Path(folder).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free + old
    if free < nbytes * MARGIN:
        file.unlink(missing_ok=True)
        log.warning("Staging arena not used: %s has %.1f GiB free, the staged state needs %.1f GiB; staging in "
                    "worker memory (a worker that had saved takes longer to be seen dead). Raise the pod's /dev/shm "
                    "size to use it.", folder, free / 2**30, nbytes * MARGIN / 2**30)
        return None
    file.unlink(missing_ok=True)  # a file of another size: its pages go, new ones are allocated once here
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return Arena(file, nbytes, reused=False)
