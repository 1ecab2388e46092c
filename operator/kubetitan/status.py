"""The one place that builds a LlamaPretrain's status (pure: no kopf, no client, no clock).

The reconcile cycle (``kubetitan.reconcile``) calls, per cycle:

1. ``observation.snapshot.decision_inputs`` — this cycle's read folded into the persisted ``status.observation``
   (``observation.tracking``) and the decision's inputs (:class:`~kubetitan.observation.Observed`) from it, with
   :func:`training_status` for this scrape's numbers;
2. ``decide.decide`` — the decision;
3. :func:`next_status` — the whole new status (conditions, attempt, restart history, training numbers,
   observation), written once; or :func:`invalid_status` for a spec that does not validate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kubetitan import conditions as C
from kubetitan import plan
from kubetitan_core import contract
from kubetitan_core.api import (
    RESIZE_CAUSES, AttemptObservation, Condition, DataSpec, LlamaPretrainSpec, LlamaPretrainStatus, SourceLossStatus,
    StartupPhases, StatusEvent, TrainingStatus, elastic_sizes,
)
from kubetitan.decide.core import MAX_RESTART_RECORDS, Action, Decision, restart_event
from kubetitan.decide.failure import in_place_record, restart_record
from kubetitan.observation import Observed, Progress
from kubetitan.observation.scrape import sample, sample_int
from kubetitan.timestamps import iso, parse_time

MAX_PENDING_EVENTS = 20
"""Status events kept while unsent (the newest): an API that refuses Events for long loses the oldest only."""


def spec_gate(applied: Mapping[str, Any] | None, spec: LlamaPretrainSpec,
              changes: tuple[list[str], list[str], list[str]]) -> tuple[str | None, str | None, str | None]:
    """(block, its reason, deferred): what an edit of a started run's spec does, against the spec its current
    attempt was created from (``applied``; ``changes`` is ``observation.spec.spec_changes(applied, spec)``).

    A change that would make the checkpoints unusable blocks the next attempt (``ImmutableFieldChanged``); so does
    a change of the data-parallel degree of a run whose data cannot resume at another one (hub-streamed data:
    ``WorldSizeChangeRefused``, :func:`kubetitan.plan.world_size_edit`); any other change, a world-size change of a
    run on shards or synthetic data included, waits for the next attempt (deferred). Never does an edit touch the
    live attempt's pods.
    """
    if applied is None:
        return None, None, None
    _live, later, rejected = changes
    if rejected:
        return (f"changing {', '.join(rejected)} would make the run's checkpoints unusable; revert it, or create a "
                "new LlamaPretrain", C.IMMUTABLE_FIELD_CHANGED, None)
    try:
        edit = plan.world_size_edit(LlamaPretrainSpec.model_validate(dict(applied)), spec)
    except ValidationError:  # an attempt created by an older operator: compare the fields themselves (the degree
        # may have changed) and read its data alone (unreadable: it may be hub-streamed, so refuse)
        field = next((f for f in plan.WORLD_SIZE_FIELDS if any(k == f or k.startswith(f + ".") for k in later)), None)
        try:
            then = DataSpec.model_validate(applied.get("data") or {})
            resumes = contract.resumes_at_another_dp_degree(then) and contract.resumes_at_another_dp_degree(spec.data)
        except ValidationError:
            resumes = False
        edit = plan.WorldSizeEdit(f"{field} changed", f"spec.{field}", resumes) if field is not None else None
    if edit is not None and not edit.allowed:
        return edit.refusal, C.WORLD_SIZE_CHANGE_REFUSED, None
    if later:
        size = "" if edit is None else f"; {edit.deferral}" if edit.elastic is not None else (
            f"; {edit.change}: the next attempt resumes the newest checkpoint at the new size")
        return None, None, (f"{', '.join(later)} changed; applied when the next attempt starts (suspend and resume to "
                            "apply now)" + size)
    return None, None, None


def source_losses(spec: LlamaPretrainSpec, m: Mapping[str, float],
                  old: list[SourceLossStatus]) -> list[SourceLossStatus]:
    """A mixture's per-source losses (``status.training.sources``) from rank 0's per-source samples, at most one per
    mixture source (a pod cannot grow the status past the spec's sources); each loss keeps its last value until a
    new one comes (the eval loss between evaluations)."""
    by_name = {s.name: s.model_copy() for s in old}
    for metric, attr in ((contract.M_SOURCE_LOSS, "loss"), (contract.M_SOURCE_EVAL_LOSS, "eval_loss")):
        prefix = metric + "/"
        for key in sorted(k for k in m if k.startswith(prefix)):
            name = key[len(prefix):]
            if name not in by_name and len(by_name) >= len(spec.data.mixture or []):
                continue
            if (v := sample(m, key)) is not None and abs(v) != float("inf"):
                setattr(by_name.setdefault(name, SourceLossStatus(name=name)), attr, round(v, 6))
    return sorted(by_name.values(), key=lambda s: s.name)


def startup_phases(m: Mapping[str, float]) -> StartupPhases | None:
    """The running workers' start-up anatomy from rank 0's metrics; None before their first step."""
    total = sample(m, contract.M_STARTUP_SECONDS)
    if total is None:
        return None
    phases = {f"{p}_seconds": round(v, 3) for p in contract.STARTUP_PHASES
              if (v := sample(m, f"{contract.M_STARTUP_PHASE_SECONDS}/{p}")) is not None}
    return StartupPhases(generation=sample_int(m, contract.M_RESTART_GENERATION), total_seconds=round(total, 3), **phases)


LIVE_TRAINING_FIELDS = ("tokens_per_second", "tokens_per_second_per_gpu", "tflops_per_gpu", "mfu", "eta")
"""``status.training`` numbers that describe workers training now (the pace, and the ETA from it): unknown while no
worker trains (an attempt ended, workers that have not completed a step of their own yet), never an older
attempt's. The step, its loss, checkpoints, eval and goodput describe what was reached and stay."""


def _trained(m: Mapping[str, float]) -> bool:
    """The workers that answered completed an optimizer step of their own (their first-step time, else their
    heartbeat, is set; an exporter with neither counts every step it reports)."""
    first = sample(m, contract.M_FIRST_STEP_TIMESTAMP)
    if first is not None:
        return first > 0
    beat = sample(m, contract.M_LAST_STEP_TIMESTAMP)
    return beat is None or beat > 0


def _idle(t: TrainingStatus) -> None:
    """No worker trains now: the pace and the ETA are unknown (:data:`LIVE_TRAINING_FIELDS`)."""
    for attr in LIVE_TRAINING_FIELDS:
        setattr(t, attr, None)


def training_status(spec: LlamaPretrainSpec, m: Mapping[str, float], now: float,
                    old: TrainingStatus | None) -> TrainingStatus:
    """``status.training`` from rank 0's metrics (metric names in ``contract.M_*``).

    Workers that have not completed a step of their own yet (loading, or just loaded, a checkpoint) report no pace: the
    live numbers are unknown, and the step is the one they resumed from once they have loaded it (before that, the
    step shown stays: a fresh exporter's 0 is not a step), with no loss (it was an older step's)."""
    t = old.model_copy() if old is not None else TrainingStatus()
    step, trained = sample_int(m, contract.M_STEP), _trained(m)
    resumed = sample_int(m, contract.M_RESUMED_FROM_STEP)
    if not trained:
        _idle(t)
        if step is not None and resumed is not None and resumed >= 0 and step != t.step:
            t.step, t.loss = step, None
    elif step is not None:
        t.step = step
    names = (("loss", contract.M_LOSS), ("tokens_per_second", contract.M_TOKENS_PER_SECOND),
             ("tokens_per_second_per_gpu", contract.M_TOKENS_PER_SECOND_PER_GPU), ("mfu", contract.M_MFU))
    for attr, key in names if trained else ():
        v = sample(m, key)
        if v is not None:
            setattr(t, attr, round(v, 6))
    flops = sample(m, contract.M_FLOPS_PER_GPU)
    if flops is not None and trained:
        t.tflops_per_gpu = round(flops / 1e12, 3)
    ck = sample_int(m, contract.M_LAST_CHECKPOINT_STEP)
    if ck is not None:
        t.last_checkpoint_step = ck
    # held-out evaluation (spec.data.eval): the step of the newest one and its loss; an overflowing perplexity is unknown
    if (ev := sample_int(m, contract.M_EVAL_STEP)) is not None:
        t.eval_step = ev
    for attr, key in (("eval_loss", contract.M_EVAL_LOSS), ("eval_perplexity", contract.M_EVAL_PERPLEXITY)):
        if (v := sample(m, key)) is not None and abs(v) != float("inf"):
            setattr(t, attr, round(v, 6))
    if trained and (sources := source_losses(spec, m, t.sources)):
        t.sources = sources
    t.total_steps = spec.training.steps
    # goodput = productive step seconds / wall seconds since the run started
    prod, start = sample(m, contract.M_PRODUCTIVE_SECONDS), sample(m, contract.M_JOB_START_TIMESTAMP)
    if prod is not None and start is not None and now > start:
        t.goodput = round(min(1.0, max(0.0, prod / (now - start))), 4)
    dur = sample(m, contract.M_STEP_DURATION)
    if trained and t.step is not None and dur is not None and dur > 0:
        t.eta = iso(now + max(0, spec.training.steps - t.step) * dur)
    t.progress = f"{t.step if t.step is not None else 0}/{spec.training.steps}"
    t.startup = startup_phases(m)  # absent until the running workers' first step (never an older generation's)
    t.last_update_time = iso(now)
    return t


# ------------------------------------------------------------------ 4. next status
def next_status(spec: LlamaPretrainSpec, status: LlamaPretrainStatus, d: Decision,
                obs: Observed) -> LlamaPretrainStatus:
    """The status after ``d``: conditions, attempt, restart history, training numbers, observation.

    In order: the observation carried in (:func:`_carry_observation`), the last restart's record settled
    (:func:`_settle_restarts`), the attempt moved on (:func:`_advance_attempt`), then the conditions, the derived
    phase and the Events of the conditions' transitions (``pendingEvents``)."""
    s = status.model_copy(deep=True)
    now = iso(obs.now)
    s.observed_generation = obs.generation
    attempt = s.attempt if s.attempt is not None else 0
    _carry_observation(spec, s, d, obs, now)
    _settle_restarts(s, status, d, obs, attempt)
    _advance_attempt(spec, s, status, d, obs, attempt, now)
    conds = s.conditions
    before = {c.type: c.model_copy() for c in conds}

    def cond(type_: str, st: str, reason: str, msg: str) -> None:
        C.set_condition(conds, type_, st, reason, msg, now, obs.generation)

    _outcome_conditions(spec, d, obs, cond)
    if d.action not in (Action.FAIL, Action.SUCCEED, Action.FINISHED):
        _progress_conditions(spec, s, d, obs, attempt, cond)
    elif d.action == Action.FAIL or d.action == Action.SUCCEED:
        cond(C.RESTARTING, "False", C.NOT_RESTARTING, "the run is finished")
        cond(C.SUSPENDED, "False", C.NOT_SUSPENDED, "the run is finished")
    _ready_condition(d, attempt, cond)
    s.phase = C.derive_phase(conds)
    if d.action != Action.FINISHED:
        s.message = d.message
    conds.sort(key=lambda c: C.ALL_TYPES.index(c.type) if c.type in C.ALL_TYPES else len(C.ALL_TYPES))
    s.pending_events = [*s.pending_events, *status_events(before, conds, d, attempt, obs, now)][-MAX_PENDING_EVENTS:]
    return s


def _carry_observation(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, d: Decision, obs: Observed, now: str) -> None:
    """The training numbers and the observation of this cycle; the start time and attempt 0 of a first create."""
    if obs.training is not None:
        s.training = obs.training
    if s.training is None:
        s.training = TrainingStatus()
    s.training.total_steps = spec.training.steps
    if obs.observation is not None:
        s.observation = obs.observation.model_copy(deep=True)
    if s.observation is not None and (d.grow_plan is not None or d.cancel_grow):
        s.observation.grow_to, s.observation.grow_after_step = d.grow_plan or (None, None)
    if d.action == Action.CREATE and s.start_time is None:
        s.start_time = now
    if d.action == Action.CREATE and d.nodes is not None:
        s.nodes = d.nodes
    if s.attempt is None and d.action in (Action.CREATE, Action.WAIT, Action.KEEP):
        s.attempt = 0


def _settle_restarts(s: LlamaPretrainStatus, status: LlamaPretrainStatus, d: Decision, obs: Observed,
                     attempt: int) -> None:
    """The last restart's downtime, resumed step and start-up anatomy, once the workers after it trained a step;
    an in-place restart's record."""
    # The downtime of the last restart ends with the next attempt's first step. By then the step that attempt
    # really resumed from is known too: the record's guess (the newest checkpoint scraped before the failure)
    # misses a save that completed between the last scrape and the failure, and then overstates lostSteps.
    if s.restarts and s.restarts[-1].downtime_seconds is None and s.restarts[-1].attempt < attempt \
            and obs.progress.first_step_time is not None:
        last = s.restarts[-1]
        t0 = parse_time(last.time) or obs.now
        last.downtime_seconds = round(max(0.0, obs.progress.first_step_time - t0), 3)
        if obs.progress.start_step is not None:
            # lostSteps stays unknown when no step of the failed attempt was scraped before it failed
            if last.lost_steps is not None:
                ended = (last.resumed_from_step or 0) + last.lost_steps  # the failed attempt's last step
                last.lost_steps = max(0, ended - obs.progress.start_step)
            last.resumed_from_step = obs.progress.start_step

    if d.action == Action.RESTARTED_IN_PLACE:  # the same attempt and pods; a new worker generation
        s.restarts = [*s.restarts, in_place_record(status, d, obs)][-MAX_RESTART_RECORDS:]
        s.restart_count += 1
    last = s.restarts[-1] if s.restarts else None
    if last is not None and last.mode == "InPlace" and last.downtime_seconds is None and last.attempt == attempt \
            and last.generation == obs.progress.generation and obs.progress.first_step_time is not None:
        # settled at the generation's first trained step, like an attempt's (above)
        last.downtime_seconds = round(max(0.0, obs.progress.first_step_time - (parse_time(last.time) or obs.now)), 3)
        if obs.progress.start_step is not None:
            last.resumed_from_step = obs.progress.start_step
            prev = obs.progress.previous_generation_step
            last.lost_steps = None if prev is None else max(0, prev - obs.progress.start_step)

    # The start-up anatomy of the workers that followed the last restart, once they trained a step.
    started = obs.training.startup if obs.training is not None else None
    last = s.restarts[-1] if s.restarts else None
    if started is not None and last is not None and last.startup is None and (
            (last.mode == "InPlace" and last.attempt == attempt and last.generation == started.generation)
            or (last.mode != "InPlace" and last.attempt < attempt and not started.generation)):
        last.startup = started.model_copy()


def _advance_attempt(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, status: LlamaPretrainStatus, d: Decision,
                     obs: Observed, attempt: int, now: str) -> None:
    """A restart's record and the next attempt; the end of the run; the progress column."""
    assert s.training is not None
    if d.action == Action.RESTART:
        rec = restart_record(status, d, obs)
        if d.cause in RESIZE_CAUSES:  # its own budget (runPolicy.elastic.maxResizes), not maxRestarts
            rec.from_nodes = s.nodes if s.nodes is not None else (obs.attempt_nodes or spec.resources.nodes)
            rec.to_nodes = s.nodes = d.nodes
            s.resize_count += 1
        else:
            s.restart_count += 1
        s.restarts = [*s.restarts, rec][-MAX_RESTART_RECORDS:]
        s.attempt = attempt + 1
        if s.training.step != rec.resumed_from_step:  # the steps after the newest checkpoint are trained again
            s.training.step, s.training.loss = rec.resumed_from_step, None  # (the loss was a lost step's)
    if d.action == Action.SUSPEND and d.ends_attempt:
        s.attempt = attempt + 1  # the stopped gang's names are used up; resume makes a new attempt
    if d.action == Action.CONTINUE:
        s.attempt = attempt + 1  # the finished gang's names are used up; no restart record (nothing failed)
    if s.attempt != attempt:
        s.observation = AttemptObservation(attempt=s.attempt)  # the new attempt's timers start from nothing
        _idle(s.training)  # its workers have not trained yet: no pace, no ETA, never the old attempt's
    if d.action in (Action.FAIL, Action.SUCCEED) and s.completion_time is None:
        s.completion_time = now
    if d.action == Action.SUCCEED:
        # the workers finished their count: the last scrape may have come a few steps before the end (or never)
        trained = obs.attempt_steps if obs.attempt_steps is not None else spec.training.steps
        s.training.step = trained if s.training.step is None else max(s.training.step, trained)
    if d.action in (Action.FAIL, Action.SUCCEED, Action.FINISHED):
        s.training.eta = None  # a finished run has no ETA (its pace, the last one measured, stays)
    step = s.training.step  # after the lines above: a succeeded run shows the step it reached
    s.training.progress = f"{step if step is not None else 0}/{spec.training.steps}"


def _outcome_conditions(spec: LlamaPretrainSpec, d: Decision, obs: Observed, cond: Any) -> None:
    """SpecAccepted, CheckpointsDurable, Succeeded and Failed."""
    if obs.spec_block:
        cond(C.SPEC_ACCEPTED, "False", obs.spec_block_reason, obs.spec_block)
    elif obs.spec_deferred:
        cond(C.SPEC_ACCEPTED, "True", C.DEFERRED_TO_NEXT_ATTEMPT, obs.spec_deferred)
    else:
        cond(C.SPEC_ACCEPTED, "True", C.SPEC_APPLIED, "the spec is valid and applied")
    cond(C.CHECKPOINTS_DURABLE, *C.checkpoints_durable(spec))
    if d.action == Action.SUCCEED:
        cond(C.SUCCEEDED, "True", d.reason, d.message)
        cond(C.FAILED, "False", C.NOT_FINISHED, "the run succeeded")
    elif d.action == Action.FAIL:
        cond(C.FAILED, "True", d.reason, d.message)
        cond(C.SUCCEEDED, "False", d.reason, "the run failed")
    elif d.action != Action.FINISHED:
        cond(C.SUCCEEDED, "False", C.NOT_FINISHED, "training has not reached spec.training.steps yet")
        cond(C.FAILED, "False", C.NOT_FINISHED, "the run has not failed")


def _progress_conditions(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, d: Decision, obs: Observed, attempt: int,
                         cond: Any) -> None:
    """Suspended, Restarting, Unschedulable, ChildrenCreated and MetricsAvailable of a run that is not finished."""
    conds = s.conditions
    if d.action == Action.SUSPEND:
        cond(C.SUSPENDED, "True", d.reason, d.message)
    else:
        cond(C.SUSPENDED, "False", C.NOT_SUSPENDED, "runPolicy.suspend is false")
    trains = d.ready or d.reason == C.PROGRESS_UNKNOWN  # a step of this attempt was seen: the restart is over
    restarting = d.action == Action.RESTART or d.reason == C.RESTART_BLOCKED or (
        (d.action == Action.RESTARTED_IN_PLACE or C.is_true(conds, C.RESTARTING)) and not trains
        and d.action != Action.SUSPEND)
    if restarting:
        last = s.restarts[-1] if s.restarts else None
        msg = d.message if d.action in (Action.RESTART, Action.WAIT, Action.RESTARTED_IN_PLACE) or last is None \
            else (f"worker generation {last.generation} of attempt {attempt} restarted in place ({last.cause}: "
                  f"{last.message})" if last.mode == "InPlace" else
                  f"attempt {attempt} replaces attempt {last.attempt} ({last.cause}: {last.message})")
        cond(C.RESTARTING, "True", d.reason if d.action != Action.KEEP else C.RESTARTED, msg)
    else:
        cond(C.RESTARTING, "False", C.NOT_RESTARTING, "no restart in progress")
    if d.unschedulable:
        cond(C.UNSCHEDULABLE, "True", d.reason, d.message)
    else:
        cond(C.UNSCHEDULABLE, "False", C.PODS_SCHEDULED, "no pod waits longer than unschedulableTimeoutSeconds")
    _children_condition(spec, s, d, obs, cond)
    _metrics_condition(s, obs.progress, s.attempt != attempt, cond)
    _full_size_condition(spec, s, cond)
    _save_condition(spec, s, cond)


def _save_condition(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, cond: Any) -> None:
    """CheckpointSaveFailing from the trainer's failed-saves counts (kept as it is while none are reported: a new
    attempt's trainer not scraped yet, or one without the gauges); none for a run without checkpoints."""
    if not spec.checkpoint.enabled:
        s.conditions[:] = [c for c in s.conditions if c.type != C.CHECKPOINT_SAVE_FAILING]
        return
    now = C.checkpoint_save_failing(s.observation, spec.checkpoint.max_failed_saves)
    if now is not None:
        cond(C.CHECKPOINT_SAVE_FAILING, *now)


def _ready_condition(d: Decision, attempt: int, cond: Any) -> None:
    """Ready, the summary condition (a finished run's stays as it is)."""
    if d.action == Action.FINISHED:
        pass  # terminal conditions stay as they are
    elif d.ready:
        cond(C.READY, "True", C.TRAINING, d.message)
    elif d.reason == C.PROGRESS_UNKNOWN:
        cond(C.READY, "Unknown", C.PROGRESS_UNKNOWN, d.message)
    elif d.action == Action.RESTART:  # the failure itself is in Restarting and in the restart record
        cond(C.READY, "False", d.reason, f"attempt {attempt} ended ({d.cause}); attempt {attempt + 1} follows")
    else:
        cond(C.READY, "False", d.reason or C.WAITING_FOR_PODS, d.message)


def status_events(before: Mapping[str, Condition], conds: list[Condition], d: Decision, attempt: int,
                  obs: Observed, now: str) -> list[StatusEvent]:
    """The Events this status change carries: the decision's own (a restart, the end of the run) and the
    transitions into a refused edit (``SpecAccepted=False``), a blocked restart or failing checkpoint saves
    (``CheckpointSaveFailing=True``), each once."""
    out = []
    ev = restart_event(d, attempt, obs.spec_block)
    if ev is not None:
        out.append(StatusEvent(type=ev[0], reason=ev[1], message=ev[2], time=now))

    def entered(type_: str, status: str) -> Condition | None:
        c, old = C.find(conds, type_), before.get(type_)
        if c is None or c.status != status:
            return None
        return c if old is None or (old.status, old.reason, old.message) != (c.status, c.reason, c.message) else None

    if (c := entered(C.SPEC_ACCEPTED, "False")) is not None:
        out.append(StatusEvent(type="Warning", reason=c.reason, message=c.message, time=now))
    if (c := entered(C.RESTARTING, "True")) is not None and c.reason == C.RESTART_BLOCKED:
        out.append(StatusEvent(type="Warning", reason=C.RESTART_BLOCKED, message=c.message, time=now))
    failing, old = C.find(conds, C.CHECKPOINT_SAVE_FAILING), before.get(C.CHECKPOINT_SAVE_FAILING)
    if failing is not None and failing.status == "True" and (old is None or old.status != "True"):
        # one Event per episode (False -> True), not one per failed save: the condition's message counts them
        out.append(StatusEvent(type="Warning", reason=failing.reason, message=failing.message, time=now))
    return out


def _children_condition(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, d: Decision, obs: Observed,
                        cond: Any) -> None:
    """True once every pod of the (new) current attempt exists; else False with why (never an older attempt's)."""
    attempt = s.attempt if s.attempt is not None else 0
    same = attempt == (obs.observation.attempt if obs.observation is not None else attempt)
    nodes = s.nodes if s.nodes is not None else (
        obs.attempt_nodes if obs.attempt_nodes is not None and same else spec.resources.nodes)
    present = {p.rank for p in obs.pods if p.attempt == attempt and not p.deleting}
    if obs.child_errors and d.action == Action.CREATE:
        e = obs.child_errors[0]
        more = f" (+{len(obs.child_errors) - 1} more)" if len(obs.child_errors) > 1 else ""
        cond(C.CHILDREN_CREATED, "False", e.reason, f"{len(present)}/{nodes} pods of attempt {attempt} exist: "
             f"{e.account()}{more}; retrying with backoff")
    elif len(present) >= nodes:
        cond(C.CHILDREN_CREATED, "True", C.CHILDREN_OK, f"all {nodes} pods of attempt {attempt} exist")
    else:
        reason = C.CREATING if d.action in (Action.CREATE, Action.KEEP) else (d.reason or C.CREATING)
        cond(C.CHILDREN_CREATED, "False", reason, f"{len(present)}/{nodes} pods of attempt {attempt} exist")


def _full_size_condition(spec: LlamaPretrainSpec, s: LlamaPretrainStatus, cond: Any) -> None:
    """Elastic runs: whether the gang has ``maxNodes`` nodes (none for a run that is not elastic)."""
    if spec.run_policy.elastic is None:
        s.conditions[:] = [c for c in s.conditions if c.type != C.FULL_SIZE]
        return
    top = elastic_sizes(spec).stop - 1
    n = s.nodes if s.nodes is not None else spec.resources.nodes
    plan = s.observation.grow_to if s.observation is not None else None
    if n >= top:
        cond(C.FULL_SIZE, "True", C.AT_MAX_NODES, f"the gang has {n} nodes (runPolicy.elastic.maxNodes={top})")
    elif plan is not None:
        cond(C.FULL_SIZE, "False", C.GROW_PLANNED, f"the gang has {n} of {top} nodes; it grows to {plan} right after "
             "its next complete checkpoint")
    else:
        cond(C.FULL_SIZE, "False", C.SHRUNK, f"the gang has {n} of {top} nodes (runPolicy.elastic.maxNodes); it grows "
             "back once more nodes have been Ready and schedulable for runPolicy.elastic.growCheckSeconds")


def _metrics_condition(s: LlamaPretrainStatus, pr: Progress, new_attempt: bool, cond: Any) -> None:
    """From the decision's progress (what the observation says), or Unknown for an attempt that just began."""
    if not new_attempt and pr.metrics_available is False:
        reason = s.observation.metrics_error_reason if s.observation is not None else None
        cond(C.METRICS_AVAILABLE, "False", reason or C.SCRAPE_FAILED,
             f"{pr.metrics_error}; training progress is unknown ("
             + (f"last known step {pr.step}" if pr.step is not None else "no step seen yet") + "); this alone never "
             "restarts the run (see docs/operator.md, 'Metrics')")
    elif not new_attempt and pr.metrics_available is True:
        cond(C.METRICS_AVAILABLE, "True", C.SCRAPED, "rank 0's /metrics answers")
    else:
        cond(C.METRICS_AVAILABLE, "Unknown", C.NOT_SCRAPED,
             f"rank 0's /metrics of attempt {s.attempt or 0} has not been scraped yet")


def invalid_status(old: LlamaPretrainStatus, errors: list[Any], generation: int | None,
                   now: float, reason: str = C.INVALID_SPEC) -> LlamaPretrainStatus:
    """The status of an object whose spec does not validate: ``Ready=False`` and ``SpecAccepted=False``
    with reason ``InvalidSpec`` and what was wrong; reason ``PolicyViolation`` for a valid spec the admin
    policy refuses (kubetitan.policy)."""
    new = old.model_copy(deep=True)
    msg = "; ".join(map(str, errors)) or "the object cannot be parsed"
    C.set_condition(new.conditions, C.READY, "False", reason, msg, iso(now), generation)
    C.set_condition(new.conditions, C.SPEC_ACCEPTED, "False", reason, msg, iso(now), generation)
    new.observed_generation = generation
    new.phase = C.derive_phase(new.conditions)
    new.message = f"{'refused by the admin policy' if reason == C.POLICY_VIOLATION else 'invalid spec'}: {msg}"
    return new


def load(raw: Mapping[str, Any] | None) -> LlamaPretrainStatus:
    """The status as the API holds it (kopf's own keys dropped); unreadable parts are rebuilt."""
    try:
        return LlamaPretrainStatus.model_validate({k: v for k, v in (raw or {}).items() if k != "kopf"})
    except Exception:  # noqa: BLE001 - a status we cannot read is rebuilt from observation
        return LlamaPretrainStatus()


__all__ = ["invalid_status", "load", "next_status", "observed", "progress", "spec_gate", "status_events", "track",
           "training_status"]
