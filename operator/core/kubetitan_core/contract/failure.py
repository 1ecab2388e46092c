"""The failure report of an in-place restart: which worker failure began a worker generation.

A launcher whose worker failed (or whose hang watchdog stopped one) posts a :class:`FailureReport` to the gang's
rendezvous store; each launcher reads the one that began the next generation and hands it to its workers in
``KUBETITAN_RESTART_FAILURE`` (:data:`kubetitan_core.contract.ENV_RESTART_FAILURE`); the trainer exports it as the
``kubetitan_trainer_restart_*`` gauges that the operator scrapes into ``status.restarts``. One JSON shape, written
and read only here. Pure, torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from kubetitan_core.contract import ENV_RESTART_FAILURE


@dataclass(frozen=True)
class FailureReport:
    """One worker failure, as a launcher saw it."""

    exit_code: int
    """The worker's exit code (128 + N for signal N; ``ExitCode.HANG`` for a worker the hang watchdog stopped)."""
    node_rank: int
    """Node (pod) rank of the failure; -1 when no node is to blame (a hang with no stopped worker: every rank's
    step stands still together, and the first watchdog to fire says nothing of where the hang is)."""
    time: float
    """Unix time the launcher saw the failure (seconds)."""
    local_rank: int = -1
    """Local rank of the failed worker on its node; -1 when unknown."""
    stopped: bool = False
    """A hang whose worker the launcher found stopped (state T): that worker is the hung one."""
    message: str = ""
    """What the hang watchdog saw (the step, how long it stood still, the limit); empty for a plain failure."""
    seen_by: int | None = None
    """Node rank of the launcher that reported a hang (``node_rank`` may be -1)."""
    previous_step: int | None = None
    """The last step the ending worker generation trained (from its step heartbeats); None when unknown."""

    def to_json(self) -> str:
        """The JSON object, without the optional fields that are unset (None)."""
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, text: str | None) -> FailureReport | None:
        """The report in ``text``; None when there is none (empty) or it is not a report (then nothing is claimed
        about the failure: the gauges say unknown). Keys this version does not know are ignored."""
        try:
            data = json.loads(text or "null")
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:  # a required key is missing
            return None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FailureReport | None:
        """The report that began this worker generation (None in generation 0)."""
        return cls.from_json(env.get(ENV_RESTART_FAILURE))
