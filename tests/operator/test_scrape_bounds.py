"""Bounded observation (issue 30): what a tenant's rank 0 serves on /metrics can neither exhaust the operator nor
put numbers into the status that break a rule.

- ``kubetitan.scraped.RULES`` table-tested through ``scraped.check`` (pure);
- ``scrape.Scraper`` against a hostile HTTP server on 127.0.0.1: huge, never-ending, slow, malformed bodies;
- the real operator (a process) scraping 300 MB and never-ending bodies from four runs' "rank 0" while a run in
  another namespace goes on being reconciled; its peak RSS is read from /proc.
"""

from __future__ import annotations

import asyncio
import http.server
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kmockx.harness import EVENTS, LPT, NS, Cluster, Operator, OperatorProcess, cpu_spec, free_port, lpt, wait_for
from kubetitan import conditions as C
from kubetitan import scraped
from kubetitan.observation import scrape as observe
from kubetitan_core import contract
from kubetitan_core.api import AttemptObservation

pytestmark = pytest.mark.xdist_group("operator-ha")
NOW = 1_800_000_000.0
M = contract


# ------------------------------------------------------------------------------------------- the rules
def obs(**kw: Any) -> AttemptObservation:
    return AttemptObservation(**{"attempt": 0, **kw})


CASES = [
    # (id, scraped samples, previous observation, kept, refused as (metric, check))
    ("good-values-kept", {M.M_STEP: 42, M.M_LOSS: 2.5, M.M_MFU: 0.4, M.M_LAST_CHECKPOINT_STEP: 40,
                          M.M_LAST_STEP_TIMESTAMP: NOW - 1},
     None, {M.M_STEP: 42, M.M_LOSS: 2.5, M.M_MFU: 0.4, M.M_LAST_CHECKPOINT_STEP: 40, M.M_LAST_STEP_TIMESTAMP: NOW - 1},
     []),
    ("infinity-refused", {M.M_TOKENS_PER_SECOND_PER_GPU: math.inf, M.M_STEP: 5}, None, {M.M_STEP: 5},
     [(M.M_TOKENS_PER_SECOND_PER_GPU, "finite")]),
    ("nan-loss-refused", {M.M_LOSS: math.nan}, None, {}, [(M.M_LOSS, "finite")]),
    ("minus-infinity-refused", {M.M_STEP_DURATION: -math.inf}, None, {}, [(M.M_STEP_DURATION, "finite")]),
    ("step-1e18-refused", {M.M_STEP: 1e18}, None, {}, [(M.M_STEP, "range")]),
    ("step-at-2^53-1-kept", {M.M_STEP: float(2**53 - 1)}, None, {M.M_STEP: float(2**53 - 1)}, []),
    ("negative-checkpoint-refused", {M.M_LAST_CHECKPOINT_STEP: -7}, None, {}, [(M.M_LAST_CHECKPOINT_STEP, "range")]),
    ("fractional-step-refused", {M.M_STEP: 4.5}, None, {}, [(M.M_STEP, "integer")]),
    ("negative-throughput-refused", {M.M_TOKENS_PER_SECOND: -1.0}, None, {}, [(M.M_TOKENS_PER_SECOND, "range")]),
    ("step-time-beyond-a-day-refused", {M.M_STEP_DURATION: 1e300, M.M_STEP_DURATION_MEDIAN: 86401}, None, {},
     [(M.M_STEP_DURATION, "range"), (M.M_STEP_DURATION_MEDIAN, "range")]),
    ("mfu-above-1-refused", {M.M_MFU: 1.5}, None, {}, [(M.M_MFU, "range")]),
    ("resumed-from--1-kept", {M.M_RESUMED_FROM_STEP: -1}, None, {M.M_RESUMED_FROM_STEP: -1}, []),
    ("resumed-from--2-refused", {M.M_RESUMED_FROM_STEP: -2}, None, {}, [(M.M_RESUMED_FROM_STEP, "range")]),
    ("exit-code-256-refused", {M.M_RESTART_EXIT_CODE: 256}, None, {}, [(M.M_RESTART_EXIT_CODE, "range")]),
    ("heartbeat-an-hour-ahead-refused", {M.M_LAST_STEP_TIMESTAMP: NOW + 3600}, None, {},
     [(M.M_LAST_STEP_TIMESTAMP, "future")]),
    ("heartbeat-a-minute-ahead-kept", {M.M_LAST_STEP_TIMESTAMP: NOW + 60}, None,
     {M.M_LAST_STEP_TIMESTAMP: NOW + 60}, []),
    ("startup-phase-negative-refused", {f"{M.M_STARTUP_PHASE_SECONDS}/imports": -3}, None, {},
     [(f"{M.M_STARTUP_PHASE_SECONDS}/imports", "range")]),
    ("unknown-sample-dropped", {"kubetitan_trainer_learning_rate": 3e-4, "python_gc_objects_collected_total": 1},
     None, {}, []),
    ("step-regression-in-a-generation-refused", {M.M_STEP: 30, M.M_RESTART_GENERATION: 0}, obs(step=40, generation=0),
     {M.M_RESTART_GENERATION: 0}, [(M.M_STEP, "regression")]),
    ("step-back-at-a-new-generation-kept", {M.M_STEP: 30, M.M_RESTART_GENERATION: 1}, obs(step=40, generation=0),
     {M.M_STEP: 30, M.M_RESTART_GENERATION: 1}, []),
    ("step-of-another-attempt-not-compared", {M.M_STEP: 3, M.M_ATTEMPT: 1}, obs(step=40),
     {M.M_STEP: 3, M.M_ATTEMPT: 1}, []),
    ("older-attempts-process-not-compared", {M.M_STEP: 3, M.M_ATTEMPT: 0}, obs(attempt=1, step=40),
     {M.M_STEP: 3, M.M_ATTEMPT: 0}, []),
    ("checkpoint-regression-refused", {M.M_LAST_CHECKPOINT_STEP: 20}, obs(last_checkpoint_step=40), {},
     [(M.M_LAST_CHECKPOINT_STEP, "regression")]),
    ("checkpoint-regression-across-generations-refused", {M.M_LAST_CHECKPOINT_STEP: 20, M.M_RESTART_GENERATION: 2},
     obs(last_checkpoint_step=40, generation=1), {M.M_RESTART_GENERATION: 2},
     [(M.M_LAST_CHECKPOINT_STEP, "regression")]),
    ("checkpoint-gauge-unset-in-a-new-process-skipped", {M.M_LAST_CHECKPOINT_STEP: 0, M.M_RESTART_GENERATION: 1},
     obs(last_checkpoint_step=40, generation=0), {M.M_RESTART_GENERATION: 1}, []),
    ("generation-regression-refused", {M.M_RESTART_GENERATION: 1}, obs(generation=2), {},
     [(M.M_RESTART_GENERATION, "regression")]),
    ("equal-step-kept", {M.M_STEP: 40}, obs(step=40), {M.M_STEP: 40}, []),
]


@pytest.mark.parametrize(("scrape", "prev", "kept", "refused"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_scraped_value_is_checked_by_its_rule(scrape, prev, kept, refused) -> None:
    got, why = scraped.check(scrape, attempt=prev.attempt if prev else 0, prev=prev, now=NOW)
    assert got == kept
    assert [(r.metric, r.check) for r in why] == refused, [str(r) for r in why]


BOUNDS = scraped.SpecBounds(steps=100, processes=4)
SPEC_CASES = [
    # (id, scraped samples, kept, refused as (metric, check))
    ("absurd-step-of-100", {M.M_STEP: float(2**53 - 1)}, {}, [(M.M_STEP, "spec")]),
    ("step-at-the-count-plus-slack-kept", {M.M_STEP: 110.0}, {M.M_STEP: 110.0}, []),
    ("step-past-the-slack-refused", {M.M_STEP: 111.0, M.M_LAST_CHECKPOINT_STEP: 500.0}, {},
     [(M.M_STEP, "spec"), (M.M_LAST_CHECKPOINT_STEP, "spec")]),
    ("loss-1e308-refused", {M.M_LOSS: 1e308, M.M_EVAL_LOSS: 2000.0}, {}, [(M.M_LOSS, "spec"), (M.M_EVAL_LOSS, "spec")]),
    ("a-diverged-loss-kept", {M.M_LOSS: 250.0}, {M.M_LOSS: 250.0}, []),
    ("throughput-beyond-the-world-refused", {M.M_TOKENS_PER_SECOND: 4.1e8, M.M_TOKENS_PER_SECOND_PER_GPU: 2e8}, {},
     [(M.M_TOKENS_PER_SECOND, "spec"), (M.M_TOKENS_PER_SECOND_PER_GPU, "spec")]),
    ("a-fast-run-kept", {M.M_TOKENS_PER_SECOND: 4e8}, {M.M_TOKENS_PER_SECOND: 4e8}, []),
]


@pytest.mark.parametrize(("scrape", "kept", "refused"), [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_finite_values_beyond_what_the_spec_makes_possible_are_refused(scrape, kept, refused) -> None:
    """``step 9007199254740991 of 100`` and ``loss 1e308`` are finite: the run's spec bounds them (steps + 10, a
    loss of 1000 nats per token, 1e8 tokens/s per process)."""
    got, why = scraped.check(scrape, attempt=0, prev=None, now=NOW, bounds=BOUNDS)
    assert got == kept
    assert [(r.metric, r.check) for r in why] == refused, [str(r) for r in why]
    assert scraped.check(scrape, attempt=0, prev=None, now=NOW)[0] == scrape  # the rows alone let them through


def test_the_spec_bounds_come_from_the_spec_and_the_attempts_own_spec() -> None:
    """The larger of the two (a lowered steps count reaches the trainer with the next attempt); an elastic run's
    largest gang; processes per node, else GPUs per node, else one."""
    from kubetitan_core.api import LlamaPretrainSpec
    from support.specs import cpu_spec

    spec = LlamaPretrainSpec.model_validate({**cpu_spec(nodes=2), "training": {**cpu_spec()["training"],
                                                                               "steps": 50}})
    assert scraped.SpecBounds.of(spec) == scraped.SpecBounds(steps=50, processes=2 * (
        spec.resources.processes_per_node or 1))
    applied = {"training": {"steps": 80}, "resources": {"nodes": 6, "gpusPerNode": 8}}
    assert scraped.SpecBounds.of(spec, applied) == scraped.SpecBounds(steps=80, processes=48)
    _, why = scraped.check({M.M_STEP: 85.0}, attempt=0, prev=None, now=NOW, bounds=scraped.SpecBounds.of(spec))
    assert str(why[0]) == "kubetitan_trainer_step=85 (above 60: the run trains 50 steps (+10))"


def test_every_sample_the_status_reads_has_exactly_one_rule() -> None:
    """A new ``contract.M_*`` read in status.py or observation/tracking.py without a row here would enter the status
    unchecked."""
    src = "".join((Path(scraped.__file__).parent / f).read_text() for f in ("status.py", "observation/tracking.py"))
    read = {getattr(contract, n) for n in re.findall(r"contract\.(M_[A-Z0-9_]+)", src)}
    read |= {f"{contract.M_STARTUP_PHASE_SECONDS}/{p}" for p in contract.STARTUP_PHASES}
    read.discard(contract.M_STARTUP_PHASE_SECONDS)  # read only as name/phase
    rows = [r.metric for r in scraped.RULES]
    assert len(rows) == len(set(rows))
    assert read == set(rows), (read - set(rows), set(rows) - read)


def test_the_refusal_message_names_metric_value_and_rule() -> None:
    _, why = scraped.check({M.M_STEP: 1e18, M.M_TOKENS_PER_SECOND_PER_GPU: math.inf}, attempt=0, prev=None, now=NOW)
    text = scraped.summary(why)
    assert "kubetitan_trainer_step=1e+18 (above 2^53 - 1)" in text
    assert "kubetitan_trainer_tokens_per_second_per_gpu=inf (not a finite number)" in text
    # one Event per kind of problem, whatever the values
    _, again = scraped.check({M.M_STEP: 2e18, M.M_TOKENS_PER_SECOND_PER_GPU: -math.inf}, attempt=0, prev=None,
                             now=NOW)
    assert scraped.signature(why) == scraped.signature(again)


# ------------------------------------------------------------------------------------------- a hostile rank 0
GOOD = (f"# TYPE {M.M_STEP} gauge\n{M.M_STEP} 7.0\n# TYPE {M.M_LOSS} gauge\n{M.M_LOSS} 2.5\n").encode()
LINE = b'kubetitan_trainer_padding{rank="0"} 1.0\n'
SERIES_BODY = b"".join(b'p{i="%d"} 1\n' % i for i in range(400_000))[:4 * 2**20 - 64 - len(GOOD)]
SERIES_BODY = GOOD + SERIES_BODY[:SERIES_BODY.rfind(b"\n") + 1]
"""Just under 4 MiB, ~290,000 series."""


class Rank0Server:
    """A rank 0 that misbehaves on 127.0.0.1: ``mode`` is one of

    good, big (a 300 MB chunked body), declared (Content-Length 300 MB), endless (chunks forever, fast),
    slow (one line every 0.2 s, forever), garbage (not Prometheus text), binary (not UTF-8), error (HTTP 500),
    series (just under 4 MiB of short sample lines: ~240,000 series).
    """

    SIZE = 300 * 1000 * 1000

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.request_times: list[float] = []
        """time.monotonic() of each request's arrival."""
        self.sent = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.requests += 1
                server.request_times.append(time.monotonic())
                try:
                    server.answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the operator stopped reading: what it must do

        self.port = free_port()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name=f"rank0-{mode}")
        self.thread.start()

    def answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        mode = self.mode
        if mode == "error":
            h.send_response(500)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        body = {"good": GOOD, "garbage": b"this is {not prometheus text\n", "binary": b"\xff\xfe\x00bad",
                "series": SERIES_BODY}.get(mode)
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4")
        if body is not None:
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        block = LINE * (64 * 1024 // len(LINE))
        if mode == "declared":
            h.send_header("Content-Length", str(self.SIZE))
            h.end_headers()
            while self.sent < self.SIZE:
                h.wfile.write(block)
                self.sent += len(block)
            return
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        sent = 0
        while mode != "big" or sent < self.SIZE:
            piece = LINE if mode == "slow" else block
            h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            h.wfile.flush()
            sent += len(piece)
            self.sent += len(piece)
            if mode == "slow":
                time.sleep(0.2)
        h.wfile.write(b"0\r\n\r\n")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def rank0_server():
    servers: list[Rank0Server] = []

    def make(mode: str) -> Rank0Server:
        servers.append(Rank0Server(mode))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


async def _scrape(server: Rank0Server, **limits: Any) -> observe.Scraped:
    scraper = observe.Scraper(observe.ScrapeLimits(**{"max_bytes": 1 << 20, "timeout": 2.0, **limits}))
    try:
        async with aiohttp.ClientSession() as session:
            return await scraper.scrape(session, "127.0.0.1", server.port)
    finally:
        scraper.close()


@pytest.mark.parametrize(("mode", "reason", "words"), [
    ("big", C.METRICS_TOO_LARGE, "larger than the operator reads (1048576 bytes, --scrape-max-bytes)"),
    ("declared", C.METRICS_TOO_LARGE, "larger than the operator reads"),
    ("endless", C.METRICS_TOO_LARGE, "larger than the operator reads"),
    ("slow", C.METRICS_TIMEOUT, "did not finish within 2s (--scrape-timeout)"),
    ("garbage", C.METRICS_MALFORMED, "is not Prometheus text"),
    ("binary", C.METRICS_MALFORMED, "UnicodeDecodeError"),
    ("error", C.SCRAPE_FAILED, "answered HTTP 500"),
])
@pytest.mark.asyncio
async def test_a_hostile_body_is_cut_off_with_its_own_reason(rank0_server, mode: str, reason: str, words: str) -> None:
    server = rank0_server(mode)
    t0 = time.monotonic()
    got = await _scrape(server)
    took = time.monotonic() - t0
    assert got.metrics is None and got.reason == reason and words in (got.error or ""), got
    assert f"127.0.0.1:{server.port}/metrics" in (got.error or "")
    assert took < 2.0 + 5.0, took  # the time cap holds (slack for a loaded machine)
    if mode in ("big", "declared", "endless"):
        assert server.sent < Rank0Server.SIZE // 10, server.sent  # the rest was never read (socket buffers aside)


@pytest.mark.asyncio
async def test_a_good_body_is_parsed_in_the_parse_pool_not_on_the_event_loop(rank0_server, monkeypatch) -> None:
    threads: list[str] = []
    real = observe.parse_metrics

    def spy(text: str) -> dict[str, float]:
        threads.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(observe, "parse_metrics", spy)
    got = await _scrape(rank0_server("good"))
    assert got.metrics == {M.M_STEP: 7.0, M.M_LOSS: 2.5} and got.reason is None
    assert len(threads) == 1 and threads[0].startswith("kubetitan-parse"), threads


@pytest.mark.asyncio
async def test_scrapes_in_flight_are_bounded_and_a_waiter_gives_up_after_one_timeout(rank0_server) -> None:
    slow = rank0_server("slow")
    scraper = observe.Scraper(observe.ScrapeLimits(timeout=1.0, concurrency=1))
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            first, second = await asyncio.gather(scraper.scrape(session, "127.0.0.1", slow.port),
                                                 scraper.scrape(session, "127.0.0.1", slow.port))
    finally:
        scraper.close()
    assert first.reason == C.METRICS_TIMEOUT
    if second == observe.Scraped():  # the waiter got no slot within its timeout: nothing learnt, no error either
        assert slow.requests <= 1, slow.requests
    else:
        # Under load the first scrape's release (at its 1 s cap) can win the race with the waiter's own 1 s deadline
        # (seen under two CPU hogs): the waiter then scrapes, but only after the first one ended - never two at once.
        # (On a loaded machine the first scrape's cap can also run out before its request reached the server, so the
        # two requests' arrivals can be close together: what bounds the second is the first's 1 s cap, counted from
        # the start of both scrapes, not the first request's arrival.)
        assert second.reason == C.METRICS_TIMEOUT and slow.requests <= 2, (slow.requests, second)
        if slow.requests == 2:
            assert slow.request_times[1] - started >= 0.9, (started, slow.request_times)


@pytest.mark.parametrize(("body", "series"), [
    (b"", 0), (GOOD, 2), (b"# HELP a x\n# TYPE a gauge\na 1\n\na{b=\"1\"} 2", 2), (b"a 1\nb 2\n", 2),
], ids=["empty", "the-trainers-kind", "comments-blank-line-no-final-newline", "plain"])
def test_series_are_counted_without_parsing(body: bytes, series: int) -> None:
    assert observe.series_count(body) == series


@pytest.mark.asyncio
async def test_a_body_of_too_many_series_is_refused_unparsed_and_its_memory_returns(rank0_server, monkeypatch
                                                                                      ) -> None:
    """Just under 4 MiB of short lines (~240,000 series) is within the byte cap: its series are counted and it is
    refused before a single sample object is made (MetricsTooLarge; parsing it took ~4 s of one core and ~100 MB),
    the scrape's allocations peak at a few copies of the body, and none of it is kept afterwards."""
    import tracemalloc

    parsed: list[int] = []
    real = observe.parse_metrics
    monkeypatch.setattr(observe, "parse_metrics", lambda text: parsed.append(len(text)) or real(text))
    handed = []  # what the parse threads got: a refused body never goes there (a pool thread holds its task's
    decode = observe._decode_and_parse  # arguments until the thread drops it, after the scrape has returned)
    monkeypatch.setattr(observe, "_decode_and_parse", lambda body: handed.append(len(body)) or decode(body))
    server = rank0_server("series")
    # Only this thread's allocations count: the server answering in a thread of this process, and whatever threads
    # earlier tests of this worker left running, allocate concurrently (under load the server still held ~4 MB of
    # its answer when the scrape returned). Every other thread's stack starts in threading.py.
    main_thread_only = [tracemalloc.Filter(False, threading.__file__, all_frames=True)]
    tracemalloc.start(64)
    try:
        before_mem = tracemalloc.get_traced_memory()[0]
        before = tracemalloc.take_snapshot().filter_traces(main_thread_only)
        got = await _scrape(server, max_bytes=4 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
        after = tracemalloc.take_snapshot().filter_traces(main_thread_only)
    finally:
        tracemalloc.stop()
    assert got.metrics is None and got.reason == C.METRICS_TOO_LARGE, got
    assert "series, more than the operator parses (5000, --scrape-max-series)" in (got.error or ""), got
    assert not parsed and not handed
    assert peak - before_mem < 3 * len(SERIES_BODY) + (2 << 20), (peak - before_mem, len(SERIES_BODY))
    kept = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert kept < 1 << 20, (kept, after.compare_to(before, "lineno")[:5])


@pytest.mark.asyncio
async def test_a_free_scrape_slot_goes_to_the_run_whose_scrapes_cost_least() -> None:
    """Two runs whose rank 0 held a slot for whole timeouts queue before a cheap run: the slot freed next goes to
    the cheap run, then to the expensive ones in the order they asked (first come first served made the cheap run
    wait for both, past its own timeout: no scrape, its status a scrape interval behind)."""
    slots = observe.FairSlots(1)
    slots.cost.update({"hostile-1": 3.0, "hostile-2": 3.0, "cheap": 0.002})
    await slots.acquire("holder")
    order: list[str] = []

    async def scrape(key: str) -> None:
        await slots.acquire(key)
        order.append(key)
        slots.release()

    tasks = []
    for key in ("hostile-1", "hostile-2", "cheap", "new-run"):
        tasks.append(asyncio.create_task(scrape(key)))
        await asyncio.sleep(0)  # each is waiting before the next asks
    slots.release()
    await asyncio.gather(*tasks)
    assert order == ["new-run", "cheap", "hostile-1", "hostile-2"]  # a run never scraped costs nothing yet
    slots.forget("cheap")
    assert "cheap" not in slots.cost


@pytest.mark.asyncio
async def test_the_scraper_records_each_runs_cost(rank0_server) -> None:
    scraper = observe.Scraper(observe.ScrapeLimits(timeout=2.0))
    try:
        async with aiohttp.ClientSession() as session:
            got = await scraper.scrape(session, "127.0.0.1", rank0_server("good").port, key="run-uid")
    finally:
        scraper.close()
    assert got.metrics and 0 < scraper._slots.cost["run-uid"] < 2.0
    scraper.forget("run-uid")
    assert "run-uid" not in scraper._slots.cost


# ------------------------------------------------------------------------------------------- the real operator
def _events(c: Cluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in c.list(EVENTS, ns) if e.get("reason") == reason
            and (e.get("involvedObject") or {}).get("name") == name]


def test_refused_values_never_reach_the_status(cluster: Cluster, rank0) -> None:
    """Infinity, 1e18 and -7 from rank 0: a Warning Event names them, the status keeps the last good values (and
    the status write is accepted: the double refuses Infinity in JSON as the API server does)."""
    with Operator(cluster) as op:
        cluster.apply(lpt("rv", cpu_spec(nodes=1), metrics_port=rank0.port))
        wait_for(lambda: cluster.pod_names(NS, "rv") == ["rv-a0-0"], 20, "the pod")
        cluster.run_pod(NS, "rv-a0-0", "node-0")
        rank0.step(12, checkpoint=10)
        wait_for(lambda: (cluster.status(NS, "rv").get("training") or {}).get("step") == 12, 20, "step 12")
        rank0.set(M_TOKENS_PER_SECOND_PER_GPU=math.inf, M_STEP=1e18, M_LAST_CHECKPOINT_STEP=-7, M_LOSS=math.nan)
        ev = wait_for(lambda: _events(cluster, NS, "rv", C.METRICS_VALUE_REFUSED), 20, "the refusal Event")
        msg = ev[0]["message"]
        for part in ("kubetitan_trainer_step=1e+18", "kubetitan_trainer_tokens_per_second_per_gpu=inf",
                     "kubetitan_trainer_last_checkpoint_step=-7 (below 0)", "kubetitan_trainer_loss=nan"):
            assert part in msg, msg
        assert ev[0]["type"] == "Warning"
        wait_for(lambda: op.metric("kubetitan_operator_scraped_values_refused_total",
                                   {"metric": contract.M_STEP, "check": "range"}), 10, "the refusal counter")
        rank0.step(13, checkpoint=10)  # good values again: they go in
        t = wait_for(lambda: (tr := cluster.status(NS, "rv").get("training") or {}).get("step") == 13 and tr, 20,
                     "step 13")
        assert t["tokensPerSecondPerGpu"] == 1024.0 and t["lastCheckpointStep"] == 10 and t["loss"] == 2.5, t
        o = cluster.status(NS, "rv")["observation"]
        assert o["step"] == 13 and o["lastCheckpointStep"] == 10, o
        assert cluster.condition(NS, "rv", "MetricsAvailable")["status"] == "True"
        assert len(_events(cluster, NS, "rv", C.METRICS_VALUE_REFUSED)) == 1  # the same problem: one Event


OTHER_NS = "team-b"
HOSTILE = {"big": C.METRICS_TOO_LARGE, "declared": C.METRICS_TOO_LARGE, "endless": C.METRICS_TOO_LARGE,
           "slow": C.METRICS_TIMEOUT, "series": C.METRICS_TOO_LARGE}


def test_huge_and_never_ending_bodies_neither_bloat_nor_stall_the_operator(rank0_server, rank0) -> None:
    """Five runs whose rank 0 serves a 300 MB body, a 300 MB Content-Length, an endless fast stream, an endless
    trickle and ~290,000 series just under the 4 MiB cap, scraped every 0.5 s by the real operator process (default
    4 MiB and 5,000-series caps, 3 s timeout): each shows MetricsAvailable=False with its reason, the operator's
    peak RSS stays under 300 MiB, a healthy run in another namespace has every new step in its status within a few
    of its cycles all the while, and once the hostile runs are deleted the operator's RSS is back near where it
    was before they ran."""
    servers = {mode: rank0_server(mode) for mode in HOSTILE}
    with Cluster(namespaces=(OTHER_NS,)) as c, \
            OperatorProcess(c.kubeconfig, "--namespace", NS, "--namespace", OTHER_NS, "--scan-interval", "0.5",
                            "--scrape-interval", "0.5") as op:
        for mode, server in servers.items():
            c.apply(lpt(mode, cpu_spec(nodes=1), metrics_port=server.port))
        healthy = lpt("healthy", cpu_spec(nodes=1), metrics_port=rank0.port)
        healthy["metadata"]["namespace"] = OTHER_NS
        c.apply(healthy)
        wait_for(lambda: all(c.pod_names(NS, m) for m in HOSTILE) and c.pod_names(OTHER_NS, "healthy"), 30, "pods")
        before = op.memory_mb()["VmRSS"]  # every run reconciled once, none scraped yet
        rank0.step(1)
        for mode in HOSTILE:
            c.run_pod(NS, f"{mode}-a0-0", "node-0")
        c.run_pod(OTHER_NS, "healthy-a0-0", "node-1")
        latencies: list[float] = []
        step = 1
        # the healthy run trains on while every hostile rank 0 is scraped again and again (3 times at least)
        while len(latencies) < 5 or min(s.requests for s in servers.values()) < 3:
            assert len(latencies) < 60, {m: s.requests for m, s in servers.items()}
            step += 1
            rank0.step(step)
            t0 = time.monotonic()
            wait_for(lambda: (c.status(OTHER_NS, "healthy").get("training") or {}).get("step") == step, 15,
                     f"the healthy run's step {step} in its status")
            latencies.append(time.monotonic() - t0)
        for mode, reason in HOSTILE.items():
            cond = wait_for(lambda: (m := c.condition(NS, mode, "MetricsAvailable")) and m["status"] == "False" and m,
                            30, f"MetricsAvailable=False for {mode}")
            assert cond["reason"] == reason, (mode, cond)
        mem = op.memory_mb()
        assert c.condition(OTHER_NS, "healthy", "MetricsAvailable")["status"] == "True"
        for mode in HOSTILE:
            c.delete(LPT, NS, mode)
        wait_for(lambda: not any(c.lpt(NS, m) for m in HOSTILE), 30, "the hostile runs deleted")
        after = op.memory_mb()["VmRSS"]
        print(f"\noperator peak RSS {mem['VmHWM']:.0f} MiB (before the scrapes {before:.0f}, during {mem['VmRSS']:.0f}, "
              f"after the deletion {after:.0f}); healthy run's step reached its status after "
              f"{', '.join(f'{x:.2f}' for x in latencies)} s; bytes served per hostile run: "
              + ", ".join(f"{m} {s.sent / 2**20:.0f} MiB/{s.requests} scrapes" for m, s in servers.items()))
        assert mem["VmHWM"] < 300, mem
        assert after - before < 40, (before, after)
        assert sorted(latencies)[len(latencies) // 2] < 2.0, latencies  # a scrape interval (0.5 s) and a cycle


def test_the_scrape_flags_parse_and_nonsense_is_refused_with_the_fix(capsys) -> None:
    from support.fakes import operator_options as opts

    d = opts()
    assert (d.scrape_max_bytes, d.scrape_timeout, d.scrape_concurrency) == (4 * 2**20, 3.0, 8)
    o = opts("--scrape-max-bytes=65536", "--scrape-timeout=0.5", "--scrape-concurrency=2")
    assert (o.scrape_max_bytes, o.scrape_timeout, o.scrape_concurrency) == (65536, 0.5, 2)
    with pytest.raises(SystemExit):
        opts("--scrape-max-bytes=0")
    assert "'0' is not a whole number above 0 (e.g. 4194304)" in capsys.readouterr().err


def test_the_failure_reason_is_kept_in_the_observation_and_cleared_by_the_next_answer() -> None:
    from kubetitan.observation import tracking

    o = tracking.track(None, 0, NOW, scrape_error="GET x: too large", scrape_reason=C.METRICS_TOO_LARGE)
    assert (o.metrics_error, o.metrics_error_reason) == ("GET x: too large", C.METRICS_TOO_LARGE)
    o = tracking.track(o, 0, NOW + 1, metrics={M.M_STEP: 3.0})
    assert o.metrics_error is None and o.metrics_error_reason is None and o.step == 3
