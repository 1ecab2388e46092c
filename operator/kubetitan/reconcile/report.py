"""Report: the status written once per cycle, the operator's metrics after it, and each Event once.

- :func:`status` writes the new status through the status subresource, only when it changed (a merge patch against
  what the server holds), then sets the run's metric series before anything else is awaited: whoever sees the
  status (or any effect after it: pods, Events) sees the same phase, restarts and training gauges.
- :func:`pending_events` sends the Events the status change carries (``status.pendingEvents``: written with the
  change, sent after the writes, cleared once sent), so an operator killed in between sends them when it resumes;
  each Event's name derives from the change, so one sent before a crash is found (409), never doubled.
- :func:`observation` and :func:`create_round` send the Events that are not status changes (spec warnings, refused
  scraped values, refused or repeated creates) once per change (``RunMemory.reported``); Events are aggregated
  like client-go's recorder (``kubetitan.events``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubetitan import conditions as C
from kubetitan import policy, scraped
from kubetitan import status as status_mod
from kubetitan_core import warning_rules
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan.decide import Action, Decision
from kubetitan.observation import ChildError
from kubetitan.timestamps import parse_time
from kubetitan.reconcile.apply import Created
from kubetitan.reconcile.context import Context
from kubetitan.reconcile.memory import RunMemory
from kubetitan.observation.snapshot import Snapshot

log = logging.getLogger("kubetitan.operator")


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 merge patch turning ``old`` into ``new`` (removed keys become None)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out: dict[str, Any] = {}
    for k in old.keys() - new.keys():
        out[k] = None
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_patch(old[k], v)
    return out


async def event(ctx: Context, body: Mapping[str, Any], type_: str, reason: str, message: str,
                known: bool = False) -> None:
    """A Kubernetes Event on the run, aggregated: a repeat counts on the same Event (``kubetitan.events``).
    ``known``: a state reported once per change (``Recorder.record``): not counted again after a restart."""
    await ctx.recorder.record(body, type_, reason, message, known=known)


async def status(ctx: Context, snap: Snapshot, memory: RunMemory, d: Decision, new: LlamaPretrainStatus) -> None:
    """Write ``new`` (only when it differs from what the server holds), then the run's metric series."""
    assert ctx.client is not None
    new_raw = new.dump()
    if dict(snap.status_raw) != new_raw:
        await ctx.client.patch_status(snap.namespace, snap.name, merge_patch(dict(snap.status_raw), new_raw))
    memory.written, memory.reread = new, None
    ns, name = snap.namespace, snap.name
    if d.action in (Action.RESTART, Action.RESTARTED_IN_PLACE) and d.cause:
        ctx.metrics.restarted(ns, name, d.cause, "InPlace" if d.action == Action.RESTARTED_IN_PLACE else "Recreate")
    ctx.metrics.set_phase(ns, name, new.phase, C.phase_reason(new.conditions, new.phase))
    ctx.metrics.set_training(ns, name, new.training, new.restart_count)


async def invalid(ctx: Context, snap: Snapshot, memory: RunMemory) -> None:
    """A spec refused outright (never started): ``Ready=False`` with the errors, one Warning Event per refusal."""
    errors, old = list(snap.errors), snap.status
    refused = bool(errors) and all(isinstance(e, policy.Violation) for e in errors)
    new = status_mod.invalid_status(old, errors, snap.generation, snap.now,
                                    C.POLICY_VIOLATION if refused else C.INVALID_SPEC)
    old_raw = old.dump() if snap.status_written else {}
    if new.dump() != old_raw:
        assert ctx.client is not None
        await ctx.client.patch_status(snap.namespace, snap.name, merge_patch(old_raw, new.dump()))
    memory.written = new
    ctx.metrics.set_phase(snap.namespace, snap.name, new.phase, C.phase_reason(new.conditions, new.phase))  # first
    if new.dump() != old_raw and new.message != old.message:  # one Warning Event per new refusal
        await event(ctx, snap.body, "Warning", C.POLICY_VIOLATION if refused else C.INVALID_SPEC, new.message or "",
                    known=True)


async def observation(ctx: Context, snap: Snapshot, memory: RunMemory) -> None:
    """The snapshot's own Warnings, once per change: the spec's warnings, and scraped values refused."""
    reported = memory.reported
    for rule, message in sorted(snap.warnings - reported.warned):
        await event(ctx, snap.body, "Warning", warning_rules.RULE_BY_ID[rule].reason, message, known=True)
    reported.warned = snap.warnings
    if snap.scrape.metrics is None:
        return  # no values were checked this cycle
    refused = list(snap.scrape.refused)
    for r in refused:
        ctx.metrics.values_refused.labels(r.metric, r.check).inc()
    sig = scraped.signature(refused)
    if sig != reported.refused_values and refused:
        log.warning("Refused scraped values of LlamaPretrain %s/%s: %s", snap.namespace, snap.name,
                    "; ".join(map(str, refused)))
        await event(ctx, snap.body, "Warning", C.METRICS_VALUE_REFUSED, scraped.summary(refused), known=True)
    reported.refused_values = sig


async def pending_events(ctx: Context, memory: RunMemory, snap: Snapshot) -> None:
    """Send the Events of the status change just written (``status.pendingEvents``), then clear them from the
    status; one the API refused stays pending for the next cycle."""
    assert memory.written is not None and ctx.client is not None
    written = memory.written
    left = [e for e in written.pending_events
            if not await ctx.recorder.send_once(snap.body, e.type, e.reason, e.message, e.time)]
    if len(left) != len(written.pending_events):
        await ctx.client.patch_status(snap.namespace, snap.name, {"pendingEvents": [e.dump() for e in left]})
        written.pending_events = left
        memory.written = written  # a rebuilt copy: store the change


async def create_round(ctx: Context, snap: Snapshot, memory: RunMemory, status: LlamaPretrainStatus,
                       outcome: Created) -> None:
    """What a create round tells: a refusal (one aggregated ``FailedCreate`` Warning), children
    created again while the attempt runs (``RecreatedChildren``), or a new attempt (the recovery-time metric)."""
    attempt, ns, name = outcome.attempt, snap.namespace, snap.name
    if outcome.errors:
        errors = list(outcome.errors)
        await event(ctx, snap.body, "Warning", "FailedCreate",
                    refusal_summary(errors, outcome.not_created, outcome.unsent, attempt))
        log.warning("Creating attempt %s of LlamaPretrain %s/%s: %d object(s) not created: %s", attempt, ns, name,
                    len(errors), errors[0].account())
        return
    if outcome.only is not None:
        await event(ctx, snap.body, "Normal", "RecreatedChildren", f"Created {', '.join(outcome.only)} again "
                    f"(deleted while attempt {attempt} runs); the pods go on")
        log.info("Recreated %s of LlamaPretrain %s/%s (deleted while attempt %s runs)", ", ".join(outcome.only), ns,
                 name, attempt)
        return
    if status.restarts and status.restarts[-1].attempt == attempt - 1 and memory.reported.recovered_attempt != attempt:
        t0 = parse_time(status.restarts[-1].time)
        if t0 is not None:
            ctx.metrics.recovery.observe(max(0.0, ctx.options.clock() - t0) / ctx.clock_rate())
        memory.reported.recovered_attempt = attempt
    if outcome.created_pods:
        log.info("Created attempt %s of LlamaPretrain %s/%s (%d pods)", attempt, ns, name, outcome.created_pods)


def refusal_summary(errors: list[ChildError], not_created: int, unsent: int, attempt: int) -> str:
    """One message for a refused create round: how many pods are not created, and the API's answer (the first
    refusal's; refusals of other kinds/reasons are counted). Stable across rounds that fail alike, so the
    aggregated ``FailedCreate`` Event counts them instead of piling up."""
    e = errors[0]
    kinds = sorted({f"{x.kind} {x.reason}" for x in errors[1:]} - {f"{e.kind} {e.reason}"})
    also = f" (also refused: {', '.join(kinds)})" if kinds else ""
    if e.kind == "Pod":
        held = f"; {unsent} more not sent this round (slow start stops at a refused batch)" if unsent else ""
        return (f"{not_created} pod(s) of attempt {attempt} are not created: {e.account(reason=True)}{also}{held}; "
                "retrying with backoff")
    return f"the pods of attempt {attempt} wait: {e.account(reason=True)}{also}; retrying with backoff"
