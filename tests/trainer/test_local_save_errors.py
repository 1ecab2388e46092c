"""A checkpoint save to a local folder or a mounted volume whose write fails (ENOSPC injected into DCP's file
streams): the save fails, ``storage.SaveBudget`` counts it like any failed save, and the previous checkpoint stays the
newest complete one (what a resume loads). Cheap: tiny tensors, no process.

DCP's filesystem writer drops a write error raised on one of its extra writer threads (reproduced below: the save
returns and writes ``.metadata`` over short files); a local save has none of them, because torchtitan passes no writer
and DCP builds one with a single thread (``compat.LOCAL_WRITER_THREADS``, with its canaries in test_compat)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, filesystem
from torch.distributed.checkpoint._storage_utils import _storage_setup

from kubetitan_trainer import compat, storage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "torch.distributed is ... uninitialized"


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((32, 32), float(i)) for i in range(4)}


def _no_space(monkeypatch, on_thread, wait_for_other: bool = False) -> threading.Event:
    """Every ``.distcp`` stream opened on a thread ``on_thread`` accepts 10 bytes, then fails with ENOSPC.
    ``wait_for_other``: the calling thread's streams wait until another thread has opened one (the returned Event), so
    that with several writer threads at least one file is written off the calling thread."""
    create_stream = filesystem.FileSystem.create_stream
    other_opened = threading.Event()

    def failing(self, path, mode):
        @contextlib.contextmanager
        def stream():
            main = threading.current_thread() is threading.main_thread()
            if not main:
                other_opened.set()
            elif wait_for_other:
                assert other_opened.wait(timeout=60), "no extra writer thread opened a file"
            with create_stream(self, path, mode) as s:
                if mode == "wb" and str(path).endswith(".distcp") and on_thread(main):
                    s.write(b"x" * 10)
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                yield s
        return stream()

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", failing)
    return other_opened


def test_a_local_save_whose_write_fails_is_a_counted_failed_save_and_the_previous_step_stays(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoint"
    store = storage.LocalStore(str(folder))
    budget = storage.SaveBudget(3, store.root, interval=2)
    assert budget.attempt(lambda: dcp.save(_state(), checkpoint_id=store.step_id(2)), 2)  # as torchtitan saves
    budget.written(2, background=False)
    _no_space(monkeypatch, on_thread=lambda main: True)
    assert not budget.attempt(lambda: dcp.save(_state(), checkpoint_id=store.step_id(4)), 4)
    assert (budget.in_a_row, budget.failed_steps, budget.last_error_class) == (1, [4], "ENOSPC")
    assert budget.last_error.startswith("OSError: [Errno 28] No space left on device")
    assert not os.path.exists(os.path.join(store.step_id(4), ".metadata"))
    assert store.newest_complete_step() == 2
    back = {k: torch.zeros(32, 32) for k in _state()}
    dcp.load(back, checkpoint_id=store.step_id(2))
    assert all(torch.equal(back[k], v) for k, v in _state().items())


def test_dcp_gives_a_local_save_a_writer_of_one_thread(tmp_path):
    writer = _storage_setup(None, str(tmp_path / "step-2"))
    assert isinstance(writer, FileSystemWriter) and writer.thread_count == compat.LOCAL_WRITER_THREADS == 1


def test_extra_writer_threads_lose_a_failed_write(tmp_path, monkeypatch):
    """The defect one writer thread avoids, reproduced: with 3 threads and ENOSPC on the two extra ones only, torch's
    save returns and writes .metadata over 10-byte files, so the step looks complete. If this fails, torch raises the
    extra threads' errors itself: LOCAL_WRITER_THREADS may then grow."""
    other_opened = _no_space(monkeypatch, on_thread=lambda main: not main, wait_for_other=True)
    dropped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: dropped.append(args.exc_value))  # what torch leaves
    path = str(tmp_path / "step-2")
    dcp.save(_state(), storage_writer=FileSystemWriter(path, thread_count=3))  # returns: the save "succeeded"
    assert other_opened.is_set() and dropped and all(isinstance(e, OSError) for e in dropped)
    assert os.path.exists(os.path.join(path, ".metadata"))
    assert min(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp")) == 10
    assert storage.LocalStore(str(tmp_path)).newest_complete_step() == 2
