"""Apply: the decision's writes, idempotent and remembered as expectations.

- deletes: the pods the decision lists (graceful, or forced for a pod on a lost node); a DELETE sent moments ago is
  not sent again while the index still shows the pod (``Expectations.to_delete``);
- creates: every child of the current attempt that is not known to exist (:func:`create_attempt`), sent by
  :func:`create_children` (the one fan-out: ConfigMap, Service and PodGroup, then the pods in slow-start batches);
  ``AlreadyExists`` is success, and children created moments ago count as existing (``Expectations``);
- the PodGroups of ended attempts (``Decision.delete_pod_groups``), each deleted once;
- the run itself, deleted when its TTL after finishing has passed.

A live attempt's pods are rendered only from the spec the attempt was created from (the ConfigMap's
``applied-spec.json``): an edit never changes or adds to a running gang.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubetitan_core import validation
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan import fanout, plan
from kubetitan.decide import Action, Decision
from kubetitan.observation import ChildError
from kubetitan.timestamps import parse_time
from kubetitan.kube import RETRY_WAIT, Client, classify, message_of
from kubetitan.reconcile.context import APPLIED_SPEC_KEY, LEGACY_ANNOTATION_APPLIED_SPEC, Context
from kubetitan.reconcile.memory import RunMemory
from kubetitan.observation.snapshot import Snapshot

log = logging.getLogger("kubetitan.operator")


@dataclass(frozen=True)
class Round:
    """What one :func:`create_children` call did."""

    created: tuple[str, ...]
    """Names the API created or already had (ours), in the order sent."""
    errors: tuple[ChildError, ...]
    """The objects the API refused (or that a transport error lost)."""
    unsent: int
    """Pods not sent because a batch before them was refused."""


@dataclass(frozen=True)
class Created:
    """A create round of an attempt, as the report needs it."""

    attempt: int
    errors: tuple[ChildError, ...] = ()
    not_created: int = 0
    """Pods of the round that are not created (refused, or not sent)."""
    unsent: int = 0
    created_pods: int = 0
    only: tuple[str, ...] | None = None
    """The ConfigMap/Service names created again while the attempt runs (None: the attempt's children)."""
    delay: float | None = None
    """Seconds before the next round after a refusal (the backoff), else None."""


async def act(ctx: Context, snap: Snapshot, memory: RunMemory, d: Decision, new: LlamaPretrainStatus
              ) -> tuple[float | None, Created | None]:
    """Carry out ``d`` (after ``new`` was written): deletes, then creates, then the run's own deletion. Returns the
    requeue delay and the create round (None when none was sent)."""
    client = ctx.client
    assert client is not None
    ns, exp = snap.namespace, memory.expected
    deletes = [client.delete_pod(ns, n) for n in exp.to_delete(d.delete, d.force_delete, None)]
    deletes += [client.delete_pod(ns, n, grace_seconds=0) for n in exp.to_delete(d.force_delete, (), 0)]
    deletes += [_delete_pod_group(client, memory, ns, n) for n in exp.pod_groups_to_delete(d.delete_pod_groups)]
    if deletes:
        await fanout.gather(*deletes)
    requeue, created = d.requeue_after, None
    if d.action == Action.CREATE or d.recreate:
        # a refused create is retried after its backoff, however often the run is woken meanwhile
        retry: float | None = memory.refusals.backoff_left()
        if retry is not None and retry <= 0:
            created = await create_attempt(ctx, snap, memory, new, d.avoid_nodes) if d.action == Action.CREATE \
                else await create_attempt(ctx, snap, memory, new, (), only=d.recreate)
            retry = created.delay
        if retry is not None:
            requeue = retry if requeue is None else min(requeue, retry)
    elif memory.refusals.errors and memory.refusals.attempt != new.attempt:
        memory.refusals.errors = ()
    if d.delete_self:
        await client.delete_run(ns, snap.name)
    return requeue, created


async def create_attempt(ctx: Context, snap: Snapshot, memory: RunMemory, status: LlamaPretrainStatus,
                         avoid: tuple[str, ...], only: tuple[str, ...] | None = None) -> Created:
    """Create every child of the current attempt that is not known to exist; existing ones (ours) count as created.

    Known to exist: the attempt's pods the index shows and the ConfigMap/Service their indexes show (the ConfigMap
    is still written once per attempt: it carries the attempt's spec), and children created moments ago
    (``Expectations``), so the cycles woken by their own watch events send nothing.

    When some pod of the attempt exists already, every child is rendered from the spec the attempt was created
    from, never from a newer spec: a missing rank of a live gang gets the gang's own ``--nnodes`` and config hash,
    and an edit waits for the next attempt. ``only``: create just these ConfigMap/Service names (deleted by hand
    while the attempt goes on), the same way.

    A refused round becomes ``ChildrenCreated=False`` on the next cycle and one aggregated Warning Event
    ``FailedCreate``; it is retried after a capped, jittered backoff (``Created.delay``). Never a restart: a child
    that was never seen is simply created again.
    """
    assert ctx.client is not None
    attempt, exp = status.attempt or 0, memory.expected
    exp.creating(attempt)
    mono = exp.now()
    started = only is None and bool(snap.current)
    present = ({p.name for p in snap.current} | set(snap.children_shown or ())) if only is None else set()
    lpt, spec_of_attempt = _spec_of_attempt(snap, memory, only is not None or started)
    needed = _needed(memory, plan.config_map_name(snap.name), present, only, mono)
    # Only the pods to send are rendered: a cycle woken while the pod index lags behind the gang it just created
    # finds every pod in flight and renders none (rendering 1,024 pods took ~0.2 s).
    ranks = set() if only is not None else \
        {r for r, name in enumerate(plan.attempt_pod_names(lpt, attempt, status.nodes)) if needed(name)}
    groups = bool(ranks) and await _in_pod_group(ctx, snap, lpt, started)
    children = plan.attempt_children(lpt, attempt, job_start_time=parse_time(status.start_time), avoid_nodes=avoid,
                                     hang_floor_seconds=ctx.options.hang_floor_seconds, nodes=status.nodes,
                                     ranks=ranks, pod_groups=groups, prepared=True)
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    cm["data"][APPLIED_SPEC_KEY] = json.dumps(spec_of_attempt, sort_keys=True, separators=(",", ":"))
    pods = [c for c in children if c["kind"] == "Pod"]
    # the PodGroup goes with every round that sends pods (unless created moments ago): created before them, and
    # created again if it was deleted while the attempt goes on (a pod naming a missing PodGroup is never scheduled)
    objects = [c for c in children
               if c["kind"] in ("ConfigMap", "Service", "PodGroup") and needed(c["metadata"]["name"])]
    done = await create_children(ctx.client, objects + pods)
    if any(e.kind == "PodGroup" for e in done.errors):
        ctx.pod_group_api.forget()  # refused (404: no longer served?): ask the server again before the next round
    # Stamped when the round ends: the index lags behind these creates from then on, and a 1,024-pod round can take
    # longer than the expectations' lifetime (stamped at its start, the next cycle sent pods again: 409s).
    exp.expect_created(done.created, exp.now())
    if cm["metadata"]["name"] in done.created:
        memory.applied_spec, memory.applied_loaded = spec_of_attempt, True
    memory.refusals.attempt, memory.refusals.errors, memory.refusals.namespace = attempt, done.errors, snap.namespace
    made = len({p["metadata"]["name"] for p in pods} & set(done.created))
    if done.errors:
        return Created(attempt, done.errors, not_created=len(pods) - made, unsent=done.unsent,
                       delay=memory.refusals.refused())
    memory.refusals.succeeded()
    if only is not None:
        exp.recreated(only, mono)  # shown gone; now created again: not "missing" until the index has shown it
    return Created(attempt, created_pods=made, only=only)


async def _in_pod_group(ctx: Context, snap: Snapshot, lpt: Any, started: bool) -> bool:
    """Whether the attempt's pods name a PodGroup: as its pods already do once the attempt has started (a rank
    created again joins the gang it belongs to, whatever the server or the spec say now), else
    ``plan.uses_pod_group`` with the server's answer (``discovery``; asked only when ``--pod-groups`` and the spec
    allow a PodGroup)."""
    if started:
        return any(p.pod_group for p in snap.current)
    return ctx.options.pod_groups == "auto" and plan.uses_pod_group(lpt.spec, True) and \
        await ctx.pod_group_api.check(ctx.client)


async def _delete_pod_group(client: Client, memory: RunMemory, ns: str, name: str) -> None:
    """Delete an ended attempt's PodGroup; a refusal is logged and the next cycle tries again (it never holds up
    the run: the PodGroup goes with the run anyway, through its owner reference)."""
    try:
        await client.delete_pod_group(ns, name)
    except (ApiException, *aiohttp_errors()) as e:
        log.warning("Deleting PodGroup %s/%s of an ended attempt failed (the next cycle tries again): %s", ns, name,
                    message_of(e))
        return
    memory.expected.pod_group_deleted(name)


def _needed(memory: RunMemory, config_map: str, present: set[str], only: tuple[str, ...] | None,
            now: float) -> Callable[[str], bool]:
    """Whether a child of the attempt is to be sent (see ``create_attempt``)."""
    exp = memory.expected

    def needed(name: str) -> bool:
        if only is not None:
            return name in only
        if name == config_map and not exp.ever_created(name):
            return True  # shared by every attempt: written once per attempt (its applied spec)
        return name not in present and not exp.in_flight(name, now)

    return needed


def _spec_of_attempt(snap: Snapshot, memory: RunMemory, live: bool) -> tuple[Any, Any]:
    """The LlamaPretrain to render and its spec in wire form: the desired one, or for a ``live`` attempt the one it
    was created from (when it differs and still parses)."""
    if live and memory.applied_spec is not None and memory.applied_spec != snap.desired:
        then, errs = validation.parse({**dict(snap.body), "spec": memory.applied_spec})
        if then is not None and not errs:
            return then, memory.applied_spec
    return snap.lpt, snap.desired


async def create_children(client: Client, objects: list[dict[str, Any]]) -> Round:
    """Create ``objects`` (children of one run): the ConfigMap first (ours and existing: brought up to date), then
    the Services and the PodGroup together, then the Pods in slow start (``fanout.slow_start``: 1, 2, 4, ... as Kubernetes'
    ReplicaSet controller does, each accepted create admitting two more, with no barrier between rounds, so a
    create waiting out a Retry-After holds back only itself, and lends its place to the next create meanwhile).
    The client's request slots (``kube.Slots``) bound the requests in flight.
    Pods wait for a ConfigMap/Service the API refused (without them the gang cannot start), and a refused create
    stops the round, so a quota that refuses the whole gang costs one refused create per round, not one per pod."""
    errors: list[ChildError] = []
    created: list[str] = []

    async def one(o: dict[str, Any]) -> bool:
        """Create ``o``; False (and an entry in ``errors``) when the API refused it."""
        try:
            return await client.create(o)
        except (ApiException, *aiohttp_errors()) as e:
            errors.append(ChildError(o["kind"], o["metadata"]["name"], classify(e), message_of(e)))
            return False

    def refused(o: dict[str, Any]) -> bool:
        return any(e.name == o["metadata"]["name"] for e in errors)

    for cm in (o for o in objects if o["kind"] == "ConfigMap"):
        if not await one(cm) and not errors:  # ours, shared by all attempts: bring it up to date
            await client.patch("configmaps", cm["metadata"]["namespace"], cm["metadata"]["name"],
                               {"metadata": {"annotations": {LEGACY_ANNOTATION_APPLIED_SPEC: None}},
                                "data": cm["data"]})
        created += [cm["metadata"]["name"]] if not refused(cm) else []
    others = [o for o in objects if o["kind"] not in ("ConfigMap", "Pod")]
    await fanout.gather(*(one(o) for o in others))
    created += [o["metadata"]["name"] for o in others if not refused(o)]
    pods = [o for o in objects if o["kind"] == "Pod"]
    unsent = 0
    if not errors:
        async def accepted(o: dict[str, Any]) -> bool:
            return await one(o) and not refused(o)

        unsent = await fanout.slow_start(pods, accepted, waiting=RETRY_WAIT)
        created += [o["metadata"]["name"] for o in pods[:len(pods) - unsent] if not refused(o)]
    return Round(tuple(created), tuple(errors), unsent)


def aiohttp_errors() -> tuple[type[BaseException], ...]:
    """Transport errors that outlive the client's retries (reported like an API refusal, retried later)."""
    import aiohttp

    return (aiohttp.ClientError, TimeoutError)
