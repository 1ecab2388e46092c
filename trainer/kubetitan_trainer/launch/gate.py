"""The launcher's side of the pre-flight gate (:mod:`kubetitan_trainer.preflight`): started as the launcher starts,
waited for after its warm imports, logged, kept in the launcher's state (the workers' start-up anatomy reads it), and
on a failed check the pod's termination message and exit code 8 (cause ``PreflightFailed``). Once per launcher, so
once per attempt: an in-place restart's workers start without it."""

from __future__ import annotations

import logging
import os
import time

from kubetitan_core.contract import ExitCode
from kubetitan_core.contract.launcher import LauncherArgs

from kubetitan_trainer import preflight
from kubetitan_trainer.launch.failures import TERMINATION_MESSAGE_PATH, write_termination_message
from kubetitan_trainer.launch.state import LauncherState

log = logging.getLogger("kubetitan.launch")


def start(a: LauncherArgs) -> preflight.Pending | None:
    """Begin this pod's gate as the launcher starts (a GPU pod's gate process overlaps the launcher's imports); None
    when ``[kubetitan.preflight] enabled`` is false or there is no config (the launcher then exits with exit code 2)."""
    if not os.path.isfile(a.config):
        return None
    settings = preflight.Settings.from_config(a.config)
    if not settings.enabled:
        log.info("Pre-flight gate off (spec.runPolicy.preflight: Disabled)")
        return None
    return preflight.begin(settings, a.config)


def finish(gate: preflight.Pending | None, state: LauncherState,
           termination_path: str = TERMINATION_MESSAGE_PATH) -> int | None:
    """Wait for the gate (run it, on a CPU pod), log its rows and keep its record in ``state``; the exit code when a
    check failed (the termination message names the node and the checks), None when the workers may start."""
    if gate is None:
        state.gate_ended({"status": "disabled", "waited": 0.0})
        return None
    begin = time.time()
    result = gate.end()
    waited = time.time() - begin
    for r in result.rows:
        log.log(logging.ERROR if r.status == "failed" else logging.INFO, "Pre-flight %s", r.line())
    log.info("%s; the launcher waited %.2f s for it beyond its imports", result.summary(), waited)
    state.gate_ended({"status": "failed" if result.failed else "passed", "waited": round(waited, 3),
                      **result.to_dict()})
    if not result.failed:
        return None
    line = result.termination_message()
    log.error("%s. Not starting the workers: exit code %d; the operator re-creates the gang without this node",
              line, int(ExitCode.PREFLIGHT_FAILED))
    write_termination_message(line, termination_path)
    return int(ExitCode.PREFLIGHT_FAILED)
