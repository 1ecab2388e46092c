"""The persisted observation of the current attempt (``status.observation``): this cycle's read folded into it, and
the decision's inputs (:class:`~kubetitan.observation.Observed`) from it.

Timers live in ``status.observation`` (times as RFC 3339), so a restarted or failed-over operator goes on from where
the last one stopped instead of starting (or firing) them again. Only positive evidence moves the progress times: a
step that advanced, or the trainer's own heartbeat.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from kubetitan import conditions as C
from kubetitan_core import contract
from kubetitan_core.api import AttemptObservation, TrainingStatus
from kubetitan_core.hang import AUTO_HANG_FLOOR_SECONDS
from kubetitan.observation import (DEFAULT_RESIZE_MIN_INTERVAL_SECONDS, Capacity, ChildError, NodeObs, Observed, PodObs,
                                   Progress)
from kubetitan.observation.scrape import sample, sample_int
from kubetitan.timestamps import iso_ms, parse_time


def track(prev: AttemptObservation | None, attempt: int, now: float, *, metrics: Mapping[str, float] | None = None,
          scrape_error: str | None = None, scrape_reason: str | None = None, pods: Iterable[PodObs] = (),
          nodes: Mapping[str, NodeObs] | None = None) -> AttemptObservation:
    """The observation of ``attempt`` after this cycle (a new one when the attempt changed).

    ``metrics``: rank 0's parsed exposition when a scrape answered this cycle (its values already checked by
    ``kubetitan.scraped``); ``scrape_error``: why it did not, ``scrape_reason`` its condition reason (neither: no
    scrape this cycle). Only positive evidence moves the progress times: a step that advanced, or the trainer's
    own heartbeat.
    """
    o = prev.model_copy(deep=True) if prev is not None and prev.attempt == attempt else \
        AttemptObservation(attempt=attempt)
    o.ranks_seen = sorted(set(o.ranks_seen) | {p.rank for p in pods if p.attempt == attempt})
    if nodes is not None:
        # a missing node no pod of the attempt is on any more stays (the pod garbage collector deletes the pods of a
        # deleted node: their ranks disappeared because of it); one that is back, or never was missing, goes
        missing = {n for n, v in nodes.items() if not v.exists} | (set(o.nodes_missing_since) - set(nodes))
        o.nodes_missing_since = {n: o.nodes_missing_since.get(n) or iso_ms(now) for n in sorted(missing)}
    if scrape_error is not None:
        o.metrics_error, o.metrics_error_reason = scrape_error, scrape_reason
        return o
    if not metrics:
        return o
    scraped_attempt = sample_int(metrics, contract.M_ATTEMPT)
    if scraped_attempt is not None and scraped_attempt != attempt:
        o.metrics_error = f"rank 0's /metrics answers for attempt {scraped_attempt}, not {attempt} (an older " \
                          "process still runs there)"
        o.metrics_error_reason = None
        return o
    o.metrics_ok_time, o.metrics_error, o.metrics_error_reason = iso_ms(now), None, None
    _track_generation(o, metrics, now)
    _track_progress(o, metrics, now)
    _track_saves(o, metrics)
    return o


def _track_saves(o: AttemptObservation, metrics: Mapping[str, float]) -> None:
    """The trainer's failed-saves counts (``storage.SaveBudget``): what ``CheckpointSaveFailing`` is built from."""
    in_a_row = sample_int(metrics, contract.M_CHECKPOINT_SAVES_FAILED_IN_A_ROW)
    if in_a_row is None:
        return  # a trainer without the gauges: nothing known
    o.saves_failed_in_a_row = in_a_row
    o.saves_failed = sample_int(metrics, contract.M_CHECKPOINT_SAVES_FAILED)
    o.max_failed_saves = sample_int(metrics, contract.M_CHECKPOINT_MAX_FAILED_SAVES)
    step = sample_int(metrics, contract.M_CHECKPOINT_LAST_FAILED_SAVE_STEP)
    o.last_failed_save_step = step if step is not None and step >= 0 else None
    prefix = contract.M_CHECKPOINT_SAVE_FAILURE + "/"
    o.last_save_error = next((k[len(prefix):] for k in sorted(metrics) if k.startswith(prefix) and metrics[k] == 1),
                             None) if in_a_row else None


def _track_generation(o: AttemptObservation, metrics: Mapping[str, float], now: float) -> None:
    """The launchers' worker generation: a new one (restarted in place) starts the progress over."""
    gen = sample_int(metrics, contract.M_RESTART_GENERATION)
    if gen is not None and gen > (o.generation or 0):
        # The launchers restarted every rank's workers in place: steps may go back (to the checkpoint) and the
        # hang and start-up timers are this generation's, so the progress starts over.
        prev = sample_int(metrics, contract.M_RESTART_PREVIOUS_STEP)  # the launcher's count, exact: beats the last scrape
        o.previous_generation_step = max(prev, o.step or 0) if prev is not None and prev >= 0 else o.step
        o.step = o.start_step = o.first_step_time = o.last_progress_time = o.step_seconds_median = None
        ts = sample(metrics, contract.M_RESTART_TIMESTAMP)
        o.generation_start_time = iso_ms(ts if ts is not None and 0 < ts <= now else now)
        code, rank = sample_int(metrics, contract.M_RESTART_EXIT_CODE), sample_int(metrics, contract.M_RESTART_NODE_RANK)
        o.restart_exit_code = code if code is not None and code >= 0 else None
        o.restart_node_rank = rank if rank is not None and rank >= 0 else None
    if gen is not None and (o.generation is None or gen > o.generation):
        o.generation = gen


def _track_progress(o: AttemptObservation, metrics: Mapping[str, float], now: float) -> None:
    """Step, checkpoint, resumed-from step and the progress times; only positive evidence moves the times."""
    median = sample(metrics, contract.M_STEP_DURATION_MEDIAN)
    if median is not None and median > 0:
        o.step_seconds_median = median
    step = sample_int(metrics, contract.M_STEP)
    beat = sample(metrics, contract.M_LAST_STEP_TIMESTAMP)
    ck = sample_int(metrics, contract.M_LAST_CHECKPOINT_STEP)
    if ck is not None:
        o.last_checkpoint_step = ck
    resumed = sample_int(metrics, contract.M_RESUMED_FROM_STEP)
    if o.start_step is None and resumed is not None and resumed >= 0:
        o.start_step = resumed  # what the workers loaded, even when the first scrape comes steps later
    if step is None or step <= 0:
        return
    # A trainer without the resumed-from gauge: after loading a checkpoint it publishes the step it resumed
    # from, with its heartbeat still 0 until it completes a step of its own; that step is where it starts.
    loaded_only = beat is not None and beat <= 0
    if o.start_step is None:
        o.start_step = step if loaded_only else step - 1
    first = sample(metrics, contract.M_FIRST_STEP_TIMESTAMP)
    if first is not None and first > 0:
        # the trainer's own record of its first step: exact however many steps the first scrape came late
        if o.first_step_time is None or first < (parse_time(o.first_step_time) or now):
            o.first_step_time = iso_ms(first)
    elif o.first_step_time is None and not loaded_only:
        o.first_step_time = iso_ms(beat if beat is not None else now)
    last = parse_time(o.last_progress_time)
    if o.step is None or step > o.step:
        last = now
    if beat is not None and beat > 0 and (last is None or beat > last):
        last = beat
    o.last_progress_time = iso_ms(last) if last is not None else None
    o.step = step if o.step is None else max(o.step, step)


def progress(o: AttemptObservation | None) -> Progress:
    """The decision's view of an observation."""
    if o is None:
        return Progress()
    available = False if o.metrics_error else (True if o.metrics_ok_time else None)
    return Progress(step=o.step, start_step=o.start_step, last_checkpoint_step=o.last_checkpoint_step,
                    last_progress_time=parse_time(o.last_progress_time), first_step_time=parse_time(o.first_step_time),
                    metrics_available=available, metrics_ok_time=parse_time(o.metrics_ok_time),
                    metrics_error=o.metrics_error, generation=o.generation or 0,
                    generation_start_time=parse_time(o.generation_start_time),
                    previous_generation_step=o.previous_generation_step, restart_exit_code=o.restart_exit_code,
                    restart_node_rank=o.restart_node_rank, step_seconds_median=o.step_seconds_median)


def observed(o: AttemptObservation, *, pods: tuple[PodObs, ...], nodes: Mapping[str, NodeObs], now: float,
             generation: int | None = None, spec_block: str | None = None, spec_block_reason: str | None = None,
             spec_deferred: str | None = None,
             training: TrainingStatus | None = None, child_errors: tuple[ChildError, ...] = (),
             missing_children: tuple[str, ...] = (), attempt_steps: int | None = None,
             attempt_nodes: int | None = None, hang_floor_seconds: float = AUTO_HANG_FLOOR_SECONDS,
             capacity: Capacity | None = None,
             resize_min_interval_seconds: float = DEFAULT_RESIZE_MIN_INTERVAL_SECONDS) -> Observed:
    """The decision's inputs; a missing node is timed from when it was first seen missing."""
    timed = {n: (replace(v, not_ready_since=parse_time(o.nodes_missing_since.get(n))) if not v.exists else v)
             for n, v in nodes.items()}
    return Observed(pods=pods, nodes=timed, progress=progress(o), now=now, generation=generation,
                    spec_block=spec_block, spec_block_reason=spec_block_reason or C.IMMUTABLE_FIELD_CHANGED,
                    spec_deferred=spec_deferred, training=training,
                    ranks_seen=frozenset(o.ranks_seen), child_errors=child_errors, observation=o,
                    missing_children=missing_children, attempt_steps=attempt_steps, attempt_nodes=attempt_nodes,
                    hang_floor_seconds=hang_floor_seconds, capacity=capacity,
                    resize_min_interval_seconds=resize_min_interval_seconds)
