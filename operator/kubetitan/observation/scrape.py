"""The bounded scrape of rank 0's /metrics and its parse: Prometheus text -> samples by name.

Everything here is pure except :class:`Scraper` (HTTP GETs with aiohttp, parses in a thread). Metrics arrive as
Prometheus text and are parsed with prometheus-client's parser; ``kubetitan.scraped`` then checks them row by row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kubetitan import conditions as C
from kubetitan.slots import PrioritySlots


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


def metrics_url(ip: str, port: int) -> str:
    """rank 0's /metrics URL; an IPv6 address goes in brackets (RFC 3986)."""
    try:
        host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
    except ValueError:
        host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


def sample(m: Mapping[str, float], key: str) -> float | None:
    """A parsed sample by name; NaN (and an absent one) is unknown: None."""
    v = m.get(key)
    return None if v is None or v != v else v


def sample_int(m: Mapping[str, float], key: str) -> int | None:
    """A parsed sample as an integer (a step, a code, a generation), or None."""
    v = sample(m, key)
    return None if v is None else int(v)


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


def too_many_series(series: int, cap: int) -> str:
    """Why a body with more series than the operator parses is refused (counted before any is parsed)."""
    return (f"{series} series, more than the operator parses ({cap}, --scrape-max-series); the trainer's own /metrics "
            "has about 75")


class FairSlots(PrioritySlots):
    """At most ``n`` scrapes at once, shared by every run: a free slot goes to the waiting run whose last scrape
    cost the least (seconds it held a slot), the oldest waiter first among equals.

    A run whose rank 0 serves a huge or slow body holds a slot for up to a whole timeout each time; with first come
    first served, a few such runs queued ahead of a cheap one made it wait their timeouts and give up (nothing
    learnt that cycle, its status a scrape interval behind, and the next). Here the cheap run's scrape goes first
    when a slot frees: it waits at most for one slot to free (one timeout), never behind the expensive runs' queue.
    A run's cost is forgotten with the run (:meth:`forget`)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.cost: dict[str, float] = {}
        """Seconds the last scrape of each run held its slot."""

    async def acquire(self, key: str) -> None:  # type: ignore[override]  # by run: its cost is the priority
        await super().acquire(self.cost.get(key, 0.0))

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
            # counted here, in C (about a millisecond for the 4 MiB cap), before a single sample object is made: a body
            # refused never reaches the parse threads (a pool thread holds the arguments of its task until it drops them)
            if (n := series_count(body)) > self.limits.max_series:
                return Scraped(reason=C.METRICS_TOO_LARGE,
                               error=f"GET {metrics_url(ip, port)}: {too_many_series(n, self.limits.max_series)}")
            loop = asyncio.get_running_loop()
            try:
                return Scraped(metrics=await loop.run_in_executor(self._pool, _decode_and_parse, body))
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


def _decode_and_parse(body: bytes) -> dict[str, float]:
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
