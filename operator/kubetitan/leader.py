"""One writer: leader election on a ``coordination.k8s.io/v1`` Lease, with fencing.

The protocol is client-go's ``tools/leaderelection`` (``LeaseLock``), rewritten for asyncio:

- Every replica is a candidate with its own ``identity``. The holder writes ``spec.renewTime`` every
  ``retry_period`` seconds; updates carry the Lease's ``resourceVersion``, so of two candidates racing for
  the same record one gets 409 Conflict and loses.
- A candidate never trusts the timestamps in the record (clocks differ): it notes, on its own monotonic
  clock, when it first saw the record in its current form, and takes the Lease over only when the record
  has not changed for ``spec.leaseDurationSeconds`` since, or when ``holderIdentity`` is empty (released).
  Each change of holder adds one to ``spec.leaseTransitions``.
- The holder loses the Lease when no renewal succeeded for ``renew_deadline`` seconds (shorter than the
  lease duration, as client-go requires); on shutdown it releases the Lease (empty holder, 1 s duration),
  so the next replica takes over at once.

What client-go leaves out (its doc.go: "does not guarantee that only one client is acting as a leader"),
this module adds:

- A *fence*. A write may be *started* only before ``sent + renew_deadline``, where ``sent`` is the moment
  the last successful renewal was sent (any other replica starts counting the lease duration no earlier
  than it stored that renewal). ``check()`` raises :class:`NotLeader`; the operator's client
  (``kube.Client``) and kopf's session (``kube.Client.kopf_session``) call it before every write. The check
  reads the clock, not a flag, so a replica whose renew loop is stuck stops too. The margin between the
  deadline and the lease duration (5 s by default) also absorbs clock-rate differences (client-go's
  doc.go: the tolerated ratio of clock rates is about lease duration / renew deadline).
- *Writes in flight* (``hold()``). A write may take longer than the renew deadline (a slow admission
  webhook on a pod create: 20 s and more); renewals go on meanwhile (the election runs in its own task, and
  the Lease's calls never wait for one of the client's request slots), and every successful renewal moves
  the expiry on. A write in flight is abandoned - its request cancelled, :class:`NotLeader` raised - only
  when the Lease could expire: ``sent + lease_duration`` of the last renewal sent passes with no renewal
  since (the moment a standby may take over, at the earliest), or at once when this replica steps down.
  Otherwise it runs under the client's own request timeout. So a long write is never cut short while
  this replica keeps its Lease, and never outlives the Lease on this side of the connection. What remains
  is the limitation no client can remove (the Kubernetes API has no fencing token): a request the client
  gave up on may still be stored by the server (one that had passed admission before the connection
  closed); the next leader reads the cluster before it acts, so it finds that write.
- *A Lease that disappears.* A replica that finds no Lease and creates it holds the record at once (the
  others see a holder and stand by) but does not act - ``leading`` stays False, no write passes the fence
  - until a full lease duration after it first found the Lease absent. A holder whose Lease was deleted
  under it may still be inside its fence until then, and no longer: its last renewal was stored before
  the deletion, so it was sent before this replica read the absence, and its writes end a lease duration
  after that renewal at the latest (the wait uses the longer of this replica's lease duration and the
  last record it saw; replicas of one install share the terms). A replica cannot tell a Lease never
  created from one deleted, so the first leader of a new install waits too (15 s by default); an operator
  that stops releases the Lease (it is not deleted), so a restart or a rolling update does not.
- *A holder that finds its Lease gone* (404 on a renewal, or a read that finds no Lease or another holder)
  steps down at once: its fence closes and its writes in flight are abandoned, whatever its deadline says.
  It then campaigns like any other replica (and waits out the lease duration if it creates the Lease).

``term`` counts the acquisitions of this replica: the operator's per-run loops compare it with the term
they last worked in and re-read their run from the API when it changed (a newly elected leader acts on
what the API says, not on what it remembered from an earlier term).

The clocks are monotonic seconds; the waits are ``asyncio`` sleeps, so ``clock`` must advance at the
event loop's rate (a test passes its own clock only to drive ``_try_acquire_or_renew`` step by step).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("kubetitan.leader")
T = TypeVar("T")

JITTER_FACTOR = 1.2
"""client-go's ``JitterFactor``: a candidate waits ``retry_period`` to ``retry_period * 2.2`` between tries, and
the renew deadline must be longer than ``retry_period * JITTER_FACTOR``."""


class NotLeader(RuntimeError):
    """A write this replica may not send: it does not hold the leader Lease (or its renewals have failed for the
    renew deadline). Nothing was sent; the cycle that tried it is abandoned and runs again once this replica
    leads (after re-reading the run from the API)."""


def default_identity() -> str:
    """``POD_NAME`` (the chart sets it) or the host name, plus a random suffix: a restarted pod is a new
    candidate (client-go's controllers use ``hostname_uuid`` the same way)."""
    base = os.environ.get("POD_NAME") or socket.gethostname() or "kubetitan"
    return f"{base}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LeaseConfig:
    """Where the Lease is and how long its terms are (``--leader-elect-*`` flags, chart ``leaderElection``)."""

    namespace: str
    name: str = "kubetitan"
    identity: str = field(default_factory=default_identity)
    lease_duration: float = 15.0
    """Seconds a standby waits, after the record last changed, before it takes the Lease over."""
    renew_deadline: float = 10.0
    """Seconds the leader goes on writing without a successful renewal; then it stops and steps down."""
    retry_period: float = 2.0
    """Seconds between two renewals (and between two tries of a standby)."""

    def problems(self) -> list[str]:
        """What is wrong with these durations, each with the fix (client-go's NewLeaderElector checks)."""
        out = []
        for flag, v in (("--leader-elect-lease-duration", self.lease_duration),
                        ("--leader-elect-renew-deadline", self.renew_deadline),
                        ("--leader-elect-retry-period", self.retry_period)):
            if not v > 0 or math.isinf(v):
                out.append(f"{flag} is {v}: give a number of seconds above 0")
        if self.lease_duration <= self.renew_deadline:
            out.append(f"the lease duration ({self.lease_duration:g} s) must be longer than the renew deadline "
                       f"({self.renew_deadline:g} s): the leader must stop writing before a standby may take over "
                       "(e.g. 15 and 10)")
        if self.renew_deadline <= JITTER_FACTOR * self.retry_period:
            out.append(f"the renew deadline ({self.renew_deadline:g} s) must be longer than {JITTER_FACTOR} x the "
                       f"retry period ({self.retry_period:g} s), or one slow renewal loses the Lease (e.g. 10 and 2)")
        if not self.namespace:
            out.append("no namespace for the Lease: pass --leader-elect-resource-namespace (the chart passes the "
                       "release namespace)")
        return out


def _micro(t: float) -> str:
    """A ``MicroTime`` (RFC 3339 with microseconds, UTC), as the Lease's time fields are written."""
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class AlwaysLeader:
    """No election (one replica): every write is allowed, and there is one term."""

    term = 1
    identity = ""
    config = None

    @property
    def leading(self) -> bool:
        return True

    def check(self) -> None:
        return None

    async def hold(self, write: Awaitable[T]) -> T:
        return await write

    async def wait(self) -> int:
        return self.term

    async def run(self) -> None:
        return None

    async def release(self) -> None:
        return None


class LeaderElector:
    """Acquire, renew and release one Lease through ``client`` (a ``kube.Client``: its lease calls are unfenced).

    ``on_change(leading)`` is called when this replica starts or stops leading (metrics, logs, waking loops).
    ``clock`` is monotonic seconds (the fence and every expiry); ``wall`` only fills the record's timestamps.
    """

    def __init__(self, config: LeaseConfig, client: Any, on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config, self.client, self.on_change = config, client, on_change
        self.clock, self.wall = clock, wall
        self.identity = config.identity
        self.term = 0
        self._valid_until = float("-inf")
        """Monotonic time before which this replica may start a write (last successful renewal sent + deadline)."""
        self._expires_at = float("-inf")
        """Monotonic time at which a write still in flight is abandoned (last renewal sent + lease duration)."""
        self._not_before = float("-inf")
        """Monotonic time before which this replica may not write although it holds the record: after creating the
        Lease, a lease duration after it first found it absent (an earlier holder may be inside its fence until then)."""
        self._absent_since: float | None = None
        """When this replica first found no Lease, since it last saw one (None: it saw one last)."""
        self._lost = ""
        """Why this replica's hold on the Lease ended (for the log line), when not by the renew deadline."""
        self._leading = asyncio.Event()
        self._lease: dict[str, Any] | None = None
        """The Lease object as last written or read (its resourceVersion is the next update's precondition)."""
        self._observed_raw: str | None = None
        self._observed_at = float("-inf")
        self._observed_duration = config.lease_duration
        self._in_flight: dict[asyncio.Future[str], asyncio.Future[Any]] = {}
        """Writes in flight (``hold``): the signal that abandons each, and its request."""

    # ---------------------------------------------------------------- the fence
    @property
    def leading(self) -> bool:
        now = self.clock()
        return self._leading.is_set() and self._not_before <= now < self._valid_until

    def check(self) -> None:
        if not self.leading:
            raise NotLeader(f"{self.identity} does not hold the leader Lease "
                            f"{self.config.namespace}/{self.config.name}: the write was not sent")

    async def hold(self, write: Awaitable[T]) -> T:
        """Await ``write`` (a request :meth:`check` allowed, sent now) while the Lease stays this replica's.

        It may outlast the renew deadline while renewals succeed (each moves the expiry on); it is abandoned - the
        request cancelled, :class:`NotLeader` raised - once the last renewal sent is ``lease_duration`` old (a standby
        may take over from then on), or at once when this replica steps down.
        """
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(write)
        self._in_flight[stop] = task
        try:
            while not stop.done() and (left := self._expires_at - self.clock()) > 0:
                await asyncio.wait((task, stop), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
        finally:
            del self._in_flight[stop]
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
            if not task.cancelled():
                task.exception()  # retrieved: a request abandoned as it failed is not "never retrieved"
        why = stop.result() if stop.done() else \
            f"no renewal for {self.config.lease_duration:g} s: a standby may take the Lease over"
        raise NotLeader(f"{self.identity} abandoned a write in flight ({why}; leader Lease "
                        f"{self.config.namespace}/{self.config.name}): whether the API stored it is not known, and the "
                        "next leader reads the cluster before it acts")

    async def wait(self) -> int:
        """Return (the current term) once this replica leads."""
        while not self.leading:
            await self._leading.wait()
            if not self.leading:  # set, but the fence already closed: the renew loop is about to step down
                await asyncio.sleep(min(self.config.retry_period, 0.1))
        return self.term

    def _holds(self) -> bool:
        """This replica wrote the record it last saw and its renew deadline has not passed (it may still be waiting
        out ``_not_before``)."""
        return self._lease is not None and (self._lease.get("spec") or {}).get("holderIdentity") == self.identity \
            and self.clock() < self._valid_until

    def _close(self, why: str) -> None:
        """Stop writing at once: the fence closes and every write in flight is abandoned."""
        self._valid_until = self._expires_at = float("-inf")
        self._lost = self._lost or why
        for stop in self._in_flight:
            if not stop.done():
                stop.set_result(self._lost)

    # ---------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Campaign forever: acquire, (after creating the Lease) wait out an earlier holder's fence, renew until a
        renewal misses its deadline or finds the Lease gone, step down, campaign again."""
        cfg = self.config
        log.info("Started leader election", extra={"lease": f"{cfg.namespace}/{cfg.name}", "identity": self.identity})
        while True:
            while not await self._try_acquire_or_renew():
                await asyncio.sleep(random.uniform(cfg.retry_period, cfg.retry_period * (1 + JITTER_FACTOR)))
            if self.clock() < self._not_before and not await self._wait_out():
                self._step_down(leading=False)
                continue
            self.term += 1
            self._leading.set()
            log.info("Acquired the leader Lease %s/%s (term %d); every run is read from the API before it is acted on",
                     cfg.namespace, cfg.name, self.term, extra={"identity": self.identity})
            self._notify(True)
            while await self._renew():
                pass
            self._step_down(leading=True)

    def _step_down(self, leading: bool) -> None:
        cfg = self.config
        self._close(f"no renewal succeeded for {cfg.renew_deadline:g} s")
        self._leading.clear()
        if leading:
            self._notify(False)
        log.warning("%s the leader Lease %s/%s: %s; stopped writing and standing by",
                    "Lost" if leading else "Gave up", cfg.namespace, cfg.name, self._lost,
                    extra={"identity": self.identity})
        self._lost = ""

    async def _wait_out(self) -> bool:
        """Hold the Lease this replica created, renewing it, until ``_not_before``; False when the hold ended first."""
        cfg = self.config
        log.info("Created the leader Lease %s/%s; acting in %.1f s, a lease duration after finding no Lease (a holder "
                 "whose Lease was deleted may be writing until then)", cfg.namespace, cfg.name,
                 self._not_before - self.clock(), extra={"identity": self.identity})
        while (left := self._not_before - self.clock()) > 0:
            if not await self._renew(min(cfg.retry_period, left)):
                return False
        return True

    async def _renew(self, after: float | None = None) -> bool:
        """One renew round: wait ``after`` seconds (a retry period), then try until a renewal succeeds or the deadline
        passes (or the Lease is found gone)."""
        await asyncio.sleep(self.config.retry_period if after is None else after)
        while self.clock() < self._valid_until:
            if await self._try_acquire_or_renew():
                return True
            await asyncio.sleep(max(0.0, min(self.config.retry_period, self._valid_until - self.clock())))
        return False

    def _notify(self, leading: bool) -> None:
        if self.on_change is not None:
            try:
                self.on_change(leading)
            except Exception:  # noqa: BLE001 - a callback's bug must not stop the election
                log.exception("Leader election callback failed")

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        raw = json.dumps(spec, sort_keys=True)
        if raw != self._observed_raw:
            self._observed_raw, self._observed_at = raw, self.clock()
            self._observed_duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration)
        self._lease = lease
        self._absent_since = None

    def _won(self, lease: dict[str, Any], sent: float) -> bool:
        self._observe(lease)
        self._valid_until = sent + self.config.renew_deadline
        self._expires_at = sent + self.config.lease_duration
        return True

    def _record(self, now: float, old: dict[str, Any] | None) -> dict[str, Any]:
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(math.ceil(self.config.lease_duration)),
                "acquireTime": _micro(now), "renewTime": _micro(now), "leaseTransitions": 0}
        if old is not None:
            if old.get("holderIdentity") == self.identity:
                spec["acquireTime"] = old.get("acquireTime") or spec["acquireTime"]
                spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0)
            else:
                spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
        return spec

    def _timeout(self) -> float:
        """A renewal must come back before the fence closes; a standby's try within one retry period."""
        left = self._valid_until - self.clock()
        return max(0.05, left) if left > 0 else self.config.retry_period

    # long: client-go's tryAcquireOrRenew, one decision per step of the record's life (held, absent, other, expired)
    async def _try_acquire_or_renew(self) -> bool:
        cfg, client = self.config, self.client
        holding = self._holds()
        # 1. the holder's fast path: update the record it wrote last (one request)
        if holding:
            assert self._lease is not None
            body = {**self._lease, "spec": self._record(self.wall(), self._lease.get("spec") or {})}
            sent = self.clock()
            try:
                return self._won(await client.update_lease(cfg.namespace, cfg.name, body, timeout=self._timeout()),
                                 sent)
            except Exception as e:  # noqa: BLE001 - any failure: read the record and decide (slow path)
                if getattr(e, "status", None) == 404:
                    self._gone("the Lease was deleted")
                    return False
                log.debug("Renewing the leader Lease optimistically failed: %s", e)
        # 2. read it (or create it)
        try:
            lease = await client.get_lease(cfg.namespace, cfg.name, timeout=self._timeout())
        except Exception as e:  # noqa: BLE001 - the API is unavailable: try again next period
            log.debug("Reading the leader Lease %s/%s failed: %s", cfg.namespace, cfg.name, e)
            return False
        if lease is None:
            if holding:
                self._gone("the Lease was deleted")
                return False
            return await self._create()
        # 3. held by someone else and not expired (by this replica's own clock since it last changed)?
        self._observe(lease)
        old = lease.get("spec") or {}
        holder = old.get("holderIdentity") or ""
        if holding and holder != self.identity:
            self._close(f"the Lease names {holder or 'no holder'} now (it was deleted or edited)")
            return False
        if holder and holder != self.identity and self.clock() < self._observed_at + self._observed_duration:
            return False
        # 4. take it over (or renew it through the slow path), on the resourceVersion just read
        body = {**lease, "spec": self._record(self.wall(), old)}
        sent = self.clock()
        try:
            return self._won(await client.update_lease(cfg.namespace, cfg.name, body, timeout=self._timeout()), sent)
        except Exception as e:  # noqa: BLE001 - 409: another candidate won this round
            log.debug("Updating the leader Lease %s/%s failed: %s", cfg.namespace, cfg.name, e)
            return False

    def _gone(self, why: str) -> None:
        """The holder found no Lease: it steps down at once, and counts the absence from now."""
        self._close(why)
        self._lease = None
        self._absent_since = self.clock()

    async def _create(self) -> bool:
        """No Lease: create it. Won, this replica acts only a lease duration after it first found the Lease absent."""
        cfg = self.config
        if self._absent_since is None:
            self._absent_since = self.clock()
        absent_since = self._absent_since
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": cfg.name, "namespace": cfg.namespace}, "spec": self._record(self.wall(), None)}
        sent = self.clock()
        try:
            lease = await self.client.create_lease(cfg.namespace, body, timeout=self._timeout())
        except Exception as e:  # noqa: BLE001 - another candidate created it first (409), or the API failed
            log.debug("Creating the leader Lease %s/%s failed: %s", cfg.namespace, cfg.name, e)
            return False
        self._not_before = max(self._not_before,
                               absent_since + max(cfg.lease_duration, self._observed_duration))
        return self._won(lease, sent)

    async def release(self) -> None:
        """Step down (operator shutdown): stop writing first (writes in flight abandoned), then hand the Lease over
        (empty holder, 1 s)."""
        if self._lease is None or (self._lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        held = self._holds()
        self._close("the operator is stopping")
        self._leading.clear()
        requests = list(self._in_flight.values())
        for r in requests:
            r.cancel()
        if requests:
            await asyncio.wait(requests)
        if not held:
            return
        spec = {**(self._lease.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1,
                "renewTime": _micro(self.wall()), "acquireTime": _micro(self.wall())}
        with contextlib.suppress(Exception):  # the next leader waits out the lease duration instead
            await self.client.update_lease(self.config.namespace, self.config.name, {**self._lease, "spec": spec},
                                           timeout=self.config.retry_period)
            log.info("Released the leader Lease %s/%s", self.config.namespace, self.config.name)


__all__ = ["AlwaysLeader", "LeaderElector", "LeaseConfig", "NotLeader", "default_identity"]
