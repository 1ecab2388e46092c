"""The operator's progress tracker against the trainer's publishing order after a resume.

After loading checkpoint step N the trainer publishes ``step = N`` and ``last_checkpoint_step = N`` with its
heartbeat still 0 (``trainer.py`` ``_after_load``); only its first own step N + 1 sets the heartbeat. The
attempt must start at N, and its first step (the end of the previous restart's downtime) is N + 1's heartbeat.
"""

from __future__ import annotations

import pytest

from kubetitan_core import contract
from kubetitan.observation.tracking import progress, track

S, A, C, B = contract.M_STEP, contract.M_ATTEMPT, contract.M_LAST_CHECKPOINT_STEP, contract.M_LAST_STEP_TIMESTAMP


@pytest.mark.parametrize(("scrapes", "want"), [
    # (now, metrics) per scrape -> (step, start_step, first_step_time)
    ([(100.0, {S: 4, A: 1, C: 4, B: 0}), (103.0, {S: 5, A: 1, C: 4, B: 102.5})], (5, 4, 102.5)),
    ([(100.0, {S: 4, A: 1, C: 4, B: 0}), (101.0, {S: 4, A: 1, C: 4, B: 0})], (4, 4, None)),
    ([(100.0, {S: 4, A: 1, C: 4, B: 0}), (104.0, {S: 7, A: 1, C: 4, B: 103.9})], (7, 4, 103.9)),
    ([(103.0, {S: 5, A: 1, C: 4, B: 102.5})], (5, 4, 102.5)),
    ([(50.0, {S: 1, A: 0, B: 49.0})], (1, 0, 49.0)),
    ([(50.0, {S: 3, A: 0})], (3, 2, 50.0)),
], ids=["load-then-step", "loaded-not-stepped", "load-then-missed-steps", "first-seen-after-step", "fresh-run",
        "no-heartbeat-metric"])
def test_resumed_step_is_the_start_not_the_first_step(scrapes, want) -> None:
    o = None
    for now, m in scrapes:
        o = track(o, m[A], now, metrics={k: float(v) for k, v in m.items()})
    p = progress(o)
    assert (p.step, p.start_step, p.first_step_time) == want


NOW = 1_000_000.0
LOADED = {S: 4, A: 1, C: 4, B: 0}  # the resumed step published after loading; no step trained yet


def _decide(scrapes: list[tuple[float, dict]], now: float):
    from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus
    from kubetitan.decide import decide
    from kubetitan.observation import NodeObs, Observed, PodObs

    o = None
    for t, m in scrapes:
        o = track(o, 1, t, metrics={k: float(v) for k, v in m.items()})
    spec = LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "runPolicy": {  # the operator's own hang rule
        "hangTimeoutSeconds": 10, "startupTimeoutSeconds": 300, "maxInPlaceRestarts": 0}})
    pods = tuple(PodObs(name=f"j-a1-{r}", attempt=1, rank=r, phase="Running", node_name=f"n{r}",
                        created=NOW - 20, running_since=NOW - 15) for r in range(2))
    obs = Observed(pods=pods, nodes={f"n{r}": NodeObs(f"n{r}") for r in range(2)}, progress=progress(o), now=now,
                   ranks_seen=frozenset({0, 1}))
    return decide(spec, LlamaPretrainStatus(attempt=1, restart_count=1), obs)


@pytest.mark.parametrize(("scrapes", "now", "cause"), [
    # loaded at NOW - 12, the first step (warm-up, compile, a busy machine) is still running: start-up, not a hang
    ([(NOW - 12, LOADED)], NOW, None),
    # ... until runPolicy.startupTimeoutSeconds after the pods started running, seen by a scrape that answered
    ([(NOW - 12, LOADED), (NOW + 290, LOADED)], NOW + 290, "StartupTimeout"),
    # without a scrape since, there is no evidence that start-up still runs: no restart
    ([(NOW - 12, LOADED)], NOW + 290, None),
    # once the attempt trained a step, 10 s without another one (seen by an answering scrape) is a hang
    ([(NOW - 12, LOADED), (NOW - 11, {S: 5, A: 1, C: 4, B: NOW - 11}), (NOW, {S: 5, A: 1, C: 4, B: NOW - 11})],
     NOW, "Hang"),
    ([(NOW - 12, LOADED), (NOW - 5, {S: 5, A: 1, C: 4, B: NOW - 5})], NOW, None),
], ids=["loaded-waiting-for-first-step", "loaded-startup-timeout", "loaded-no-scrape-since", "trained-then-stuck-hang",
        "trained-recently"])
def test_hang_timer_starts_with_the_first_trained_step(scrapes, now, cause) -> None:
    d = _decide(scrapes, now)
    assert d.cause == cause, d


@pytest.mark.parametrize(("step", "idle", "cause"), [
    (7, 11, "Hang"),    # an ordinary step: hangTimeoutSeconds (10)
    (8, 11, None),      # a checkpoint step (interval 4): its save may block for saveTimeoutSeconds (10) more
    (8, 21, "Hang"),
    (20, 15, None),     # the last step: final save, then the processes exit
    (20, 21, "Hang"),
], ids=["plain-step", "checkpoint-step-saving", "checkpoint-step-stuck", "last-step-exiting", "last-step-stuck"])
def test_hang_window_covers_a_checkpoint_save(step, idle, cause) -> None:
    from kubetitan_core.api import LlamaPretrainSpec, LlamaPretrainStatus
    from kubetitan.decide import decide
    from kubetitan.observation import NodeObs, Observed, PodObs, Progress

    spec = LlamaPretrainSpec.model_validate({
        "training": {"steps": 20}, "resources": {"nodes": 2},
        "checkpoint": {"intervalSteps": 4, "saveTimeoutSeconds": 10},
        "runPolicy": {"hangTimeoutSeconds": 10, "maxInPlaceRestarts": 0}})  # the operator's rule, no launcher's first
    pods = tuple(PodObs(name=f"j-a0-{r}", attempt=0, rank=r, phase="Running", node_name=f"n{r}",
                        created=NOW - 99, running_since=NOW - 98) for r in range(2))
    pr = Progress(step=step, start_step=0, last_progress_time=NOW - idle, first_step_time=NOW - 90,
                  metrics_available=True, metrics_ok_time=NOW)
    d = decide(spec, LlamaPretrainStatus(attempt=0), Observed(pods=pods, nodes={f"n{r}": NodeObs(f"n{r}") for r in
                                                                               range(2)}, progress=pr, now=NOW,
                                                                      ranks_seen=frozenset({0, 1})))
    assert d.cause == cause, d
