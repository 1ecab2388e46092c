"""A staging arena: DCP's staged copy of the training state in files of the restore tier's folder (issue 29).

torch 2.11's ``StateDictStager`` stages every tensor into its own fresh shared-memory storage and, with CUDA,
``cudaHostRegister``s each one. Those pages belong to the worker: when it dies the kernel frees them all before
its parent sees it dead (6.4 s on the H200 for the 3B model's ~40 GiB, against 0.4 s for a worker that never
saved), and the next generation allocates and pins them again at its first save (a 13-28 s stall).

Here the staged copy lives in ``<tier>/staging-rank-<r>/``, in the pod's ``/dev/shm`` that the launcher owns and
that outlives the workers: one file per staged storage (``<k>.bin``, the k-th storage the stager stages), each
mapped ``MAP_SHARED`` as a torch shared-memory storage that keeps its file descriptor (:meth:`Arena.storage`).
One file per storage, not one file with a bump allocator: torchtitan's pinned async saves hand the staged copy to
DCP's checkpoint *process* through a ``torch.multiprocessing`` pipe, and torch passes a storage's file descriptor
only when the storage is such a mapping of its own file; any other storage (a view at an offset of one big mapping
included) is first copied into fresh worker-owned shared memory and moved there, leaving the arena behind
(tests/trainer/test_arena.py pickles a staged copy as that pipe does and checks it stays put).

A worker's death unmaps the files but frees none of their pages, and the next generation's stager, staging the
same state in the same order, finds every file with the right size and its pages already there (a file of another
size is re-created). With CUDA each file is registered with ``cudaHostRegister`` as torch registers its own
storages. Because the staged copy is in files that outlive the worker, the restore tier points into them
(:func:`kubetitan_trainer.restore_tier.save_from_arena` writes only the tier's JSON).

Without a tier folder, when the folder lacks room for the state, or when torch shares tensors by file name rather
than file descriptor, there is no arena (:func:`open_arena` warns and returns None) and staging is torch's.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from kubetitan_trainer import compat

MARGIN = 1.02
"""The folder must have this much more free space than the arena needs (tmpfs metadata, the tier's JSON)."""

log = logging.getLogger("kubetitan.arena")


def path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"staging-rank-{rank}"


def _storages(state: Any) -> dict[tuple[str, int], int]:
    """(device, data pointer) -> bytes of every distinct storage of ``state``'s tensors (a DTensor's local shard)."""
    seen: dict[tuple[str, int], int] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            s = compat.local_tensor(obj).untyped_storage()
            key = (str(s.device), s.data_ptr())
            seen[key] = max(seen.get(key, 0), s.nbytes())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            walk(obj.state_dict())

    walk(state)
    return seen


def staged_bytes(state: Any) -> int:
    """The bytes the stager copies for ``state``: every distinct storage once."""
    return sum(_storages(state).values())


class Arena:
    """This rank's staging files; :meth:`storage` hands out the next one (the stager caches its storages across
    stages, so a stager asks once per storage; one it does not get is staged the way torch does)."""

    def __init__(self, folder: Path, count: int, pin: bool = False, pin_min_bytes: int = 5) -> None:
        self.folder, self.count, self.pin, self.pin_min_bytes = folder, count, pin, pin_min_bytes
        self.next = 0
        self.reused = self.created = 0
        """Files found with the right size (pages already there) / created or re-sized, so far."""
        self.names: dict[int, tuple[str, int]] = {}
        """A staged storage's data pointer -> (its file, relative to the tier folder; its bytes)."""
        self.registered: list[int] = []

    def storage(self, nbytes: int) -> torch.UntypedStorage | None:
        """The next staging file as a storage of ``nbytes`` (its old pages when it has that size), or None when the
        arena is used up or ``nbytes`` is 0 (the caller stages as torch does)."""
        if self.next >= self.count or nbytes <= 0:
            return None
        name = f"{self.next}.bin"
        self.next += 1
        file = self.folder / name
        old = file.stat().st_size if file.exists() else -1
        if old != nbytes:
            file.unlink(missing_ok=True)  # another size: new pages (a shrunk file would keep a stale tail)
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if old != nbytes:
                os.ftruncate(fd, nbytes)
            s = compat.shared_storage_from_fd(fd, nbytes)
        finally:
            os.close(fd)  # the storage keeps its own duplicate
        self.reused += old == nbytes
        self.created += old != nbytes
        self.names[s.data_ptr()] = (f"{self.folder.name}/{name}", nbytes)
        if self.pin and nbytes >= self.pin_min_bytes:
            self._register(s.data_ptr(), nbytes)
        return s

    def _register(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) == 0:
            self.registered.append(ptr)
        else:
            warnings.warn(f"cudaHostRegister of a staging file in {self.folder} failed ({err}): that staged copy "
                          "is pageable (a slower device-to-host copy)", stacklevel=3)

    def place(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(file relative to the tier folder, byte offset in it) of ``t``'s bytes; None when ``t`` is not a
        contiguous run of one staging file."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        named = self.names.get(t.untyped_storage().data_ptr())
        if named is None:
            return None
        off = t.storage_offset() * t.element_size()
        return (named[0], off) if off + t.numel() * t.element_size() <= named[1] else None

    def close(self) -> None:
        """End the CUDA registrations; the files stay (the restore tier may point into them)."""
        for ptr in self.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.registered = []


def open_arena(folder: str | Path, rank: int, state: Any, pin: bool = False, pin_min_bytes: int = 5) -> Arena | None:
    """This rank's arena in ``folder``, sized for ``state`` (the state dict about to be staged); None (with a
    warning) when the folder lacks room or torch shares tensors by file name."""
    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        log.warning("Staging arena not used: torch shares tensors by %r, the arena's files need 'file_descriptor'",
                    torch.multiprocessing.get_sharing_strategy())
        return None
    sizes = _storages(state)
    need = sum(sizes.values())
    where = path(folder, rank)
    where.mkdir(parents=True, exist_ok=True)
    files = sorted(where.glob("*.bin"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    for stale in files[len(sizes):]:  # a state with fewer storages than the last generation's
        stale.unlink(missing_ok=True)
    have = sum(p.stat().st_size for p in files[:len(sizes)])
    free = shutil.disk_usage(where).free + have
    if free < need * MARGIN:
        shutil.rmtree(where, ignore_errors=True)
        log.warning("Staging arena not used: %s has %.1f GiB free, the staged state needs %.1f GiB; staging in "
                    "worker memory (a worker that had saved takes longer to be seen dead). Raise the pod's /dev/shm "
                    "size to use it.", folder, free / 2**30, need * MARGIN / 2**30)
        return None
    return Arena(where, len(sizes), pin=pin and torch.cuda.is_available(), pin_min_bytes=pin_min_bytes)
