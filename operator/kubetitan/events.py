"""Kubernetes Events as a Kubernetes controller sends them: one Event per problem, counted, never lost.

client-go's ``EventRecorder`` (``tools/record/events_cache.go``: ``EventCorrelator``/``EventAggregator``) keys an
Event by its object, type, reason and message: the first occurrence is created, a repeat PATCHes the same Event's
``count``/``lastTimestamp`` (and, in the newer events API, its ``series``) instead of creating another. This module
does the same with one more property: an Event's name is derived from its key, so the key is found again after
an operator restart or by another replica (a create answered 409 AlreadyExists is read and counted on, not
duplicated).

Two ways to send:

- :meth:`Recorder.record` — aggregated (``FailedCreate``, ``UnknownInstanceType``, ...): count +1 per occurrence.
  With ``known=True`` (a state reported once per change: a spec warning, refused scraped values) an Event this
  process has not counted yet but that exists already (409: sent before an operator restart, or by another
  replica, about the same state) is left as it is: the restarted operator sees the same state again, which is not
  a new occurrence.
- :meth:`Recorder.send_once` — an Event that belongs to a status change (``status.pendingEvents``: a restart
  record, the end of the run, a refused edit): created once by its derived name; 409 means it was already sent
  (by this operator before it was killed, or by another replica), so it is never counted twice.

Events are best effort, as in client-go: a refused Event is logged and dropped (the aggregated ones), or kept
pending in the status and sent on the next cycle (the status ones).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

log = logging.getLogger("kubetitan.events")

COMPONENT = "kubetitan-operator"
"""``source.component`` / ``reportingComponent`` of every Event the operator sends."""
CACHE_SIZE = 4096
"""Aggregation keys remembered (LRU), as client-go's ``maxLruCacheEntries``."""
NAME_PREFIX_MAX = 200
"""The involved object's name is cut to this before ``.<hash>`` (an Event name is a DNS subdomain, <= 253)."""


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def key_of(involved: Mapping[str, Any], type_: str, reason: str, message: str, extra: str = "") -> str:
    """The aggregation key: the object (by uid), type, reason and message (``extra``: a status change's time)."""
    meta = involved.get("metadata") or {}
    return "\x00".join((meta.get("uid") or "", meta.get("namespace") or "", meta.get("name") or "", type_, reason,
                        message, extra))


def event_name(involved: Mapping[str, Any], key: str) -> str:
    """``<object name>.<16 hex digits of the key's hash>``: the same key always names the same Event."""
    name = ((involved.get("metadata") or {}).get("name") or "object")[:NAME_PREFIX_MAX]
    return f"{name}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def event_body(involved: Mapping[str, Any], name: str, type_: str, reason: str, message: str, now: float,
               instance: str, action: str) -> dict[str, Any]:
    """A core/v1 Event (count 1) about ``involved`` (pure). A cluster-scoped object (no namespace) has its Events in
    namespace ``default`` and no ``involvedObject.namespace`` (the API server refuses one there)."""
    meta = involved.get("metadata") or {}
    ref = {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"), "name": meta.get("name"),
           "namespace": meta.get("namespace"), "uid": meta.get("uid")}
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": meta.get("namespace") or "default"},
        "involvedObject": {k: v for k, v in ref.items() if v is not None},
        "type": type_, "reason": reason, "message": message[:1024], "action": action or reason,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT, "reportingInstance": instance[:128],
        "firstTimestamp": _ts(now), "lastTimestamp": _ts(now), "eventTime": _micro(now), "count": 1,
    }


def repeat_patch(count: int, now: float) -> dict[str, Any]:
    """The merge patch that counts an Event's ``count``-th occurrence (``series`` from the second on, as the
    events.k8s.io/v1 recorder keeps it)."""
    return {"count": count, "lastTimestamp": _ts(now), "series": {"count": count, "lastObservedTime": _micro(now)}}


def default_instance() -> str:
    """``reportingInstance``: the pod's name in a cluster (``HOSTNAME``), else this machine and process."""
    return os.environ.get("HOSTNAME") or f"{socket.gethostname()}-{os.getpid()}"


class Recorder:
    """Sends Events through ``client`` (a :class:`kubetitan.kube.Client`): aggregated or exactly once."""

    def __init__(self, client: Any, instance: str | None = None, clock: Callable[[], float] | None = None,
                 fenced: bool = True) -> None:
        self.client = client
        self.fenced = fenced
        """False: the Events are sent whether or not this replica holds the leader Lease (the webhook configuration's,
        which every replica keeps)."""
        self.instance = instance or default_instance()
        self.clock = clock or time.time
        self.counts: OrderedDict[str, int] = OrderedDict()
        """Aggregation key -> the count the API holds (as far as this replica knows)."""
        self.sent = 0
        """Event API writes made (creates and patches), for tests and logs."""

    async def record(self, involved: Mapping[str, Any], type_: str, reason: str, message: str,
                     action: str = "", known: bool = False) -> None:
        """One more occurrence of (object, type, reason, message): create the Event, or count on the existing one.
        ``known``: the occurrence is a state this process may have reported before it (re)started: an Event found
        already there is taken as its report, not counted again (a repeat within this process is counted)."""
        key = key_of(involved, type_, reason, message)
        name = event_name(involved, key)
        ns = (involved.get("metadata") or {}).get("namespace") or "default"
        now = self.clock()
        body = event_body(involved, name, type_, reason, message, now, self.instance, action)
        try:
            count = self.counts.get(key)
            if count is None:
                self.sent += 1
                if await self.client.create(body, **self._unfenced()):
                    self._remember(key, 1)
                    return
                existing = await self.client.get("events", ns, name) or {}  # sent before a restart, or by a peer
                count = int(existing.get("count") or 1)
                if known and existing:
                    self._remember(key, count)
                    return
            self.sent += 1
            try:
                await self.client.patch("events", ns, name, repeat_patch(count + 1, now), **self._unfenced())
            except ApiException as e:
                if e.status != 404:
                    raise
                await self.client.create(body, **self._unfenced())  # expired meanwhile (the API server keeps Events for an hour)
                count = 0
            self._remember(key, count + 1)
        except Exception as e:  # noqa: BLE001 - an Event is best effort: a refused one never fails a cycle
            self.counts.pop(key, None)
            log.warning("Sending Event %s %s for %s/%s failed: %s", type_, reason, ns,
                        (involved.get("metadata") or {}).get("name"), e)

    def _unfenced(self) -> dict[str, Any]:
        return {} if self.fenced else {"fenced": False}

    def _remember(self, key: str, count: int) -> None:
        self.counts[key] = count
        self.counts.move_to_end(key)
        while len(self.counts) > CACHE_SIZE:
            self.counts.popitem(last=False)

    async def send_once(self, involved: Mapping[str, Any], type_: str, reason: str, message: str, time: str,
                        action: str = "") -> bool:
        """Create the Event of a status change (its name derives from the change); True when it exists now (created
        here, or already there: sent before), False when the API refused it (it stays pending)."""
        key = key_of(involved, type_, reason, message, extra=time)
        name = event_name(involved, key)
        ns = (involved.get("metadata") or {}).get("namespace") or "default"
        self.sent += 1
        try:
            await self.client.create(event_body(involved, name, type_, reason, message, self.clock(), self.instance,
                                                action))
        except Exception as e:  # noqa: BLE001 - kept pending in the status; the next cycle sends it again
            log.warning("Sending Event %s %s for %s/%s failed (kept pending): %s", type_, reason, ns,
                        (involved.get("metadata") or {}).get("name"), e)
            return False
        return True


__all__ = ["COMPONENT", "Recorder", "event_body", "event_name", "key_of", "repeat_patch"]
