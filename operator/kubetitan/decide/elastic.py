"""The elastic policy (``runPolicy.elastic``): shrink the gang when a node is lost and no replacement comes within
``shrinkAfterSeconds``; grow it, right after a complete checkpoint, once more nodes have been Ready for
``growCheckSeconds``; never mid-save, never past ``maxResizes`` or the operator's resize interval."""

from __future__ import annotations

from kubetitan import conditions as C
from kubetitan_core.api import RestartCause, elastic_sizes
from kubetitan_core import hang
from kubetitan_core.causes import RESIZE_CAUSES
from kubetitan.observation import PodObs
from kubetitan.timestamps import iso, parse_time
from kubetitan.decide.core import Action, Decision, Facts, all_running, node_failed
from kubetitan.decide.failure import classify_pod


def _resize_blocked(f: Facts) -> str | None:
    """Why no resize may start now (the budget, the admin's interval), or None."""
    e = f.rp.elastic
    assert e is not None
    if f.status.resize_count >= e.max_resizes:
        return f"runPolicy.elastic.maxResizes={e.max_resizes} resizes are used up"
    last = next((r for r in reversed(f.status.restarts) if r.cause in RESIZE_CAUSES), None)
    at = parse_time(last.time) if last is not None else None
    cap = f.obs.resize_min_interval_seconds
    if at is not None and f.now - at < cap:
        return f"the last resize was at {iso(at)} and the operator allows one per {cap:g}s " \
               "(--resize-min-interval-seconds)"
    return None


def _saving(f: Facts) -> bool:
    """A checkpoint save is in progress: the step is a checkpoint step newer than the newest complete checkpoint, and
    the step stood still for less than ``checkpoint.saveTimeoutSeconds`` (a save that outlived it is not one)."""
    pr, ck = f.obs.progress, f.spec.checkpoint
    if pr.step is None or not ck.enabled:
        return False
    last_step = min(f.spec.training.steps, f.obs.attempt_steps or f.spec.training.steps)
    if not hang.save_window(pr.step, last_step, ck.enabled, ck.interval_steps):
        return False
    if pr.last_checkpoint_step is not None and pr.last_checkpoint_step >= pr.step:
        return False
    since = pr.last_progress_time if pr.last_progress_time is not None else f.now
    return f.now - since < ck.save_timeout_seconds


def _resize(f: Facts, cause: RestartCause, to: int, message: str, force: tuple[str, ...] = ()) -> Decision:
    """End the attempt to re-create it at ``to`` nodes (a restart with its own budget, ``elastic.maxResizes``)."""
    end = tuple(p.name for p in f.current if not p.deleting and p.name not in force)
    return Decision(Action.RESTART, C.RESIZING, message, cause=cause, delete=end, force_delete=force, nodes=to)


def shrink(f: Facts) -> Decision | None:
    """Elastic: a node of the attempt is lost (NotReady or missing) or a pod of it is not placed, and the schedulable
    nodes cannot make up the gang. Wait ``shrinkAfterSeconds`` for a replacement (from when the node was lost or the
    pod created), then end the attempt (cause Shrink) and re-create it at the largest size the nodes fit, never below
    ``minNodes``. With a replacement schedulable, a shrink left in the budget or a shrink not allowed (below
    ``minNodes``, ``maxResizes``, the admin's interval, a save in progress), the ordinary rules decide (NodeFailure
    at the same size, Unschedulable)."""
    e, cap = f.rp.elastic, f.obs.capacity
    if e is None or cap is None or not f.current:
        return None
    lost: list[tuple[PodObs, float]] = []
    for p in f.current:
        n = f.obs.nodes.get(p.node_name) if p.node_name else None
        if node_failed(n) and p.phase not in ("Succeeded", "Failed"):
            assert n is not None
            lost.append((p, n.not_ready_since if n.not_ready_since is not None else f.now))
        elif p.node_name is None and p.phase == "Pending" and not p.deleting:
            lost.append((p, p.created if p.created is not None else f.now))
    if not lost:
        return None
    on_lost = {p.name for p, _ in lost}
    if any(classify_pod(p) is not None for p in f.current if p.name not in on_lost):
        return None  # another failure: pod_failed restarts at the same size
    size = f.nodes
    target = min(cap.schedulable, elastic_sizes(f.spec).stop - 1)
    if target >= size or target < e.min_nodes or _resize_blocked(f) is not None:
        return None
    since = min(t for _, t in lost)
    left = since + e.shrink_after_seconds - f.now
    first = lost[0][0]
    what = f"node {first.node_name} of pod {first.name} is lost" if first.node_name else \
        f"pod {first.name} (rank {first.rank}) cannot be placed"
    what += f" (+{len(lost) - 1} more)" if len(lost) > 1 else ""
    if _saving(f):  # never a resize mid-save: wait for it (or for checkpoint.saveTimeoutSeconds) before anything else
        pr = f.obs.progress
        wait = (pr.last_progress_time or f.now) + f.spec.checkpoint.save_timeout_seconds - f.now
        return Decision(Action.WAIT, C.WAITING_FOR_REPLACEMENT, f"{what} while the checkpoint of step {pr.step} is "
                        "being saved; the gang shrinks only after the save (at most checkpoint.saveTimeoutSeconds) "
                        "and runPolicy.elastic.shrinkAfterSeconds", requeue_after=max(0.05, wait))
    if left > 0:
        return Decision(Action.WAIT, C.WAITING_FOR_REPLACEMENT, f"{what} and only {cap.schedulable} node(s) fit the "
                        f"gang of {size}; shrinking to {target} at {iso(f.now + left)} unless a replacement comes "
                        "(runPolicy.elastic.shrinkAfterSeconds)", requeue_after=left)
    force = tuple(p.name for p, _ in lost if p.node_name and not p.deleting)
    return _resize(f, "Shrink", target, f"{what}; no replacement within runPolicy.elastic.shrinkAfterSeconds="
                   f"{e.shrink_after_seconds}: shrinking the gang from {size} to {target} nodes (the global batch is "
                   "kept by gradient accumulation)", force)


def grow(f: Facts) -> Decision | None:
    """Elastic: the gang trains below ``maxNodes`` and more nodes have been Ready and schedulable for
    ``growCheckSeconds``: plan a grow; once a complete checkpoint newer than the plan exists and no save is in
    progress, end the attempt (cause Grow; its pods save again on SIGTERM) and re-create it larger."""
    e, cap, pr = f.rp.elastic, f.obs.capacity, f.obs.progress
    if e is None or cap is None or not all_running(f) or pr.step is None:
        return None
    size = f.nodes
    target = min(cap.stable, elastic_sizes(f.spec).stop - 1)
    o = f.obs.observation
    planned = o.grow_to if o is not None else None
    if target <= size or _resize_blocked(f) is not None:
        if planned is not None:
            return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training; the planned grow to "
                            f"{planned} nodes is called off ({_resize_blocked(f) or f'{cap.stable} node(s) fit'})",
                            ready=True, cancel_grow=True)
        return None
    after = o.grow_after_step if o is not None and o.grow_after_step is not None else None
    if planned is None or after is None:
        ck = pr.last_checkpoint_step if pr.last_checkpoint_step is not None else -1
        return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training on {size} nodes; {target} nodes have "
                        f"been Ready and schedulable for runPolicy.elastic.growCheckSeconds={e.grow_check_seconds}: "
                        f"it grows to {target} right after its next complete checkpoint", ready=True,
                        grow_plan=(target, ck))
    done = pr.last_checkpoint_step is not None and pr.last_checkpoint_step > after
    if not done or _saving(f):
        return Decision(Action.KEEP, C.TRAINING, f"attempt {f.attempt} is training on {size} nodes; grows to "
                        f"{target} right after its next complete checkpoint (newer than step {after})", ready=True)
    return _resize(f, "Grow", target, f"{target} nodes have been Ready and schedulable for "
                   f"runPolicy.elastic.growCheckSeconds={e.grow_check_seconds} and checkpoint step "
                   f"{pr.last_checkpoint_step} is complete: growing the gang from {size} to {target} nodes")
