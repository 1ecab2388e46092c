"""What a dead worker leaves running, ended by its launcher.

A worker's processes outlive it: torch's DCP background process for async checkpoint saves (a ``spawn`` child of the
worker) goes on writing the dead worker's checkpoint, and Inductor's compile workers wait for work. torch elastic
stops a forked worker with ``os.kill`` on its pid alone (``MultiprocessContext._close``), not its process group, so
on an H100 a killed worker's writer wrote 26 GB more into the checkpoint volume after the kill, beside the next
worker, which then stopped with ``StorageFullError`` (docs/reliability.md).

The launcher makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux): a dead worker's children then
become the launcher's. Whenever the workers are stopped (a restart in place, the end of the run) the launcher ends
every child it has left (:func:`reap`) and collects their exit status.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

log = logging.getLogger("kubetitan.orphans")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (False where the kernel refuses or is not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap(timeout: float = 5.0) -> list[int]:
    """SIGKILL every child of this process and collect its exit status (waiting at most ``timeout`` s in all); the
    pids ended. Children that ended on their own (zombies) are collected too."""
    import psutil

    procs = psutil.Process().children()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=timeout)
    ended = [p.pid for p in procs]
    if ended:
        log.warning("Ended %d process(es) the stopped workers left behind (pids %s: an async checkpoint writer, "
                    "compile workers)", len(ended), ", ".join(map(str, ended)))
    return ended
