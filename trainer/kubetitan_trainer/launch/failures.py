"""Worker failures as the launcher sees them: the failing worker's own exit code, its cause (its exit code and the
text of its failure report and of the node's NVIDIA Xid report, looked up in ``kubetitan_core.causes``), whether an
in-place restart may cure it, and the pod's termination message for a cause found in text (a GPU fault).

Torch-free: a failure is any object with torch elastic ``ProcessFailure``'s ``exitcode``, ``timestamp`` and
``message``."""

from __future__ import annotations

import logging
import os
from typing import Any

from kubetitan_core import causes
from kubetitan_core.contract import ExitCode

log = logging.getLogger("kubetitan.launch")


def first_failure(failures: dict) -> tuple[int, Any]:
    """(local rank, failure) of the failure that came first: the earliest; one that exited by itself beats one that
    torchrun killed (a negative exit code: a signal) on a tie, then the lower rank."""
    return min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))


def exit_code(failure: Any) -> int:
    """A failure's exit code as a shell reports it: a signal's negative code -N becomes 128 + N (-15 -> 143)."""
    code = failure.exitcode
    return 128 - code if code < 0 else code


def failure_summary(message: Any) -> str:
    """A failed worker's message as torch elastic read it from the worker's error file, without the Python call stack
    it records there (``{"message": ..., "extraInfo": {"py_callstack": ...}}``): a classified exit (2, 6, ...) logged
    its own error line, and a crash's traceback is in the agent's ``failed (exitcode: 1)`` record just before
    (:class:`~kubetitan_trainer.launch.launcher.CleanStopLogFilter` keeps it): shown once, not twice."""
    if isinstance(message, dict):
        return str(message.get("message", ""))
    return str(message)


def exit_code_of(failures: dict) -> int:
    """The failing worker's own exit code: earliest failure; self-exits beat killed workers on ties."""
    if not failures:
        return ExitCode.FAILED
    return exit_code(first_failure(failures)[1])


ENV_XID_REPORT = "KUBETITAN_XID_REPORT_FILE"
"""Optional: a file in which something on the node mirrors the NVIDIA driver's Xid lines (``NVRM: Xid (PCI:...):
79, ...``), e.g. a node agent writing the kernel log into a hostPath the pod mounts; set in the trainer image or by
the platform. A worker's exception does not name the Xid behind a GPU that fell off the bus (CUDA reports an
unknown error), the kernel log does. Read only when a worker fails, and only if written after the launcher
started (a stale line from before must not blame this run's GPU)."""
XID_REPORT_TAIL_BYTES = 64 * 1024
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The pod's ``terminationMessagePath`` (Kubernetes' default; plan.py sets ``FallbackToLogsOnError``, so the log's
tail stands in when this file is empty). Written only for a failure cause detected in text (a GPU fault): then
the operator reads it there, whatever the log's last lines are."""


def xid_report(env: dict | None = None, since: float = 0.0) -> str:
    """The tail of the Xid report file (:data:`ENV_XID_REPORT`) if it was written at or after ``since``; else ''."""
    path = (os.environ if env is None else env).get(ENV_XID_REPORT, "")
    try:
        if not path or os.stat(path).st_mtime < since:
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - XID_REPORT_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError as e:
        log.warning("Could not read the Xid report %s: %s", path, e)
        return ""


def failure_cause(failure: Any, report: str = "") -> causes.WorkerCause:
    """The cause of one worker failure (a torch elastic ``ProcessFailure``): its exit code and the text of its
    failure report (the exception torch recorded in the worker's error file) and of the Xid report, looked up in
    ``kubetitan_core.causes`` (:func:`~kubetitan_core.causes.worker_cause`)."""
    text = "\n".join(t for t in (failure_summary(getattr(failure, "message", "")), report) if t)
    return causes.worker_cause(exit_code(failure), text)


def restartable(failures: dict, stop_requested: bool, report: str = "") -> bool:
    """May the gang restart in place after ``failures`` (local rank -> ProcessFailure)? Not after a stop, nor when
    any failure's cause (:func:`failure_cause`) is one that the causes table does not restart in place."""
    if stop_requested:
        return False
    return all(failure_cause(f, report).cause.in_place for f in failures.values())


def text_detected(failures: dict, report: str = "") -> tuple[int, causes.Cause, str] | None:
    """The first failure (local rank, cause, what was seen) whose cause was detected in its text rather than by its
    exit code (a GPU fault); None when there is none."""
    for rank, f in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        found = failure_cause(f, report)
        if found.by_text:
            return rank, found.cause, found.seen
    return None


def report_detected(failures: dict, report: str = "", path: str = TERMINATION_MESSAGE_PATH) -> str | None:
    """Log a failure whose cause was found in its text (:func:`text_detected`) and write it as the pod's termination
    message when ``path`` exists (in a pod it does); the line, or None when there is none."""
    found = text_detected(failures, report)
    if found is None:
        return None
    rank, cause, seen = found
    f = failures[rank]
    line = (f"{cause.id}: {seen} (worker local rank {rank}, exit code {exit_code_of({rank: f})}); not restarted in "
            f"place: {failure_summary(f.message)[:1000]}")
    log.error("%s", line)
    write_termination_message(line, path)
    return line


def write_termination_message(line: str, path: str = TERMINATION_MESSAGE_PATH) -> bool:
    """Write ``line`` as the pod's termination message when ``path`` exists (in a pod it does; elsewhere the line is
    only logged); whether it was written."""
    if not os.path.exists(path):
        return False
    try:
        with open(path, "w") as out:
            out.write(line[:4000])  # the kubelet reads at most 4096 bytes
    except OSError as e:
        log.warning("Could not write the termination message %s: %s", path, e)
        return False
    return True


def workers_exit_code(failures: dict) -> int:
    """The launcher's exit code for the workers' ``failures`` (:func:`exit_code_of`), logged."""
    code = exit_code_of(failures)
    rank, failure = first_failure(failures)
    if code == ExitCode.TERMINATED_CHECKPOINTED:  # every rank saved the stop checkpoint: a clean, resumable stop
        log.info("Workers stopped cleanly after saving the stop checkpoint (exit code %d; the run resumes from it)",
                 code)
    else:
        log.error("Worker rank %d failed first with exit code %d: %s", rank, failure.exitcode,
                  failure_summary(failure.message))
    return code
