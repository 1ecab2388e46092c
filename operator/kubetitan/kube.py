"""The operator's Kubernetes client: the `kubernetes` package's configuration and credentials, aiohttp requests.

Why this client: kopf has no public one, and the ``kubernetes`` package is already a dependency and
handles every way of logging in (kubeconfig, in-cluster service account with token rotation, exec
plugins). It loads the configuration and produces the credentials; the requests themselves are aiohttp
calls on the operator's event loop (see ``Client``), with plain dict bodies and raw JSON responses.
Every call names its (apiGroup, resource, verb) and is refused unless ``rbac.RULES`` lists it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import email.utils
import itertools
import json
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kubernetes
from kubernetes.client.exceptions import ApiException

from kubetitan_core import GROUP, PLURAL, VERSION
from kubetitan import __version__, rbac
from kubetitan.plan import POD_GROUP_API_VERSION, Prepared
from kubetitan.slots import PrioritySlots

log = logging.getLogger("kubetitan.kube")


AUTH_REFRESH_SECONDS = 30.0


POD_GROUP_GROUP = POD_GROUP_API_VERSION.partition("/")[0]
CHILD_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("", "pods"), "ConfigMap": ("", "configmaps"), "Service": ("", "services"), "Event": ("", "events"),
    "PodGroup": (POD_GROUP_GROUP, "podgroups"),
}
"""The kinds :meth:`Client.create` creates: kind -> (API group, resource)."""


class NotAllowed(RuntimeError):
    """A call that ``rbac.RULES`` does not list (a bug: add the rule or drop the call)."""


class ClientClosed(RuntimeError):
    """A call made after :meth:`Client.aclose` (the operator is stopping): nothing was sent."""


class RequestTimeout(TimeoutError):
    """The API did not answer a request within the client's timeout (on its last attempt): the API server, or an
    admission webhook it calls, is slow or unreachable. A write may still have been stored (the server may finish
    what the client gave up on)."""

    def __init__(self, method: str, path: str, seconds: float, attempts: int = 1) -> None:
        self.method, self.path, self.seconds, self.attempts = method, path, seconds, attempts
        super().__init__(f"{method} {path}: no answer within {seconds:g} s")

    def explain(self) -> str:
        """What the status and Events say: how long, how often, and where to look."""
        tries = f" on each of {self.attempts} attempts" if self.attempts > 1 else ""
        return (f"no answer within {self.seconds:g} s{tries} (the API server, or an admission webhook it calls, is "
                "slow or unreachable; the API server's and webhooks' logs say which)")


# ------------------------------------------------------------------ the one error policy
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers that say "not now": retried with capped exponential backoff (429 honours Retry-After)."""
WRITE_VERBS = frozenset({"create", "update", "patch", "delete"})
"""Verbs that change the cluster: sent only while this replica holds the leader Lease (``Client.fence``)."""


class ApiError(ApiException):
    """An API answer that is not success, with the server's own reason and message (its ``Status`` object)."""

    def __init__(self, status: int, method: str, path: str, raw: bytes = b"", retry_after: float | None = None):
        self.method, self.path, self.retry_after = method, path, retry_after
        self.api_reason, self.api_message = "", raw[:500].decode(errors="replace")
        try:
            st = json.loads(raw) if raw else {}
            if isinstance(st, dict) and st.get("kind") == "Status":
                self.api_reason, self.api_message = st.get("reason") or "", st.get("message") or self.api_message
        except ValueError:
            pass
        super().__init__(status=status, reason=f"{method} {path}: {status} {self.api_reason}: {self.api_message}")

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE_STATUSES


class NameConflict(ApiError):
    """A create found the name taken by an object that is not ours (another owner, or none): never touched."""

    def __init__(self, kind: str, ns: str | None, name: str, owners: list[str]):
        self.kind, self.name = kind, name
        who = f"owned by {', '.join(owners)}" if owners else "not owned by this LlamaPretrain"
        super().__init__(409, "POST", f"{kind} {ns}/{name}")
        self.api_reason = "AlreadyExists"
        self.api_message = (f"a {kind} named {name} already exists in namespace {ns} and is {who}; the operator "
                            "leaves it alone: delete or rename it, or rename the LlamaPretrain")
        self.reason = self.api_message


def classify(e: BaseException) -> str:
    """The condition reason for an error the API gave on a create: Forbidden, Invalid, NameConflict, APITimeout (no
    answer in time) or APIUnavailable (5xx, 429, connection errors after the retries)."""
    if isinstance(e, NameConflict):
        return "NameConflict"
    if isinstance(e, RequestTimeout):
        return "APITimeout"
    if isinstance(e, ApiException):
        if e.status == 403:
            return "Forbidden"
        if e.status in (400, 422):
            return "Invalid"
    return "APIUnavailable"


def transient(e: BaseException) -> bool:
    """The API was unavailable (429/5xx, a timeout, a dropped connection) after the client's retries: the next cycle
    tries again; not a reconcile error (no traceback, no ``reconcile_errors_total``)."""
    import aiohttp

    if isinstance(e, ApiError):
        return e.retryable
    return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError))


def message_of(e: BaseException) -> str:
    """The API's own message (what was wrong), for conditions and Events; for a timeout, how long it waited."""
    if isinstance(e, ApiError):
        return e.api_message or str(e)
    if isinstance(e, RequestTimeout):
        return e.explain()
    return f"{e.__class__.__name__}: {e}"


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter (AWS architecture blog "Exponential Backoff And Jitter");
    a server's ``Retry-After`` is honoured instead (see :meth:`delay`)."""

    attempts: int = 6
    base_seconds: float = 0.2
    cap_seconds: float = 10.0

    def delay(self, n: int, retry_after: float | None = None) -> float:
        """Seconds before retry ``n`` (0-based).

        With a ``Retry-After`` (seconds, already parsed: :func:`retry_after_seconds`) the retry waits exactly that
        long, as client-go does (``rest/with_retry.go``: it sleeps the ``Retry-After`` and adds no jitter), capped at
        ``cap_seconds`` (a header asking for an hour does not park a reconcile for an hour: the request is tried
        again after the cap and, if still refused, fails to the caller, which backs off on its own). No jitter on
        top: the requests one overload refused together do come back together, but they come back through the
        client's request slots (:class:`Slots`, 16 in flight at most), so the herd reaches the server at the
        client's steady rate, not at once; a jitter only made every refused request later (up to 0.2 s per
        retry, a pod refused 4 times in a row ~0.4 s later on average). Without one: full jitter.
        """
        if retry_after is not None:
            return min(self.cap_seconds, max(0.0, retry_after))
        return random.uniform(0, min(self.cap_seconds, self.base_seconds * (2 ** n)))


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's value in seconds from ``now`` (epoch seconds; default the current time), or None.

    RFC 9110 section 10.2.3 allows two forms: delay-seconds (``"120"``; the API server sends ``"1"`` with its 429s)
    and an HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``: the seconds until then, 0 if it has passed). Anything
    else (empty, negative, garbage) is None: the client's own backoff applies. The cap is the caller's
    (:meth:`RetryPolicy.delay`).
    """
    if value is None:
        return None
    v = value.strip()
    if v.replace(".", "", 1).isdigit():  # delay-seconds (a decimal fraction tolerated)
        return float(v)
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110: an HTTP-date is always GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Slots(PrioritySlots):
    """The client's request slots: at most ``n`` requests in flight, granted oldest call first.

    An ``asyncio.Semaphore`` grants its slots in the order the waiters asked, so a retry (after its backoff or its
    ``Retry-After``, waited out holding no slot) queued behind every request asked for since: with a 1,024-pod gang
    that is up to ~1,000 first-time creates, ~1 s of queue on top of each ``Retry-After``. Here each call takes a
    ticket when it starts (:meth:`ticket`) and every attempt of it asks with that ticket as its priority; a free
    slot goes to the smallest ticket waiting, so a retry keeps the place its call had (ahead of the calls that
    started after it) and a call told to come back in 1 s is sent 1 s later, not 1 s plus the queue. First attempts
    are still granted in the order they asked (tickets increase).
    """

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self._tickets = itertools.count()

    def ticket(self) -> int:
        """A call's place in the queue (taken once per call, kept by its retries)."""
        return next(self._tickets)

    @contextlib.asynccontextmanager
    async def slot(self, ticket: int) -> AsyncIterator[None]:
        """Hold one slot for the block; wait (by ``ticket``) while none is free."""
        await self.acquire(ticket)
        try:
            yield
        finally:
            self.release()


async def _backoff_sleep(seconds: float, cause: str) -> None:
    """The wait before a retry; ``cause`` as in ``Client.retries`` (one name, so that a test can record the waits
    asked for instead of sleeping)."""
    await asyncio.sleep(seconds)


RETRY_WAIT: contextvars.ContextVar[Callable[[bool], None] | None] = contextvars.ContextVar(
    "kubetitan_kube_retry_wait", default=None)
"""Told ``True`` when a call made in this context starts waiting before a retry (a 429/5xx, with or without
``Retry-After``, a timeout, a dropped connection: the server has given no verdict on the request yet) and ``False``
when the wait is over. ``fanout.slow_start`` sets it for each create it starts (it lends a waiting create's place
in its window to the next one); None (the default): nobody listens."""


async def _wait_to_retry(seconds: float, cause: str) -> None:
    """:func:`_backoff_sleep`, told to ``RETRY_WAIT``'s listener (if any) as it starts and ends."""
    note = RETRY_WAIT.get()
    if note is not None:
        note(True)
    try:
        await _backoff_sleep(seconds, cause)
    finally:
        if note is not None:
            note(False)


def _retry_after(headers: Any) -> float | None:
    return retry_after_seconds(headers.get("Retry-After") if headers is not None else None)


def load_config(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster config when running in a pod, else the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``)."""
    cfg = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            return cfg
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return cfg


class Client:
    """Async calls the operator makes. ``calls`` counts them by (group, resource, verb) for the RBAC test.

    Requests go through one aiohttp session on the operator's event loop (like kopf's own calls); the
    ``kubernetes`` package is kept for what it is good at: loading the configuration and producing the
    current credentials (``Configuration.auth_settings()`` runs its refresh hook, which re-reads a rotated
    service-account token or re-runs an exec plugin when the token expires). The earlier version sent
    every call through ``kubernetes.ApiClient`` in a thread pool: ~1.7 ms of CPU per call against ~0.7 ms
    here (bench/operator_bench.py), which mattered once hundreds of runs were created at once.

    ``concurrency`` (default 16) caps the requests in flight, across all runs: a 1,024-pod gang is 16 creates at
    a time, not 1,024. The API server admits requests by priority and fairness: the operator's service account
    shares its priority level's seats with every other controller's, so a bounded share keeps a large gang's
    creation from crowding them out (and a 429 from APF is the server saying the share is too big), while at a
    real API server's ~10-30 ms per create 16 in flight still make 500 or more creates a second. A request
    waiting out a retry's backoff or ``Retry-After`` holds no slot, and when it is due it is sent ahead of the
    calls that started after it (:class:`Slots`: oldest call first). The leader Lease's calls take no slot (one at a
    time, and a renewal must not wait behind slow writes).
    """

    def __init__(self, cfg: kubernetes.client.Configuration, concurrency: int = 16,
                 retry: RetryPolicy | None = None, timeout_seconds: float = 30.0, user_agent: str | None = None,
                 fence: Any = None) -> None:
        self.cfg = cfg
        self.user_agent = user_agent or f"kubetitan-operator/{__version__}"
        """Sent with every request (the API server's audit log and the test double's request log show it)."""
        self.fence = fence
        """The leader fence (``leader.LeaderElector``): every write calls ``fence.check()`` before it is sent (and
        before each retry) and is awaited through ``fence.hold()`` (abandoned if the Lease could expire while it is in
        flight). None: no election."""
        self.retry = retry or RetryPolicy()
        self.timeout_seconds = timeout_seconds
        self.retries: dict[str, int] = {}
        """Retries by cause (HTTP status or exception name), for tests and logs."""
        self.host = cfg.host.rstrip("/")
        self.limit = Slots(concurrency)
        self.session: Any = None
        self.closed = False
        self.calls: dict[tuple[str, str, str], int] = {}
        self._auth_headers: dict[str, str] | None = None
        self._auth_at = 0.0

    def _ssl(self) -> Any:
        if not self.host.startswith("https"):
            return None
        if not self.cfg.verify_ssl:
            return False
        ctx = ssl.create_default_context(cafile=self.cfg.ssl_ca_cert)
        if self.cfg.cert_file:
            ctx.load_cert_chain(self.cfg.cert_file, self.cfg.key_file)
        return ctx

    def _auth(self) -> dict[str, str]:
        """Credential headers, refreshed every ``AUTH_REFRESH_SECONDS`` and after a 401.

        ``auth_settings()`` runs the configuration's refresh hook, which for a kubeconfig re-reads the
        whole user entry (~1 ms; it was a fifth of the operator's CPU with 500 runs). Tokens live for
        minutes to hours and the API server answers 401 to a stale one, so a short cache is safe.
        """
        now = time.monotonic()
        if self._auth_headers is not None and now - self._auth_at < AUTH_REFRESH_SECONDS:
            return self._auth_headers
        headers = {}
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        if self.cfg.username and self.cfg.password:
            headers["authorization"] = self.cfg.get_basic_auth_token()
        self._auth_headers, self._auth_at = headers, now
        return headers

    async def aclose(self) -> None:
        self.closed = True
        if self.session is not None:
            await self.session.close()
            self.session = None

    # long: one request's whole error policy in one place (fence, slots, retry with Retry-After, classification)
    async def _call(self, group: str, resource: str, verb: str, method: str, path: str,
                    body: Any = None, query: list[tuple[str, Any]] | None = None,
                    content_type: str = "application/json", fenced: bool = True, retries: bool = True,
                    timeout: float | None = None, decode: bool = True) -> dict[str, Any] | None:
        """One API call under the error policy; the JSON body (``decode=False``: ``{}``, the answer unread), or None
        for 404 (get/delete). A ``plan.Prepared`` body is sent as its own text (serialised once for the gang).

        429, 5xx, timeouts and connection errors are retried (``self.retry``; ``retries=False``: sent once);
        401 refreshes the credentials once; anything else raises :class:`ApiError` with the server's reason and
        message. A write (``fenced``, the default; only the leader Lease's own calls are not) is refused with
        ``leader.NotLeader`` before each attempt while this replica may not write. ``resource`` empty: API discovery
        (``verb`` get), which every authenticated user may read (the ``system:discovery`` role), no RBAC row.
        """
        import aiohttp

        write = verb in WRITE_VERBS and fenced

        if not (resource == "" and verb == "get" and path.startswith("/apis/")) and \
                not rbac.allowed(group, resource, verb):
            raise NotAllowed(f"{verb} {group or 'core'}/{resource} is not in kubetitan.rbac.RULES")
        self.calls[(group, resource, verb)] = self.calls.get((group, resource, verb), 0) + 1
        if self.closed:
            raise ClientClosed(f"{method} {path}: the client is closed (the operator is stopping)")
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_seconds), proxy=self.cfg.proxy or None)
        data = None if body is None else body.text if isinstance(body, Prepared) else \
            json.dumps(body, separators=(",", ":"))
        refreshed = False
        n = 0
        attempts = self.retry.attempts if retries else 1
        seconds = self.timeout_seconds if timeout is None else timeout
        # the leader Lease's calls take no request slot: a renewal must never wait behind a gang's creates (16 slow
        # ones hold every slot for as long as an admission webhook takes) or it misses its deadline mid-reconcile
        lease = group == "coordination.k8s.io" and resource == "leases"
        place = self.limit.ticket()  # kept by every attempt: a retry is sent ahead of the calls started after it
        while True:
            headers = {"Content-Type": content_type, "Accept": "application/json", "User-Agent": self.user_agent,
                       **self._auth()}
            try:
                async with contextlib.nullcontext() if lease else self.limit.slot(place):
                    if self.closed:  # closed while this call waited for a slot or a retry's backoff
                        raise ClientClosed(f"{method} {path}: the client is closed (the operator is stopping)")
                    if write and self.fence is not None:
                        self.fence.check()  # raises NotLeader: nothing is sent
                        # started within the fence, it may run for its whole timeout while the Lease is renewed
                        status, raw, retry_after = await self.fence.hold(
                            self._send(method, path, query, data, headers, seconds))
                    else:
                        status, raw, retry_after = await self._send(method, path, query, data, headers, seconds)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
                if n + 1 >= attempts:
                    if isinstance(e, RequestTimeout):
                        e.attempts = n + 1
                    raise
                self.retries[type(e).__name__] = self.retries.get(type(e).__name__, 0) + 1
                log.debug("Retrying %s %s (attempt %d of %d) after %s", method, path, n + 2, attempts,
                          type(e).__name__)
                await _wait_to_retry(self.retry.delay(n), type(e).__name__)
                n += 1
                continue
            if status == 401 and not refreshed and self._auth_headers is not None:
                self._auth_headers, refreshed = None, True  # a rotated token: refresh the credentials, once
                continue
            if status in RETRYABLE_STATUSES and n + 1 < attempts:
                self.retries[str(status)] = self.retries.get(str(status), 0) + 1
                log.debug("Retrying %s %s (attempt %d of %d) after %d", method, path, n + 2, attempts, status)
                await _wait_to_retry(self.retry.delay(n, retry_after), str(status))
                n += 1
                continue
            break
        if status == 404 and verb in ("get", "delete"):
            return None
        if not 200 <= status < 300:
            raise ApiError(status, method, path, raw, retry_after)
        return json.loads(raw) if raw and decode else {}

    async def _send(self, method: str, path: str, query: list[tuple[str, Any]] | None, data: str | None,
                    headers: dict[str, str], seconds: float) -> tuple[int, bytes, float | None]:
        """One request: its status, body and ``Retry-After``; :class:`RequestTimeout` when no answer came in time."""
        import aiohttp

        try:
            async with self.session.request(method, self.host + path, params=query or None, data=data, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=seconds)) as r:
                return r.status, await r.read(), _retry_after(r.headers)
        except TimeoutError as e:
            raise RequestTimeout(method, path, seconds) from e

    # ---- helpers (paths follow the API conventions)
    @staticmethod
    def _core(ns: str | None, resource: str, name: str | None = None) -> str:
        p = f"/api/v1/namespaces/{ns}/{resource}" if ns else f"/api/v1/{resource}"
        return f"{p}/{name}" if name else p

    @staticmethod
    def _path(api_version: str, ns: str | None, resource: str, name: str | None = None) -> str:
        """The REST path of a namespaced resource of any group (``v1``: the core group)."""
        if api_version == "v1":
            return Client._core(ns, resource, name)
        p = f"/apis/{api_version}/namespaces/{ns}/{resource}"
        return f"{p}/{name}" if name else p

    async def create(self, obj: dict[str, Any], fenced: bool = True) -> bool:
        """Create a child (``CHILD_KINDS``): True when created, False when it already exists *and is ours*.

        On 409 the existing object is read: if its owner references do not name the owner ``obj`` names,
        :class:`NameConflict` is raised and the object is left alone. ``fenced=False``: sent whether or not this
        replica leads (an Event about the webhook configuration, which every replica keeps).
        """
        group, resource = CHILD_KINDS[obj["kind"]]
        api_version = obj.get("apiVersion") or "v1"
        meta = obj["metadata"]
        ns = meta["namespace"]
        path = self._path(api_version, ns, resource)
        try:  # the created object comes back whole (~3 KiB for a pod): not decoded, nothing reads it
            await self._call(group, resource, "create", "POST", path, obj, fenced=fenced, decode=False)
            return True
        except ApiError as e:
            if e.status != 409:
                raise
        existing = await self._call(group, resource, "get", "GET", self._path(api_version, ns, resource, meta["name"]))
        if existing is None:  # gone again in between: one more create
            await self._call(group, resource, "create", "POST", path, obj, fenced=fenced, decode=False)
            return True
        want = {r.get("uid") for r in meta.get("ownerReferences") or []}
        have = [r for r in (existing.get("metadata") or {}).get("ownerReferences") or []]
        if want and not want & {r.get("uid") for r in have}:
            raise NameConflict(obj["kind"], ns, meta["name"], [f"{r.get('kind')}/{r.get('name')}" for r in have])
        return False

    async def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        return await self._call("", resource, "get", "GET", self._core(ns, resource, name))

    async def patch(self, resource: str, ns: str, name: str, patch: dict[str, Any], fenced: bool = True
                    ) -> dict[str, Any] | None:
        return await self._call("", resource, "patch", "PATCH", self._core(ns, resource, name), patch,
                                content_type="application/merge-patch+json", fenced=fenced)

    async def delete_pod(self, ns: str, name: str, grace_seconds: int | None = None) -> bool:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        return await self._call("", "pods", "delete", "DELETE", self._core(ns, "pods", name), body) is not None

    async def delete_pod_group(self, ns: str, name: str) -> bool:
        """Delete an attempt's PodGroup (``plan.pod_group``); False when it was gone already. The API server's
        PodGroup protection keeps it until its pods have terminated."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        path = self._path(POD_GROUP_API_VERSION, ns, "podgroups", name)
        return await self._call(POD_GROUP_GROUP, "podgroups", "delete", "DELETE", path, body) is not None

    async def api_resources(self, api_version: str) -> frozenset[str] | None:
        """The resource names the server serves in ``api_version`` (a group's ``group/version``), from API discovery;
        None when it serves no such group version (404)."""
        out = await self._call("", "", "get", "GET", f"/apis/{api_version}", retries=False)
        if out is None:
            return None
        return frozenset(str(r.get("name")) for r in out.get("resources") or [] if isinstance(r, dict))

    async def patch_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}/status"
        return await self._call(GROUP, f"{PLURAL}/status", "patch", "PATCH", path, {"status": status},
                                content_type="application/merge-patch+json")

    async def get_run(self, ns: str, name: str) -> dict[str, Any] | None:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}"
        return await self._call(GROUP, PLURAL, "get", "GET", path)

    async def list_pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        out = await self._call("", "pods", "list", "GET", self._core(ns, "pods"), query=[("labelSelector", selector)])
        return list((out or {}).get("items") or [])

    async def delete_run(self, ns: str, name: str) -> bool:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}"
        return await self._call(GROUP, PLURAL, "delete", "DELETE", path,
                                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
                                ) is not None

    # ---- the leader Lease (coordination.k8s.io/v1): never fenced (it is how a replica gets the right to write)
    @staticmethod
    def _lease_path(ns: str, name: str | None = None) -> str:
        p = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        return f"{p}/{name}" if name else p

    async def get_lease(self, ns: str, name: str, timeout: float | None = None) -> dict[str, Any] | None:
        return await self._call("coordination.k8s.io", "leases", "get", "GET", self._lease_path(ns, name),
                                retries=False, timeout=timeout)

    async def create_lease(self, ns: str, lease: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        out = await self._call("coordination.k8s.io", "leases", "create", "POST", self._lease_path(ns), lease,
                               fenced=False, retries=False, timeout=timeout)
        return out or {}

    async def update_lease(self, ns: str, name: str, lease: dict[str, Any], timeout: float | None = None
                           ) -> dict[str, Any]:
        """PUT with the read ``metadata.resourceVersion``: 409 Conflict when another replica wrote it meanwhile."""
        out = await self._call("coordination.k8s.io", "leases", "update", "PUT", self._lease_path(ns, name), lease,
                               fenced=False, retries=False, timeout=timeout)
        return out or {}

    # ---- kopf's own requests
    def kopf_session(self) -> Any:
        """An aiohttp session for kopf's own API calls (``kopf.AiohttpSession`` from ``@kopf.on.login``): the same
        credentials (refreshed like this client's), this client's User-Agent, and the same fence: kopf's writes
        (finalizers, its bookkeeping in ``status.kopf``, Events) are refused while this replica may not write,
        as a ``FencedWrite`` error that kopf neither retries nor turns into a pause."""
        import aiohttp

        async def middleware(req: Any, handler: Any) -> Any:
            for k, v in self._auth().items():
                req.headers[k] = v
            req.headers["User-Agent"] = self.user_agent
            if req.method in ("POST", "PUT", "PATCH", "DELETE") and self.fence is not None:
                try:
                    self.fence.check()
                except Exception as e:
                    raise FencedWrite(req.request_info, (), status=503, message=str(e)) from e
            return await handler(req)

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=0),
                                     middlewares=(middleware,), proxy=self.cfg.proxy or None)


class FencedWrite(aiohttp.ClientResponseError):
    """A write kopf tried while this replica does not hold the leader Lease: not sent (kopf does not retry a
    ``ClientResponseError``; it logs it, and the leader does the same work)."""
