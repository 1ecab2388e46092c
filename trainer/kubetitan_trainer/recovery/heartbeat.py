"""Step heartbeats from each worker to its launcher, and the launcher's hang rule on them.

With in-place restarts on, the launcher sets ``KUBETITAN_HEARTBEAT_DIR`` (a folder of its own); every worker
writes ``heartbeat-<local rank>.json`` there after each trained step: its generation, the step, the time (wall
clock for people, and ``CLOCK_MONOTONIC``, which the launcher compares: the same clock for every process of the
machine, and a wall-clock step never looks like a hang), the median of its recent step times, how many steps
this worker trained and whether a save may follow the step (a checkpoint step, the last step, or a SIGTERM stop,
whose full save every rank takes at whatever step it is).
The launcher's watchdog (``launch.agent.InPlaceAgent``) reads them every monitor interval and applies the hang rule
(:mod:`kubetitan_core.hang`, the operator's too): a worker whose step stood still past the limit is stopped
and every rank's workers restart in place (cause ``Hang``). The watchdog needs no /metrics and no API: a frozen
rank 0 (whose /metrics freezes with it) is caught the same way.

Before a worker's first step there is no heartbeat of its generation: start-up (checkpoint load, compile) is
the operator's ``startupTimeoutSeconds``, not a hang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass

from kubetitan_core import contract, hang
from kubetitan_trainer import atomic

log = logging.getLogger("kubetitan.heartbeat")

ENV_HEARTBEAT_DIR = "KUBETITAN_HEARTBEAT_DIR"
"""Folder of the workers' heartbeat files, set by an in-place launcher (unset: no heartbeats are written)."""
MEDIAN_WINDOW = 50
"""Steps in the heartbeat's rolling median (as the exporter's ``step_duration_median_seconds``)."""


def path(folder: str, local_rank: int) -> str:
    return os.path.join(folder, f"heartbeat-{local_rank}.json")


class Writer:
    """One worker's heartbeat (a no-op without ``KUBETITAN_HEARTBEAT_DIR``)."""

    def __init__(self, folder: str, local_rank: int, generation: int, last_step: int, checkpoint_enabled: bool,
                 interval_steps: int) -> None:
        self.file = path(folder, local_rank) if folder else ""
        self.generation, self.last_step = generation, last_step
        self.checkpoint_enabled, self.interval_steps = checkpoint_enabled, interval_steps
        self._recent: list[float] = []
        self._count = 0
        self._failed = False

    @classmethod
    def from_env(cls, last_step: int, checkpoint_enabled: bool, interval_steps: int) -> Writer:
        return cls(os.environ.get(ENV_HEARTBEAT_DIR, ""), int(os.environ.get("LOCAL_RANK", "0") or 0),
                   int(os.environ.get(contract.ENV_RESTART_GENERATION, "0") or 0), last_step, checkpoint_enabled,
                   interval_steps)

    def step_done(self, step: int, seconds: float, saving: bool = False, now: float | None = None) -> None:
        """Record ``step`` (trained in ``seconds``); ``saving``: a save follows that is not a checkpoint step's (a
        SIGTERM stop). ``now``: the monotonic clock (tests). Never raises: a heartbeat that cannot be written
        (a full /tmp) is logged once and training goes on (the watchdog then times the last one written)."""
        if not self.file:
            return
        self._recent = [*self._recent[-(MEDIAN_WINDOW - 1):], seconds]
        self._count += 1
        beat = {"generation": self.generation, "step": step, "time": time.time(),
                "monotonic": time.monotonic() if now is None else now,
                "median_step_seconds": statistics.median(self._recent), "steps_trained": self._count,
                "save_window": saving or hang.save_window(step, self.last_step, self.checkpoint_enabled,
                                                          self.interval_steps)}
        try:
            atomic.write_json(self.file, beat, fsync=False)  # read by the launcher on this node only
        except OSError as e:
            if not self._failed:
                self._failed = True
                log.warning("Could not write the step heartbeat %s (the hang watchdog sees no newer step): %s",
                            self.file, e)


def read(folder: str, local_ranks: range | list[int]) -> dict[int, dict]:
    """The heartbeats there are, by local rank (a missing or half-written file: none for that rank)."""
    out = {}
    for r in local_ranks:
        try:
            with open(path(folder, r)) as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            continue
    return out


def clear(folder: str, local_ranks: range | list[int]) -> None:
    """Remove the heartbeats of workers that are gone (before their generation's successors start)."""
    for r in local_ranks:
        with contextlib.suppress(OSError):  # none written, or already gone
            os.remove(path(folder, r))


@dataclass(frozen=True)
class Rule:
    """The run's hang settings, as the operator passed them to the launcher."""

    policy: str = "Auto"
    timeout_seconds: float = 900.0
    floor_seconds: float = float(hang.AUTO_HANG_FLOOR_SECONDS)
    save_timeout_seconds: float = 600.0


@dataclass(frozen=True)
class Stall:
    local_rank: int
    step: int
    idle_seconds: float
    limit_seconds: float
    how: str

    def describe(self) -> str:
        return (f"local rank {self.local_rank} made no step progress for {self.idle_seconds:.0f}s after step "
                f"{self.step} (limit {self.limit_seconds:.0f}s: {self.how})")


def stalled(beats: dict[int, dict], generation: int, now: float, rule: Rule) -> Stall | None:
    """The local worker whose step stood still longest past its hang limit, or None (pure; table-tested).

    ``now``: ``time.monotonic()``. Only heartbeats of ``generation`` count: a worker that has not trained a step of
    its own yet is starting up."""
    worst: Stall | None = None
    for r, b in sorted(beats.items()):
        if b.get("generation") != generation:
            continue
        base, how = hang.timeout(rule.policy, rule.timeout_seconds, rule.floor_seconds,
                                 b.get("median_step_seconds"), b.get("steps_trained"))
        limit = hang.limit(base, bool(b.get("save_window")), rule.save_timeout_seconds)
        idle = now - float(b["monotonic"])
        if idle >= limit and (worst is None or idle - limit > worst.idle_seconds - worst.limit_seconds):
            worst = Stall(r, int(b["step"]), idle, limit, how)
    return worst
