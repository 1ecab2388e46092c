"""A worker killed while it writes its error file (the hang watchdog's SIGKILL racing a collective that failed when a
peer died) leaves the file empty: torch's ``ProcessContext.join`` then died in ``pickle.load`` with ``EOFError``
and took the launcher down, so the gang was recreated instead of restarting in place. With
``compat.tolerate_torn_error_files`` the agent sees a failed worker, killed by SIGKILL."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal

import pytest
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from kubetitan_trainer import compat


def _wait_for_kill(ready_fd: int) -> None:
    os.write(ready_fd, b"r")
    signal.pause()


@contextlib.contextmanager
def _killed_worker(tmp_path, torn: bytes):
    """One real elastic worker (fork) that the test kills after writing ``torn`` where its error file goes: the file
    as a kill in the middle of ``_wrap``'s ``pickle.dump`` leaves it."""
    ready_r, ready_w = os.pipe()
    pcontext = start_processes("torn", _wait_for_kill, {0: (ready_w,)}, {0: {}},
                               DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), start_method="fork")
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"r", "the worker died before it started"
    os.close(ready_r)
    pid = pcontext.pids()[0]
    with open(pcontext._pc.error_files[0], "wb") as fh:
        fh.write(torn)
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: join reaps it
    try:
        yield pcontext
    finally:
        pcontext.close()


TORN = pytest.mark.parametrize("torn", [b"", b"\x80\x04\x95"], ids=["empty", "cut-mid-pickle"])


@TORN
def test_without_the_shim_torchs_join_dies_on_the_torn_error_file(tmp_path, torn):
    with _killed_worker(tmp_path, torn) as pcontext:
        # If this stops raising, torch handles a torn error file itself: drop compat.tolerate_torn_error_files.
        with pytest.raises((EOFError, pickle.UnpicklingError)):
            pcontext.wait(0)


@TORN
def test_a_worker_killed_while_writing_its_error_file_is_a_failed_worker_killed_by_sigkill(tmp_path, torn):
    with _killed_worker(tmp_path, torn) as pcontext:
        compat.tolerate_torn_error_files(pcontext)
        compat.tolerate_torn_error_files(pcontext)  # installed once
        result = pcontext.wait(0)  # what the elastic agent's monitor calls
        assert result is not None and result.is_failed()
        assert result.failures[0].exitcode == -signal.SIGKILL


@TORN
def test_the_join_says_the_worker_died_by_its_signal_while_writing_its_error_file(tmp_path, torn):
    with _killed_worker(tmp_path, torn) as pcontext:
        compat.tolerate_torn_error_files(pcontext)
        with pytest.raises(ProcessExitedException, match="process 0 terminated with signal SIGKILL while writing its "
                                                         "error file") as raised:
            pcontext._pc.join(-1)
        assert (raised.value.error_index, raised.value.exit_code, raised.value.signal_name) == (0, -9, "SIGKILL")


def test_a_readable_error_file_still_reports_the_workers_own_traceback(tmp_path):
    with _killed_worker(tmp_path, pickle.dumps("Traceback: RuntimeError: the worker's own error")) as pcontext:
        compat.tolerate_torn_error_files(pcontext)
        with pytest.raises(ProcessRaisedException, match="the worker's own error"):
            pcontext._pc.join(-1)
