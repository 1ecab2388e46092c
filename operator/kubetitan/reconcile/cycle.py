"""One reconcile cycle of one run: observe -> decide -> report the status -> apply -> report the Events.

1. :func:`~kubetitan.observation.read.observe`: one read into an immutable snapshot (a spec refused outright
   stops here: ``Ready=False/InvalidSpec``, no children);
2. ``decide.decide`` (the pure policy) on ``snapshot.decision_inputs``, then ``status.next_status`` (the one status
   builder); a decision that finds the status stale re-reads it instead and acts on the next cycle;
3. :func:`~kubetitan.reconcile.report.status`: the status written once (only when it changed), then the metrics;
4. :func:`~kubetitan.reconcile.apply.act`: deletes, creates, the run's own deletion (idempotent, with
   expectations);
5. the Events: the create round's, then those the status change carries (exactly once, even across a crash).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubetitan import status as status_mod
from kubetitan.decide import Action, decide
from kubetitan.reconcile import apply, report
from kubetitan.reconcile.context import Context
from kubetitan.observation.read import observe, reread
from kubetitan.observation.snapshot import decision_inputs

log = logging.getLogger("kubetitan.operator")


@dataclass(frozen=True)
class Outcome:
    """What a cycle tells its daemon."""

    errors: list[Any] | None = None
    """The spec's errors when it is refused outright (None otherwise)."""
    requeue: float | None = None
    """Seconds until the next cycle is due at the latest (None: the scan interval)."""
    done: bool = False
    """The run is finished and nothing is left to delete or to time: its daemon may end."""


async def cycle(ctx: Context, body: Mapping[str, Any], pods_index: Any, *, pods_override: tuple[Any, ...] | None = None,
                nodes_index: Any = None, children_index: tuple[Any, Any] | None = None) -> Outcome:
    """One cycle of the run ``body`` (see the module's docstring); one at a time per run.

    ``pods_override``: the run's pods as just listed from the API (a new term), instead of the index;
    ``children_index``: the (``lpt_configmaps``, ``lpt_services``) indexes (None: no ConfigMap/Service is missing)."""
    started = time.perf_counter()
    meta = body["metadata"]
    memory = ctx.job(meta["uid"])
    try:
        async with memory.lock:
            if meta.get("deletionTimestamp"):
                return Outcome()
            ctx.metrics.cycles.labels(meta.get("namespace", "default"), meta["name"]).inc()
            snap = await observe(ctx, memory, body, pods_index=pods_index, nodes_index=nodes_index,
                                 children_index=children_index, pods_override=pods_override)
            if snap.invalid:
                await report.invalid(ctx, snap, memory)
                return Outcome(errors=list(snap.errors))
            await report.observation(ctx, snap, memory)
            obs = decision_inputs(snap, ctx.options.hang_floor_seconds, ctx.options.resize_min_interval_seconds)
            d = decide(snap.lpt.spec, snap.status, obs)
            if d.stale_status:  # another replica moved the run on while this one was paused: act later
                await reread(ctx, memory, snap)
                log.warning("Re-read the status of LlamaPretrain %s/%s: %s", snap.namespace, snap.name, d.message)
                return Outcome(requeue=0.0)
            new = status_mod.next_status(snap.lpt.spec, snap.status, d, obs)
            await report.status(ctx, snap, memory, d, new)
            requeue, created = await apply.act(ctx, snap, memory, d, new)
            if created is not None:
                await report.create_round(ctx, snap, memory, new, created)
            if new.pending_events:
                await report.pending_events(ctx, memory, snap)
            done = d.action == Action.FINISHED and not d.delete and not d.force_delete \
                and d.requeue_after is None and not d.delete_self
            if d.action in (Action.RESTART, Action.CONTINUE):
                requeue = 0.0  # the next attempt (or its backoff) is decided at once, not on the next pod event
            return Outcome(requeue=requeue, done=done)
    finally:
        ctx.metrics.reconcile.observe(time.perf_counter() - started)
