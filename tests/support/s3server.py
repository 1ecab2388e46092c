"""The S3 tests' fixtures and what they start: a real S3-compatible server (moto's server mode) and a fault-injecting
proxy. tests/s3/conftest.py imports the fixtures (a conftest holds fixtures only).

The server runs from its own venv (``.tools/moto-venv``, built by ``make moto``, part of ``make setup``), so its
botocore and python-dateutil pins stay out of the project's venv. Nothing here mocks the S3 client: the trainer's
``s3torchconnector`` client talks HTTP to the server (or to the proxy in front of it). Faults come from the proxy:
moto 5.2.5's ``/moto-api`` offers no fault injection for S3 (its state transitions, recorder and batch/lambda
settings only).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kmockx.harness import free_port  # the tests' one port allocator
from support.procs import die_with_parent

REPO = Path(__file__).resolve().parents[2]  # tests/support/s3server.py -> the repository
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
"""moto accepts any credentials; the CRT client still signs, so it needs some (never real ones)."""


def _moto_server() -> str:
    found = shutil.which("moto_server") or str(REPO / ".tools" / "bin" / "moto_server")
    if not os.access(found, os.X_OK):
        pytest.fail("moto_server not found: run `make setup` (its `moto` target builds .tools/moto-venv)")
    return found


@dataclass
class S3Server:
    endpoint: str
    pid: int
    log: Path

    def create_bucket(self, name: str | None = None) -> str:
        """A new bucket (moto's server takes an unsigned PUT); returns its name."""
        name = name or f"kt-{uuid.uuid4().hex[:12]}"
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200, r.status
        return name


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll the server's HTTP endpoint until it answers (the event), failing early if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"moto_server did not answer {url} within {timeout} s")


def start_server(port: int, log: Path) -> tuple[subprocess.Popen, S3Server]:
    """Start moto's S3 server on 127.0.0.1:``port`` (its output appended to ``log``) and wait until it answers."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([_moto_server(), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/moto-api/", proc, timeout=60)
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc, S3Server(endpoint=f"http://127.0.0.1:{port}", pid=proc.pid, log=log)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 (a port from the tests' allocator); killed by its PID at the end."""
    proc, server = start_server(free_port(), tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Test credentials in the environment (the CRT client's default credential chain reads them)."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return dict(CREDENTIALS)


@pytest.fixture
def bucket(s3_server) -> str:
    return s3_server.create_bucket()


# ---------------------------------------------------------------------------------------------- fault proxy
@dataclass
class Fault:
    """Answer the first ``count`` requests matching ``method`` (and ``path_contains``) with ``kind``:
    ``"503"`` (S3's SlowDown), ``"reset"`` (the connection is dropped without an answer), ``"slow"`` (the
    answer is held back ``delay`` seconds, then forwarded), ``"hold"`` (never forwarded: ``held`` is set and the
    request waits until the proxy is closed, as a save stuck in a network partition) or ``"pause"`` (``held`` is set
    and the request waits until ``release`` is set, then goes on as any other: a test acts while a request is in
    flight). A request the upstream server does not accept (it is down) has its connection dropped, as the server's
    own would be."""

    kind: str
    method: str
    count: int
    path_contains: str = ""
    delay: float = 0.0
    hits: int = 0
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class FaultProxy:
    endpoint: str
    upstream: str
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    """(method, path, status or -1 for a reset) of every request that reached the proxy."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    injected: list[Fault] = field(default_factory=list)
    """Every fault ever injected (a paused request is released when the proxy closes)."""

    def inject(self, kind: str, method: str, count: int, path_contains: str = "", delay: float = 0.0) -> Fault:
        f = Fault(kind, method, count, path_contains, delay)
        with self.lock:
            self.faults.append(f)
            self.injected.append(f)
        return f

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def _match(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.method == method and f.path_contains in path and f.hits < f.count:
                    f.hits += 1
                    return f
        return None


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>kt-proxy</RequestId></Error>')
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@pytest.fixture
def fault_proxy(s3_server):
    """An aiohttp reverse proxy on 127.0.0.1 in front of the S3 server that injects :class:`Fault` s."""
    import aiohttp
    from aiohttp import web
    from yarl import URL

    proxy = FaultProxy(endpoint="", upstream=s3_server.endpoint)
    started = threading.Event()
    port = free_port()
    state: dict = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = proxy._match(request.method, request.path)
        if fault is not None and fault.kind == "hold":
            proxy.requests.append((request.method, request.path, 0))
            fault.held.set()
            await state["closing"].wait()
            return web.Response(status=503, body=SLOW_DOWN, content_type="application/xml")
        if fault is not None and fault.kind == "pause":
            fault.held.set()
            await asyncio.get_running_loop().run_in_executor(None, fault.release.wait)
        if fault is not None and fault.kind == "reset":
            proxy.requests.append((request.method, request.path, -1))
            request.transport.abort()  # RST: the client sees the connection drop mid-request
            raise ConnectionResetError("injected reset")
        if fault is not None and fault.kind == "503":
            proxy.requests.append((request.method, request.path, 503))
            return web.Response(status=503, body=SLOW_DOWN, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            up_cm = state["session"].request(request.method, URL(proxy.upstream + request.raw_path, encoded=True),
                                             headers=headers, data=body or None, allow_redirects=False,
                                             auto_decompress=False)
            up = await up_cm.__aenter__()
        except aiohttp.ClientConnectionError:  # the server is down: the client sees its connection dropped
            proxy.requests.append((request.method, request.path, -1))
            request.transport.abort()
            raise ConnectionResetError("upstream down") from None
        try:
            payload = await up.read()
            if fault is not None and fault.kind == "slow":
                await asyncio.sleep(fault.delay)
            proxy.requests.append((request.method, request.path, up.status))
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if request.method == "HEAD":
                resp = web.Response(status=up.status, headers=out)
                return resp
            out.pop("Content-Length", None)
            return web.Response(status=up.status, headers=out, body=payload)
        finally:
            await up_cm.__aexit__(None, None, None)

    def run() -> None:
        async def serve() -> None:
            state["closing"], state["stop"] = asyncio.Event(), asyncio.Event()
            state["session"] = aiohttp.ClientSession(skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.set()
            await state["stop"].wait()
            await runner.cleanup()
            await state["session"].close()

        # asyncio.Runner: what serve() leaves running is cancelled and ended before the loop closes (no task is left
        # for a later test's garbage collection to finalise: tests/kmockx/harness.py, Cluster._main)
        with asyncio.Runner() as loop_runner:
            state["loop"] = loop_runner.get_loop()
            loop_runner.run(serve())

    t = threading.Thread(target=run, name="s3-fault-proxy", daemon=True)
    t.start()
    assert started.wait(30), "fault proxy did not start"
    proxy.endpoint = f"http://127.0.0.1:{port}"
    yield proxy
    for f in proxy.injected:
        f.release.set()
    state["loop"].call_soon_threadsafe(state["closing"].set)
    state["loop"].call_soon_threadsafe(state["stop"].set)
    t.join(timeout=30)
