"""A staging arena: DCP's staged copy of the training state in files of the restore tier's folder.

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
(:func:`kubetitan_trainer.recovery.restore_tier.save_from_arena` writes only the tier's JSON).

Without a tier folder, when the folder lacks room for the state, or when torch shares tensors by file name rather
than file descriptor, there is no arena (:func:`open_arena` warns and returns None) and staging is torch's.

**Writes** (``[kubetitan.runtime] staging_write``, :func:`write_mode`). ``pwrite`` (the default): the worker never touches
the mapping; each storage goes through a few small pinned bounce buffers and ``os.pwrite`` into the file on
:data:`WRITE_THREADS` threads (:meth:`Arena.write`), so the worker's page tables never hold the arena and its
death has only its GPU memory and small buffers to free. ``map``: the stager copies each tensor into the file's
mapping, registered with CUDA (device-to-host DMA straight into it); a worker that did so has every page of the
~40 GiB mapped and registered, and its death must unmap and unregister them all before it is seen dead. On an H100
with the 3B state (docs/reliability.md) a killed worker was seen dead 0.25-0.36 s after the kill
with ``pwrite`` and 1.89-2.02 s with ``map``, at the same training throughput. The file's pages are the same
either way (DCP's checkpoint process maps and reads them as before); the tier's default ``pread`` load
(``restore_tier_read``) does not map them into the next worker either.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import compat, runtime

MARGIN = 1.02
"""The folder must have this much more free space than the arena needs (tmpfs metadata, the tier's JSON)."""

WRITE_MODES = ("pwrite", "map")
"""How the stager writes the arena (``[kubetitan.runtime] staging_write``): ``pwrite`` (default) or ``map`` (see the
module's docstring)."""
WRITE_THREADS = 8
"""Threads that ``pwrite`` the arena in the ``pwrite`` mode (each with two bounce buffers of :data:`CHUNK`)."""
CHUNK = 16 << 20

log = logging.getLogger("kubetitan.arena")


def write_mode(s: KubetitanRuntime | None = None) -> str:
    """``staging_write`` of ``s`` (this process's settings by default): :data:`WRITE_MODES`."""
    return (runtime.settings() if s is None else s).staging_write


def write_threads(s: KubetitanRuntime | None = None) -> int:
    """``staging_write_threads`` of ``s`` (this process's settings by default; :data:`WRITE_THREADS` is the default)."""
    return (runtime.settings() if s is None else s).staging_write_threads


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


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

    def __init__(self, folder: Path, count: int, pin: bool = False, pin_min_bytes: int = 5, mode: str = "pwrite",
                 threads: int = WRITE_THREADS) -> None:
        self.folder, self.count, self.pin, self.pin_min_bytes = folder, count, pin, pin_min_bytes
        self.mode, self.threads = mode, threads
        self._pool: Any = None
        self._bounce: Any = None  # a queue of pinned bounce buffers (the pwrite mode, CUDA sources)
        self._stream: Any = None  # their device-to-host copy stream
        self.next = 0
        self.reused = self.created = 0
        """Files found with the right size (pages already there) / created or re-sized, so far."""
        self.names: dict[int, tuple[str, int]] = {}
        """A staged storage's data pointer -> (its file, relative to the tier folder; its bytes)."""
        self.inodes: dict[int, int] = {}
        """A staged storage's data pointer -> its file's inode (:meth:`write` writes only into that file)."""
        self.storages: list[torch.UntypedStorage] = []
        """Every storage handed out, kept for the arena's life: a freed one's address, reused by another mapping,
        would otherwise still be found in :attr:`names`."""
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
        self.inodes[s.data_ptr()] = file.stat().st_ino
        self.storages.append(s)
        if self.pin and nbytes >= self.pin_min_bytes and self.mode == "map":
            self._register(s.data_ptr(), nbytes)
        return s

    def write(self, dst: torch.UntypedStorage, src: torch.UntypedStorage) -> None:
        """Copy ``src`` into the staging file behind ``dst`` (a storage :meth:`storage` gave) without touching
        ``dst``'s mapping: CPU sources straight from their memory, CUDA sources through pinned bounce buffers of
        :data:`CHUNK` bytes; ``os.pwrite`` on :attr:`threads` threads. Returns when every byte is in the file (or
        raises the first error once every write has ended)."""
        import concurrent.futures
        import queue

        name, nbytes = self.names[dst.data_ptr()]
        flat = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)
        if flat.numel() != nbytes:
            raise ValueError(f"{name}: a staging file of {nbytes} bytes for a storage of {flat.numel()} bytes")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="kubetitan-stage-write")
        fd = os.open(self.folder.parent / name, os.O_WRONLY)
        jobs: list = []
        try:
            if os.fstat(fd).st_ino != self.inodes[dst.data_ptr()]:
                raise OSError(f"{name} was replaced since it was mapped; not writing into another file")
            if not flat.is_cuda:
                view = memoryview(flat.numpy())
                jobs += [self._pool.submit(_pwrite_all, fd, view[o:o + CHUNK], o) for o in range(0, nbytes, CHUNK)]
                return
            if self._bounce is None:  # once per arena: the bounce buffers and the copy stream
                self._bounce = queue.Queue()
                for _ in range(2 * self.threads):
                    self._bounce.put(torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True))
                self._stream = torch.cuda.Stream(device=flat.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(flat.device))
            for o in range(0, nbytes, CHUNK):
                n = min(CHUNK, nbytes - o)
                buf = self._bounce.get()  # free again once its write ended (below)
                try:
                    with torch.cuda.stream(stream):
                        buf[:n].copy_(flat[o:o + n], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(stream)
                except BaseException:
                    self._bounce.put(buf)
                    raise

                def put(buf=buf, n=n, o=o, done=done) -> None:
                    try:
                        done.synchronize()
                        _pwrite_all(fd, memoryview(buf[:n].numpy()), o)
                    finally:
                        self._bounce.put(buf)

                jobs.append(self._pool.submit(put))
        finally:
            concurrent.futures.wait(jobs)  # no write may outlive the descriptor
            os.close(fd)
            for j in jobs:
                j.result()  # the first error, once all have ended

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
        """End the CUDA registrations and the writer threads; the files stay (the restore tier may point into
        them)."""
        for ptr in self.registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.registered = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._bounce = self._stream = None


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
    mode = write_mode()
    return Arena(where, len(sizes), pin=pin and torch.cuda.is_available(), pin_min_bytes=pin_min_bytes, mode=mode,
                 threads=write_threads())
