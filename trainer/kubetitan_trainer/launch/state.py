"""What a launcher keeps and sees of its run: the JSON state file its workers read (in-place restarts, failures, the
origin of the next generation's start-up anatomy), whether its in-place agent waits in a rendezvous round, and the
kernel's state of its worker processes (a stopped one is the hung one). Torch-free."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from kubetitan_trainer import atomic
from kubetitan_trainer.launch.failures import exit_code, failure_cause, first_failure


class LauncherState:
    """The JSON file a launcher keeps of its in-place restarts (``KUBETITAN_LAUNCHER_STATE``)."""

    def __init__(self, path: str, started: float | None = None) -> None:
        self.path = path
        self.data: dict = {"restarts": 0, "failures": [], "started": started or time.time(), "warm_import_seconds": 0.0}
        self.write()

    def warmed(self, seconds: float) -> None:
        self.data["warm_import_seconds"] = seconds
        self.write()

    def gate_ended(self, record: dict) -> None:
        """The pre-flight gate's record (:func:`kubetitan_trainer.launch.gate.finish`): its rows, its own seconds
        and ``waited``, what it added to the start-up (generation 0's ``preflight`` phase)."""
        self.data["preflight"] = record
        self.write()

    def failed(self, failures: dict, restarting: bool, detected: float | None = None, report: str = "") -> None:
        """``detected``: when the agent saw the failure (the origin of the next generation's start-up anatomy;
        ``ProcessFailure.timestamp`` is whole seconds); ``report``: the Xid report's text (:func:`~kubetitan_trainer.launch.failures.xid_report`)."""
        rank, first = first_failure(failures)
        self.data["failures"].append({"time": first.timestamp or time.time(), "detected": detected or time.time(),
                                      "local_rank": rank, "exit_code": exit_code(first),
                                      "cause": failure_cause(first, report).cause.id, "restarted": restarting})
        self.data["failures"] = self.data["failures"][-20:]
        if restarting:
            self.data["restarts"] += 1
            self._detected = detected or time.time()
        self.write()

    def restart_begins(self, now: float | None = None) -> None:
        """This agent is about to restart its workers (its own failure, or a peer's: a node waiting in the
        rendezvous): the origin of the next generation's start-up anatomy on this pod."""
        detected = getattr(self, "_detected", None)
        self.data["restart_origin"] = detected or now or time.time()
        self.data["restart_origin_kind"] = "failure_detected" if detected else "peer_restart"
        self._detected = None
        self.write()

    def write(self) -> None:
        atomic.write_json(self.path, self.data, fsync=False)  # read by this pod's workers only


class StoppedInRendezvous(Exception):
    """SIGTERM while the agent waits in a rendezvous round: no worker runs, so nothing is left to save."""


IN_RENDEZVOUS = {"now": False}
"""True while an in-place agent waits in a rendezvous round (its workers are stopped): SIGTERM then ends the
launcher at once instead of waiting out the round (up to its join timeout) while the pod terminates."""


def process_state(pid: int) -> str:
    """The kernel's state letter of ``pid`` (R, S, D, T, Z, ...; '' when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def kill_workers(pids: list[int]) -> None:
    """SIGKILL: a hung or stopped worker may never act on SIGTERM (torch's stop would wait its 30 s for it)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone (or reaped and reused)
            os.kill(pid, signal.SIGKILL)
