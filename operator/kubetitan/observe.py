"""Observation: raw API objects and rank 0's /metrics -> the typed inputs of ``decide``.

Everything here is pure except :class:`Scraper` (HTTP GETs with aiohttp, parses in a thread). Pods and nodes
arrive as plain dicts (from kopf's index / the API); metrics arrive as Prometheus text and are parsed with
prometheus-client's parser, then checked row by row against ``kubetitan.scraped.RULES``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import heapq
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
import ipaddress
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kubetitan import conditions as C
from kubetitan import plan
from kubetitan.decide import NodeObs, PodObs
from kubetitan.elastic import NOT_EXTENDED
from kubetitan.status import training_status  # noqa: F401 - re-exported: observation's numbers for the status


def _ts(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_obs(pod: Mapping[str, Any]) -> PodObs | None:
    """The decision-relevant view of one training pod; None for a pod without our labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        attempt, rank = int(labels[plan.LABEL_ATTEMPT]), int(labels[plan.LABEL_RANK])
    except (KeyError, ValueError):
        return None
    st = pod.get("status") or {}
    cs = next((c for c in st.get("containerStatuses") or [] if c.get("name") == plan.CONTAINER_NAME),
              (st.get("containerStatuses") or [None])[0]) or {}
    state = cs.get("state") or {}
    waiting, running, term = state.get("waiting") or {}, state.get("running"), state.get("terminated")
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    sched = conds.get("PodScheduled") or {}
    unsched = None
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        unsched = sched.get("message") or "Unschedulable"
    disruption = conds.get("DisruptionTarget") or {}
    return PodObs(
        name=meta.get("name", ""),
        attempt=attempt,
        rank=rank,
        phase=st.get("phase") or "Pending",
        node_name=(pod.get("spec") or {}).get("nodeName"),
        pod_ip=st.get("podIP"),
        reason=st.get("reason"),
        message=st.get("message"),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        exit_code=term.get("exitCode") if term else None,
        terminated_reason=term.get("reason") if term else None,
        termination_message=term.get("message") if term else None,
        disruption_reason=disruption.get("reason") if disruption.get("status") == "True" else None,
        unschedulable_message=unsched,
        created=_ts(meta.get("creationTimestamp")),
        scheduled_since=_ts(sched.get("lastTransitionTime")) if sched.get("status") == "True" else None,
        running_since=_ts(running.get("startedAt")) if running else None,
        finished_at=_ts(term.get("finishedAt")) if term else None,
        deleting=bool(meta.get("deletionTimestamp")),
        pod_group=((pod.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName"),
    )


def node_obs(name: str, node: Mapping[str, Any] | None) -> NodeObs:
    """Health of a node; ``node`` None means the API says it does not exist."""
    if node is None:
        return NodeObs(name=name, exists=False, ready=False, not_ready_since=None)
    spec, status = node.get("spec") or {}, node.get("status") or {}
    place = {"unschedulable": bool(spec.get("unschedulable")),
             "labels": tuple(sorted(((node.get("metadata") or {}).get("labels") or {}).items())),
             "taints": tuple((t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in spec.get("taints") or []),
             "allocatable": tuple(sorted((k, str(v)) for k, v in (status.get("allocatable") or {}).items()
                                         if k not in NOT_EXTENDED))}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return NodeObs(name=name, ready=None, **place)
    ok = {"True": True, "False": False}.get(ready.get("status"))
    since = _ts(ready.get("lastTransitionTime"))
    return NodeObs(name=name, ready=ok, not_ready_since=None if ok else since, ready_since=since if ok else None,
                   **place)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of rank 0's exposition by sample name (first sample wins); a sample labelled only with ``phase``
    (the start-up anatomy), only with ``source`` (a mixture's per-source losses) or only with ``error`` (a failed
    checkpoint save's) also as ``<name>/<label value>``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, float(s.value))
            if set(s.labels) in ({"phase"}, {"source"}, {"error"}):
                out.setdefault(f"{s.name}/{next(iter(s.labels.values()))}", float(s.value))
    return out


# ------------------------------------------------------------------ spec changes
LIVE_FIELDS = ("training.steps", "runPolicy")
"""Applied at once while running: the operator reads them every cycle (steps: from the next attempt
for the trainer, at once for the status)."""
REJECTED_FIELDS = ("model", "tokenizer", "checkpoint.storage", "checkpoint.mountPath", "checkpoint.enabled")
"""Would make the existing checkpoints unusable: refused while the run has an attempt; revert them,
or create a new LlamaPretrain."""


def _flatten(d: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leaf paths of nested dicts (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict is a leaf)."""
    out = {} if out is None else out
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = {} if isinstance(d, dict) else d
    return out


def spec_changes(applied: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Changed wire paths between two specs, as (live, deferred, rejected)."""
    a, b = _flatten(dict(applied)), _flatten(dict(desired))
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    live, deferred, rejected = [], [], []
    for k in changed:
        if any(k == f or k.startswith(f + ".") for f in REJECTED_FIELDS):
            rejected.append(k)
        elif any(k == f or k.startswith(f + ".") for f in LIVE_FIELDS):
            live.append(k)
        else:
            deferred.append(k)
    return live, deferred, rejected


def metrics_url(ip: str, port: int) -> str:
    """rank 0's /metrics URL; an IPv6 address goes in brackets (RFC 3986)."""
    try:
        host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
    except ValueError:
        host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


# ------------------------------------------------------------------ the bounded scrape
DEFAULT_SCRAPE_MAX_BYTES = 4 * 1024 * 1024
"""The most bytes of rank 0's /metrics body the operator reads (``--scrape-max-bytes``); the trainer's own
exposition is about 11 KiB."""
DEFAULT_SCRAPE_MAX_SERIES = 5000
"""The most series (sample lines) of one body the operator parses (``--scrape-max-series``): the trainer's own
exposition has about 75; prometheus-client parses about 60,000 a second on one core, so a body at the cap costs
under 0.1 s, where 4 MiB of short lines (~240,000 series) cost 4 s and ~100 MB of sample objects."""
DEFAULT_SCRAPE_TIMEOUT_SECONDS = 3.0
"""The most one scrape may take, connect to last byte (``--scrape-timeout``)."""
DEFAULT_SCRAPE_CONCURRENCY = 8
"""Scrapes in flight at once across all runs (``--scrape-concurrency``); more wait up to one timeout for a slot."""
PARSE_THREADS = 2
"""Threads that parse bodies, off the event loop: at most this many parses run at once."""
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ScrapeLimits:
    """What one scrape of rank 0's /metrics may cost the operator (the operator flags set them)."""

    max_bytes: int = DEFAULT_SCRAPE_MAX_BYTES
    timeout: float = DEFAULT_SCRAPE_TIMEOUT_SECONDS
    concurrency: int = DEFAULT_SCRAPE_CONCURRENCY
    max_series: int = DEFAULT_SCRAPE_MAX_SERIES


@dataclass(frozen=True)
class Scraped:
    """One scrape's outcome: ``metrics`` (parsed samples) or ``reason`` (a ``MetricsAvailable`` reason) and
    ``error`` (what went wrong, with the URL); all None when no slot was free (nothing is known this cycle)."""

    metrics: dict[str, float] | None = None
    reason: str | None = None
    error: str | None = None


class TooManySeries(ValueError):
    """A body with more series than the operator parses (counted before any is parsed)."""

    def __init__(self, series: int, cap: int) -> None:
        self.series, self.cap = series, cap
        super().__init__(f"{series} series, more than the operator parses ({cap}, --scrape-max-series); the "
                         "trainer's own /metrics has about 75")


class FairSlots:
    """At most ``n`` scrapes at once, shared by every run: a free slot goes to the waiting run whose last scrape
    cost the least (seconds it held a slot), the oldest waiter first among equals.

    A run whose rank 0 serves a huge or slow body holds a slot for up to a whole timeout each time; with first come
    first served, a few such runs queued ahead of a cheap one made it wait their timeouts and give up (nothing
    learnt that cycle, its status a scrape interval behind, and the next). Here the cheap run's scrape goes first
    when a slot frees: it waits at most for one slot to free (one timeout), never behind the expensive runs' queue.
    A run's cost is forgotten with the run (:meth:`forget`)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.cost: dict[str, float] = {}
        """Seconds the last scrape of each run held its slot."""

    async def acquire(self, key: str) -> None:
        if self._free > 0:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self.cost.get(key, 0.0), next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot just as it gave up: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiting:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    def forget(self, key: str) -> None:
        self.cost.pop(key, None)


class Scraper:
    """Bounded scrapes of rank 0's /metrics, shared by every run of one operator.

    A body is read in chunks and abandoned past ``max_bytes`` (``MetricsTooLarge``, a declared Content-Length
    too: nothing read); connect, headers and body together get ``timeout`` (``MetricsTimeout``: a slow or
    never-ending body); its series are counted (two byte scans) and a body with more than ``max_series`` is
    refused unparsed (``MetricsTooLarge``); the text is parsed in a small thread pool (``MetricsMalformed`` when it
    is not UTF-8 Prometheus text), so one tenant's pod can neither fill the operator's memory nor hold the event
    loop that every other run's cycle needs. At most ``concurrency`` scrapes run at once, cheapest run first
    (:class:`FairSlots`).
    """

    def __init__(self, limits: ScrapeLimits | None = None) -> None:
        self.limits = limits or ScrapeLimits()
        self._slots = FairSlots(self.limits.concurrency)
        self._pool = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kubetitan-parse")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def forget(self, key: str) -> None:
        """Drop what is kept of a deleted run (its scrape cost)."""
        self._slots.forget(key)

    async def scrape(self, session: Any, ip: str, port: int, key: str = "") -> Scraped:
        """GET and parse rank 0's /metrics within the limits; ``key`` names the run (its share of the slots).

        A failed scrape is an observation failure, never a training failure: the caller reports it in the
        ``MetricsAvailable`` condition and keeps the last known progress.
        """
        timeout = self.limits.timeout
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire(key)
        except TimeoutError:
            return Scraped()  # no slot for a whole timeout: try again next cycle, nothing learnt
        t0 = time.monotonic()
        try:
            body, reason, error = await fetch(session, metrics_url(ip, port), self.limits)
            if body is None:
                return Scraped(reason=reason, error=error)
            loop = asyncio.get_running_loop()
            try:
                return Scraped(metrics=await loop.run_in_executor(self._pool, _decode_and_parse, body,
                                                                  self.limits.max_series))
            except TooManySeries as e:
                return Scraped(reason=C.METRICS_TOO_LARGE, error=f"GET {metrics_url(ip, port)}: {e}")
            except (ValueError, TypeError, IndexError, KeyError) as e:  # what the text parser raises on bad input
                return Scraped(reason=C.METRICS_MALFORMED, error=f"rank 0's /metrics ({metrics_url(ip, port)}) "
                               f"is not Prometheus text: {_short(e)}")
        finally:
            self._slots.cost[key] = time.monotonic() - t0
            self._slots.release()


def _short(e: BaseException, limit: int = 200) -> str:
    text = f"{e.__class__.__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + "..."


def series_count(body: bytes) -> int:
    """Sample lines of a Prometheus text body: its lines less its comments (``#`` first), counted in C."""
    lines = body.count(b"\n") + (0 if body.endswith(b"\n") or not body else 1)
    return lines - body.count(b"\n#") - (1 if body.startswith(b"#") else 0) - body.count(b"\n\n")


def _decode_and_parse(body: bytes, max_series: int = DEFAULT_SCRAPE_MAX_SERIES) -> dict[str, float]:
    if (n := series_count(body)) > max_series:  # counted before a single sample object is made
        raise TooManySeries(n, max_series)
    return parse_metrics(body.decode("utf-8"))  # UnicodeDecodeError is a ValueError


async def fetch(session: Any, url: str, limits: ScrapeLimits) -> tuple[bytes | None, str | None, str | None]:
    """(body, None, None), or (None, reason, what went wrong) within ``limits.max_bytes`` and ``limits.timeout``."""
    import aiohttp

    cap, timeout = limits.max_bytes, limits.timeout
    too_large = (C.METRICS_TOO_LARGE, f"GET {url}: the body is larger than the operator reads ({cap} bytes, "
                 "--scrape-max-bytes); the trainer's own /metrics is about 10 KiB")
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    return None, C.SCRAPE_FAILED, f"GET {url} answered HTTP {r.status}"
                if r.content_length is not None and r.content_length > cap:
                    r.close()
                    return None, *too_large
                body = bytearray()
                async for chunk in r.content.iter_chunked(_CHUNK):
                    body += chunk
                    if len(body) > cap:
                        r.close()  # drop the connection: the rest of the body is never read
                        return None, *too_large
                return bytes(body), None, None
    except TimeoutError:
        return None, C.METRICS_TIMEOUT, f"GET {url} did not finish within {timeout:g}s (--scrape-timeout)"
    except (aiohttp.ClientError, OSError) as e:
        return None, C.SCRAPE_FAILED, f"GET {url} failed: {e.__class__.__name__}: {e}".rstrip(": ")

