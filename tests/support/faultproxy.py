"""A fault-injecting proxy in front of the real kube-apiserver (tests/cluster).

The real API server answers what it answers; the faults a production API server also gives (429 with Retry-After
under API Priority and Fairness, 503 while it restarts, a quota's 403 or Pod Security's 422 on a create, watches that
drop or expire) come from this proxy instead of the double: a client (the operator) is pointed at it with a
kubeconfig of its own (:meth:`FaultProxy.kubeconfig`) and everything else is forwarded to the server unchanged,
its credentials included (a bearer token: the proxy terminates TLS with a serving certificate of the cluster's CA,
so the client's trust is the same).

- :meth:`inject` adds a :class:`kmockx.Fault` (the double's: verbs, resource, namespace, name, count, rate with a
  seeded RNG, Retry-After, message), picked and answered as the double picks and answers them
  (:func:`kmockx.pick_fault`, :func:`kmockx.fault_answer`);
- :meth:`drop_watches` ends every open watch as a dropped connection does (the stream is cut);
  :meth:`expire_watches` sends each one the ``ERROR`` event a compacted resourceVersion gives (410 ``Expired``) and
  ends it;
- :attr:`log`: one :class:`Entry` per request (verb, resource, namespace, path, the HTTP code the client got, whether a fault
  answered it, and for a create the kind and name its body gives).

It runs on its own event loop in a thread (aiohttp server and client); watches are forwarded line by line, so an
event is never cut in two.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
from multidict import CIMultiDict

from kmockx import Fault, fault_answer, make_fault, pick_fault

_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
                  "content-encoding", "upgrade"})
"""Headers that describe one hop's connection or body encoding: never forwarded either way (aiohttp's client
decompresses and its server frames the body anew)."""
EXPIRED = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                       "message": "too old resource version (compacted)", "reason": "Expired",
                                       "code": 410}}
"""What kube-apiserver sends an open watch whose resourceVersion was compacted away, before it ends the stream."""


@dataclass
class Entry:
    """One request through the proxy."""
    id: int
    verb: str
    resource: str | None
    namespace: str | None
    path: str
    code: int
    fault: bool
    created: str | None = None  # "Kind/name" of a create's body

    def __str__(self) -> str:
        return f"{self.id} {self.verb} {self.path} -> {self.code}{' (injected)' if self.fault else ''}"


def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str | None, str | None, str | None]:
    """(verb, resource with its subresource, namespace, name) of a request, as the API server's request info names
    them; resource None for discovery, /version and /openapi (never faulted)."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        return "get", None, None, None
    if not rest:
        return "get", None, None, None
    ns = None
    if rest[0] == "namespaces" and len(rest) >= 2 and (len(rest) == 2 or rest[2] in ("status", "finalize")):
        ns = rest[1]  # a Namespace itself (or its status/finalize): the API server names it as its own namespace
    elif len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest:
        return "get", None, None, None
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    resource = plural + (f"/{sub}" if sub else "")
    if method in ("GET", "HEAD"):
        verb = "watch" if query.get("watch") in ("1", "true") else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
    return verb, resource, ns, name


def _created(body: bytes) -> str | None:
    """"Kind/name" of a create's JSON body; None for a body that is not a JSON object (protobuf, garbage)."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


class FaultProxy:
    """``with FaultProxy(server, ca_file, serving_cert) as proxy:`` ... ``proxy.url`` (see the module docstring)."""

    def __init__(self, upstream: str, ca_file: Path, serving: tuple[Path, Path], seed: int = 7) -> None:
        self.upstream, self.ca_file, self.serving = upstream.rstrip("/"), ca_file, serving
        self.faults: list[Fault] = []
        self.log: list[Entry] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._watches: dict[int, tuple[aiohttp.ClientResponse, list[str], str]] = {}  # with the resource
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._runner: aiohttp.web.AppRunner | None = None
        self.url = ""

    # ---------------------------------------------------------------------------------------------- the test's side
    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self.url = self._call(self._start())
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()

    def inject(self, **kw: Any) -> Fault:
        """Add a :class:`kmockx.Fault` (its fields as keywords; ``verbs`` any iterable) and return it."""
        if kw.get("hang") or kw.get("user") is not None:
            raise ValueError("the proxy serves one client and answers every request: no `hang`, no `user` "
                             "(the double has both)")
        fault = make_fault(**kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def end(self, fault: Fault) -> None:
        """``fault`` answers nothing more (what it answered so far stays counted in ``hits``)."""
        with self._lock:
            fault.count = fault.hits

    def drop_watches(self) -> list[str]:
        """Cut every open watch (as a dropped connection); the resources they watched."""
        return self._call(self._cut("drop"))

    def expire_watches(self) -> list[str]:
        """Send every open watch the 410 ``Expired`` event and end it; the resources they watched."""
        return self._call(self._cut("expire"))

    def entries(self, since: int = 0) -> list[Entry]:
        with self._lock:
            return list(self.log[since:])

    def kubeconfig(self, src: Path, dst: Path) -> Path:
        """A copy of the kubeconfig ``src`` (tests/support/cluster.py writes them as JSON) whose server is the proxy."""
        cfg = json.loads(src.read_text())
        for c in cfg["clusters"]:
            c["cluster"]["server"] = self.url
        dst.write_text(json.dumps(cfg, indent=1))
        dst.chmod(0o600)
        return dst

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # ------------------------------------------------------------------------------------------- the proxy's side
    async def _start(self) -> str:
        client_ssl = ssl.create_default_context(cafile=str(self.ca_file))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=client_ssl, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=None), auto_decompress=True)
        server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ssl.load_cert_chain(str(self.serving[0]), str(self.serving[1]))
        app = aiohttp.web.Application(client_max_size=4 << 20)  # the API server's own 3 MiB, and some
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # a client that leaves ends its handler (a watch it no longer reads is closed upstream too)
        self._runner = aiohttp.web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=server_ssl)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"https://127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self._cut("drop")
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _cut(self, how: str) -> list[str]:
        watches = list(self._watches.values())
        for up, why, _ in watches:
            why.append(how)
            up.close()
        return sorted(resource for _, _, resource in watches)

    def _record(self, verb: str, resource: str | None, ns: str | None, path: str, code: int, fault: bool,
                created: str | None) -> None:
        with self._lock:
            self.log.append(Entry(len(self.log), verb, resource, ns, path, code, fault, created))

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.read()
        verb, resource, ns, name = classify(request.method, request.path, dict(request.query))
        created = _created(body) if verb == "create" else None
        if resource is not None:
            with self._lock:
                fault = pick_fault(self.faults, self._rng, verb, resource, ns, name, "",
                                   request.headers.get("User-Agent", ""))
            if fault is not None:
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                if fault.code:
                    self._record(verb, resource, ns, request.path_qs, fault.code, True, created)
                    return fault_answer(fault, verb, resource)
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)  # repeats kept
        try:
            up = await self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                             data=body or None, allow_redirects=False)
        except (aiohttp.ClientError, OSError) as e:  # the API server is down (restarting): the client's connection ends
            self._record(verb, resource, ns, request.path_qs, 0, False, created)
            if request.transport is not None:
                request.transport.abort()
            return aiohttp.web.Response(status=503, text=f"upstream {self.upstream}: {e}")  # (never sent)
        out_headers = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in _HOP)
        if verb != "watch" or up.status != 200:
            self._record(verb, resource, ns, request.path_qs, up.status, False, created)
            async with up:
                data = await up.read()
            return aiohttp.web.Response(status=up.status, body=data, headers=out_headers)
        return await self._stream_watch(request, up, out_headers, resource or "",
                                        lambda: self._record(verb, resource, ns, request.path_qs, 200, False, None))

    async def _stream_watch(self, request: aiohttp.web.Request, up: aiohttp.ClientResponse, headers: CIMultiDict,
                            resource: str, record: Any) -> aiohttp.web.StreamResponse:
        resp = aiohttp.web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        why: list[str] = []
        key = id(up)
        self._watches[key] = (up, why, resource)
        record()  # (after the stream is registered: a test that saw this entry can cut it)
        try:
            async for line in up.content:  # one event a line
                await resp.write(line)
        except (aiohttp.ClientError, ConnectionError):
            if not why:  # the API server ended it (a restart): so does the client's stream
                if request.transport is not None:
                    request.transport.abort()
                return resp
        finally:
            self._watches.pop(key, None)
            up.close()
        if why and why[0] == "drop":
            if request.transport is not None:
                request.transport.abort()  # cut: the client sees the connection end mid-stream
            return resp
        if why:  # expire
            await resp.write(json.dumps(EXPIRED).encode() + b"\n")
        await resp.write_eof()
        return resp
