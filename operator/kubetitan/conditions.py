"""Conditions and the derived phase of a LlamaPretrain (pure: no kopf, no client, no clock).

Conditions follow the Kubernetes API conventions: a list keyed by ``type``; each has a status
(True/False/Unknown), a CamelCase reason (one of the constants below), a sentence message,
``lastTransitionTime`` (kept unless the status flips) and ``observedGeneration``.

``phase`` is for display only (the printer column); it is derived from the conditions by
:func:`derive_phase` and no decision ever reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kubetitan_core import warning_rules
from kubetitan_core.api import AttemptObservation, Condition, LlamaPretrainSpec, Phase

# ------------------------------------------------------------------ condition types
READY = "Ready"
"""Summary: True while every pod of the current attempt runs and rank 0's newest scrape answered with a step of
it (training seen now); Unknown (reason ``ProgressUnknown``) while the pods run but rank 0's /metrics does not
answer; False otherwise (the reason says what the run waits for)."""
SUSPENDED = "Suspended"
"""True while ``runPolicy.suspend`` holds the run stopped."""
RESTARTING = "Restarting"
"""True from a gang failure until the next attempt's pods exist and train; reason ``RestartBlocked`` while the
next attempt cannot start (a spec change it must not pick up)."""
UNSCHEDULABLE = "Unschedulable"
"""True once an attempt has waited longer than ``unschedulableTimeoutSeconds`` for its pods."""
SPEC_ACCEPTED = "SpecAccepted"
"""False when the spec is invalid or a change cannot be applied to a running run."""
SUCCEEDED = "Succeeded"
"""Terminal: training reached ``spec.training.steps``."""
FAILED = "Failed"
"""Terminal: the run gave up (see the reason)."""

METRICS_AVAILABLE = "MetricsAvailable"
"""Whether rank 0's /metrics answers the operator (Unknown before the first scrape). False never restarts a
run: it only means progress is not known."""
CHILDREN_CREATED = "ChildrenCreated"
"""True when every pod of the current attempt exists; False while some do not (the reason says why: being
created, the API refused one, backoff, a blocked restart)."""

CHECKPOINTS_DURABLE = "CheckpointsDurable"
"""Whether the checkpoints outlive the pods (a volume holds them): False warns of a single-node run that saves into
the pod's own filesystem (warning rule ``checkpoint.no-volume``, also a Warning Event), or of checkpoints turned off.
Computed from the spec alone (:func:`checkpoints_durable`)."""

FULL_SIZE = "FullSize"
"""Elastic runs only (``runPolicy.elastic``): True while the gang has ``maxNodes`` nodes; False while it is smaller
(reason ``Shrunk``, or ``GrowPlanned`` once it waits for its next checkpoint to grow)."""

CHECKPOINT_SAVE_FAILING = "CheckpointSaveFailing"
"""True while checkpoint saves fail in a row with a storage error (rank 0's ``storage.SaveBudget`` counts): training
goes on and saves again at the next interval, and the message says how many failed, the last one's step and error,
and how many more end the attempt (``spec.checkpoint.maxFailedSaves``); False once a save completes (or while none
has failed). Absent until the trainer reports its counts, and for runs without checkpoints. One Warning Event per
False -> True (:func:`kubetitan.status.status_events`). Computed by :func:`checkpoint_save_failing`."""

ALL_TYPES = (READY, SPEC_ACCEPTED, SUSPENDED, RESTARTING, UNSCHEDULABLE, CHILDREN_CREATED, METRICS_AVAILABLE,
             CHECKPOINTS_DURABLE, CHECKPOINT_SAVE_FAILING, FULL_SIZE, SUCCEEDED, FAILED)

# ------------------------------------------------------------------ reasons
INVALID_SPEC = "InvalidSpec"
POLICY_VIOLATION = "PolicyViolation"
"""A valid spec the cluster admin's policy refuses (kubetitan.policy): no child is created."""
SPEC_APPLIED = "Applied"
DEFERRED_TO_NEXT_ATTEMPT = "DeferredToNextAttempt"
IMMUTABLE_FIELD_CHANGED = "ImmutableFieldChanged"
WORLD_SIZE_CHANGE_REFUSED = "WorldSizeChangeRefused"
"""A running run's spec edit that changes the data-parallel degree while its data cannot resume at another one
(hub-streamed data: ``kubetitan_core.contract.resumes_at_another_dp_degree``, ``kubetitan.plan.world_size_edit``);
on shards or synthetic data such an edit is deferred to the next attempt instead."""
RESTART_BLOCKED = "RestartBlocked"
"""The next attempt cannot start: the spec holds a change it must not pick up (``SpecAccepted`` says which)."""
PROGRESS_UNKNOWN = "ProgressUnknown"
"""Every pod of the attempt runs, but rank 0's /metrics does not answer: whether it trains is not known (a step was
seen before, or the pods have run longer than ``startupTimeoutSeconds`` without /metrics ever answering)."""
METRICS_UNAVAILABLE = "MetricsUnavailable"
"""Every pod of the attempt runs and no step was seen yet, because rank 0's /metrics does not answer (the workers may
still be starting: within ``startupTimeoutSeconds`` of the last pod starting)."""
WAITING_FOR_NODES = "WaitingForNodes"
"""Pods of the attempt exist but cannot be scheduled yet (within ``unschedulableTimeoutSeconds``)."""
RESIZING = "Resizing"
"""An elastic run ends its attempt to re-create the gang at another size (restart cause ``Shrink`` or ``Grow``)."""
WAITING_FOR_REPLACEMENT = "WaitingForReplacement"
"""An elastic run lost a node (or cannot place a pod) and waits ``shrinkAfterSeconds`` for a replacement."""
AT_MAX_NODES = "AtMaxNodes"
SHRUNK = "Shrunk"
GROW_PLANNED = "GrowPlanned"
CREATING = "Creating"
WAITING_FOR_PODS = "WaitingForPods"
WAITING_FOR_FIRST_STEP = "WaitingForFirstStep"
TRAINING = "Training"
BACKOFF = "BackOff"
RESTARTED = "Restarted"
RESTARTED_IN_PLACE = "RestartedInPlace"
NOT_RESTARTING = "NotRestarting"
SUSPENDING = "Suspending"
SUSPENDED_BY_USER = "SuspendedByUser"
NOT_SUSPENDED = "NotSuspended"
PODS_UNSCHEDULABLE = "PodsUnschedulable"
PODS_SCHEDULED = "PodsScheduled"
COMPLETED = "Completed"
STEPS_RAISED = "StepsRaised"
"""The attempt trained to its own step count, but spec.training.steps was raised: the next attempt goes on."""
DEADLINE_EXCEEDED = "DeadlineExceeded"
IMAGE_PULL_FAILED = "ImagePullFailed"
CONFIG_ERROR = "ConfigError"
MAX_RESTARTS_EXCEEDED = "MaxRestartsExceeded"
NO_PROGRESS = "RestartsWithoutProgress"
UNSCHEDULABLE_TIMEOUT = "UnschedulableTimeout"
TRAINER_SUCCEEDED_EARLY = "TrainerSucceeded"
NOT_FINISHED = "NotFinished"
STALE_STATUS = "StaleStatus"
PODS_NOT_STARTED = "PodsNotStarted"
STORAGE_FULL = "StorageFull"
NETWORK_NOT_EFA = "NetworkNotEFA"
SCRAPED = "Scraped"
SCRAPE_FAILED = "ScrapeFailed"
"""rank 0's /metrics refused the connection, answered an HTTP error, or an older attempt's process answered."""
METRICS_TOO_LARGE = "MetricsTooLarge"
"""The body (or its declared Content-Length) passed ``--scrape-max-bytes``: the operator stopped reading it."""
METRICS_TIMEOUT = "MetricsTimeout"
"""The scrape did not finish within ``--scrape-timeout`` (a slow or never-ending body, or no answer)."""
METRICS_MALFORMED = "MetricsMalformed"
"""The body is not UTF-8 Prometheus text exposition."""
METRICS_VALUE_REFUSED = "MetricsValueRefused"
"""Event reason: scraped values that broke a rule of ``kubetitan.scraped.RULES`` were not stored."""
NOT_SCRAPED = "NotScrapedYet"
CHILDREN_OK = "Created"
FORBIDDEN = "Forbidden"
INVALID = "Invalid"
NAME_CONFLICT = "NameConflict"
API_UNAVAILABLE = "APIUnavailable"
API_TIMEOUT = "APITimeout"
"""A create the API did not answer within the client's timeout, on every attempt (a slow admission webhook, an
overloaded API server): not a refusal; it may even have been stored (the next cycle finds the pod)."""
CHECKPOINT_VOLUME = "CheckpointVolume"
CHECKPOINT_OBJECT_STORE = "CheckpointObjectStore"
"""``CheckpointsDurable=True`` for checkpoints in S3 (``checkpoint.storage.s3``): no volume, and none needed."""
CHECKPOINTS_DISABLED = "CheckpointsDisabled"
NO_CHECKPOINT_VOLUME = warning_rules.RULE_BY_ID["checkpoint.no-volume"].reason
"""``NoCheckpointVolume``: the warning rule's own reason (its Event has the same)."""
CHECKPOINT_SAVE_FAILED = "CheckpointSaveFailed"
"""``CheckpointSaveFailing=True`` (and its Warning Event): the newest checkpoint saves failed with a storage error."""
CHECKPOINT_SAVED = "CheckpointSaved"
"""``CheckpointSaveFailing=False``: no save has failed since the last complete one."""


def find(conditions: Sequence[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Sequence[Condition], type_: str) -> bool:
    c = find(conditions, type_)
    return c is not None and c.status == "True"


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
) -> bool:
    """Set one condition in place; return whether anything changed.

    ``lastTransitionTime`` moves only when ``status`` flips (JobSet's ``updateCondition``);
    a new reason or message alone keeps it.
    """
    new = Condition(
        type=type_, status=status, reason=reason, message=message,
        last_transition_time=now, observed_generation=generation,
    )
    for i, old in enumerate(conditions):
        if old.type != type_:
            continue
        if old.status == status:
            new.last_transition_time = old.last_transition_time or now
        if old == new:
            return False
        conditions[i] = new
        return True
    conditions.append(new)
    return True


def checkpoints_durable(spec: LlamaPretrainSpec) -> tuple[str, str, str]:
    """(status, reason, message) of the ``CheckpointsDurable`` condition: a pure function of the spec."""
    ck = spec.checkpoint
    if not ck.enabled:
        return "False", CHECKPOINTS_DISABLED, "checkpoint.enabled is false: nothing is saved, a failure ends the run"
    if (warned := warning_rules.no_checkpoint_volume(spec)) is not None:
        return "False", NO_CHECKPOINT_VOLUME, warned
    if ck.storage.s3 is not None:
        return "True", CHECKPOINT_OBJECT_STORE, f"checkpoints are saved to {ck.storage.s3.uri}"
    if ck.storage.persistent_volume_claim is not None:
        return "True", CHECKPOINT_VOLUME, (f"checkpoints are saved to PersistentVolumeClaim "
                                           f"{ck.storage.persistent_volume_claim.claim_name}")
    return "True", CHECKPOINT_VOLUME, (f"checkpoints are saved to hostPath {ck.storage.host_path} of the node "
                                       "(kept while the run stays on that node)")


def checkpoint_save_failing(o: AttemptObservation | None, spec_budget: int) -> tuple[str, str, str] | None:
    """(status, reason, message) of ``CheckpointSaveFailing`` from the observed failed-saves counts; None while the
    trainer has reported none (the condition stays as it is). ``spec_budget``: the spec's maxFailedSaves, used when
    the trainer did not report its own (an attempt created before an edit runs with the budget it was created
    with, which the trainer reports)."""
    if o is None or o.saves_failed_in_a_row is None:
        return None
    n, budget = o.saves_failed_in_a_row, o.max_failed_saves or spec_budget
    total = o.saves_failed or 0
    if n <= 0:
        if total:
            return "False", CHECKPOINT_SAVED, (f"a checkpoint save completed after the failed ones ({total} failed "
                                               f"in this worker generation)")
        return "False", CHECKPOINT_SAVED, "no checkpoint save has failed"
    where = f"step {o.last_failed_save_step}" if o.last_failed_save_step is not None else "an unreported step"
    error = f" ({o.last_save_error})" if o.last_save_error else ""
    left = budget - n
    then = (f"{left} more in a row end the attempt with exit code 6 (spec.checkpoint.maxFailedSaves={budget}); "
            "training goes on and saves again at the next interval") if left > 0 else (
        f"that is spec.checkpoint.maxFailedSaves={budget}: the attempt ends with exit code 6 and the run resumes "
        "from the newest complete checkpoint")
    return "True", CHECKPOINT_SAVE_FAILED, (f"{n} checkpoint save(s) in a row failed, the last at {where}{error}; "
                                            f"{then}. Check that the checkpoint storage is reachable from the pods "
                                            "and accepts writes (space, credentials)")


def phase_reason(conditions: Sequence[Condition], phase: str | None) -> str:
    """The reason that goes with the displayed phase (the operator's ``kubetitan_operator_job_phase_info``): the
    terminal condition's reason for Succeeded/Failed (``StorageFull``, ``NetworkNotEFA``, ...), otherwise Ready's
    (``Training``, ``PodsUnschedulable``, ``BackOff``, ``InvalidSpec``, ...); empty when there is none yet."""
    c = find(conditions, phase) if phase in (SUCCEEDED, FAILED) else find(conditions, READY)
    return c.reason if c is not None else ""


WAITING_FOR_NODE_REASONS = (WAITING_FOR_NODES, WAITING_FOR_REPLACEMENT, PODS_UNSCHEDULABLE)
"""Ready reasons of an attempt whose pods exist but some wait for a node (unscheduled, or on a node that is gone):
the phase is ``Pending``, not ``Starting``."""


def _has(conditions: Sequence[Condition], type_: str, status: str, reason: str | None = None) -> bool:
    c = find(conditions, type_)
    return c is not None and c.status == status and (reason is None or c.reason == reason)


PHASE_RULES: tuple[tuple[Phase, Callable[[Sequence[Condition]], bool]], ...] = (
    ("Succeeded", lambda cs: is_true(cs, SUCCEEDED)),
    ("Failed", lambda cs: is_true(cs, FAILED)),
    ("Suspended", lambda cs: is_true(cs, SUSPENDED)),
    ("Blocked", lambda cs: _has(cs, RESTARTING, "True", RESTART_BLOCKED)),
    ("Restarting", lambda cs: is_true(cs, RESTARTING)),
    ("Running", lambda cs: is_true(cs, READY) or _has(cs, READY, "Unknown", PROGRESS_UNKNOWN)),
    ("Pending", lambda cs: any(_has(cs, READY, "False", r) for r in WAITING_FOR_NODE_REASONS)),
    ("Starting", lambda cs: is_true(cs, CHILDREN_CREATED)),
    ("Pending", lambda cs: True),
)
"""The one rule from conditions to the displayed phase: the first row that holds wins. ``Running`` also while the
pods run and only the progress is unknown (``Ready=Unknown``); ``Pending`` while pods wait for nodes, even though
they all exist; ``Starting`` only once every pod of the attempt exists and none waits for a node."""


def derive_phase(conditions: Sequence[Condition]) -> Phase:
    """The displayed phase (:data:`PHASE_RULES`)."""
    return next(phase for phase, holds in PHASE_RULES if holds(conditions))


_COUNTER = re.compile(r"\b(?:for|in|after) \d+(?:\.\d+)?s\b|\b\d+(?:\.\d+)?s more\b")
"""A running counter in a message ("for 136s", "in 7s", "40s more"): times belong in lastTransitionTime."""


def contradictions(phase: str | None, conditions: Sequence[Condition], attempt: int | None = None) -> list[str]:
    """Every rule of "status tells one story" that ``phase`` + ``conditions`` break (empty: consistent).

    The rules: the phase is the one :func:`derive_phase` gives; a finished run neither trains nor restarts;
    Ready=True only with the pods all there, metrics answering, no restart, no suspension and nothing
    unschedulable; ChildrenCreated speaks of the current attempt; no condition message carries a running counter.
    """
    out = []
    want = derive_phase(conditions)
    if phase != want:
        out.append(f"phase {phase} but the conditions give {want}")
    if is_true(conditions, SUCCEEDED) and is_true(conditions, FAILED):
        out.append("Succeeded and Failed are both True")
    if is_true(conditions, SUCCEEDED) or is_true(conditions, FAILED):
        for t in (READY, RESTARTING):
            if is_true(conditions, t):
                out.append(f"a finished run has {t}=True")
    if is_true(conditions, READY):
        for t, st in ((RESTARTING, "True"), (SUSPENDED, "True"), (UNSCHEDULABLE, "True"), (CHILDREN_CREATED, "False"),
                      (CHILDREN_CREATED, "Unknown"), (METRICS_AVAILABLE, "False"), (METRICS_AVAILABLE, "Unknown")):
            if _has(conditions, t, st):
                out.append(f"Ready=True next to {t}={st}")
    cc = find(conditions, CHILDREN_CREATED)
    if cc is not None and attempt is not None and f"attempt {attempt}" not in cc.message:
        out.append(f"ChildrenCreated speaks of another attempt than {attempt}: {cc.message!r}")
    for c in conditions:  # (Restarting/Failed quote the failure as recorded once, e.g. "no step progress for 40s")
        if c.type not in (RESTARTING, FAILED, SUCCEEDED) and _COUNTER.search(c.message):
            out.append(f"{c.type}'s message has a running counter: {c.message!r}")
    return out
