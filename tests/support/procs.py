"""Long-lived helper processes of the tests (the control plane, the S3-compatible server, operators, Prometheus) end
with the test process that started them, however it ends.

A fixture's teardown stops them in the ordinary case; ``die_with_parent`` covers the others (pytest killed by a
timeout or SIGKILL, an xdist worker crashing): Linux sends the child ``SIGTERM`` when the thread that forked it
exits (``prctl(PR_SET_PDEATHSIG)``), so no control plane or server outlives the run that owned it. ``running``: whether
a process the test started is still running.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """``preexec_fn`` of ``subprocess.Popen``: the child gets SIGTERM when its parent (thread) exits."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def running(pid: int) -> bool:
    """Whether ``pid`` runs: neither ended nor a zombie waiting for its parent. A process that ends between the open of
    ``/proc/PID/stat`` and its read makes the read fail with ESRCH (``ProcessLookupError``), hence any ``OSError``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
