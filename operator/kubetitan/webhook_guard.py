"""Who may drive the admission webhook, and how much: request size, per-caller rate limits, client certificates.

Any pod that reaches the webhook's port can POST an AdmissionReview, and each review may make the operator ask the
API server SubjectAccessReviews (the requester checks), whose answers say which user may read which Secret. So:

- **Size**: a review is read up to :data:`MAX_REVIEW_BYTES`, sized from the API server's own request limit (an
  UPDATE carries the object and the old object, each up to :data:`API_SERVER_MAX_BODY_BYTES`, in one envelope);
  a larger body is answered 413 before it is read.
- **Access checks per review**: at most ``admission.MAX_ACCESS_CHECKS`` SubjectAccessReviews; a spec that needs
  more is refused before any is asked (``admission.review``).
- **Rate**: the SubjectAccessReviews a review would send (answers not in the access cache) are charged to two token
  buckets, the caller's source address and (source, username); a review that would overdraw either is refused
  with 429 and the time to wait, and asks nothing (:class:`RateLimiter`; the buckets are kept for at most
  :attr:`RateConfig.max_callers` callers each, least recently used dropped first).
- **Malformed requests**: a body that is not an AdmissionReview kopf can decide is answered 400 with the reason
  (kopf answered 500 and aiohttp logged a traceback for each); such requests, and refused reviews, are logged at
  most once per :data:`LOG_EVERY_SECONDS`, with the count of those in between (:class:`Aggregated`).
- **Client certificates** (``--webhook-client-ca-file``): where the API server is configured to present a client
  certificate to webhooks (its AdmissionConfiguration's ``kubeConfigFile``), the TLS handshake requires one signed
  by that CA, and ``--webhook-client-names`` narrows it to the certificate's common or DNS names; every other
  caller is turned away before it can send a byte of a review.

:class:`GuardedServer` is kopf's ``WebhookServer`` with the size limit, the client-name check and the caller
(:data:`CALLER`, read by the handler) added; the rest is kopf's.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kopf

log = logging.getLogger("kubetitan.webhook")

API_SERVER_MAX_BODY_BYTES = 3 * 1024 * 1024
"""The API server's limit on one request body (kube-apiserver's ``MaxRequestBodyBytes``, 3 MiB): no object it
admits is larger."""
REVIEW_ENVELOPE_BYTES = 1024 * 1024
"""Room for the rest of an AdmissionReview: the request's metadata, ``userInfo`` and options, and the JSON the API
server writes around (and into, e.g. ``managedFields``) the objects."""
MAX_REVIEW_BYTES = 2 * API_SERVER_MAX_BODY_BYTES + REVIEW_ENVELOPE_BYTES
"""The largest AdmissionReview body read (7 MiB): an UPDATE's object and old object, each as large as the API
server admits, and the envelope."""


@dataclass(frozen=True)
class RateConfig:
    """SubjectAccessReviews (not answered from the access cache) the webhook sends per caller: a token bucket per
    source address and per (source, username)."""

    user_per_second: float = 10.0
    """Refill rate of a (source, username) bucket."""
    user_burst: int = 128
    """Its size: two reviews at the per-review cap. At least ``admission.MAX_ACCESS_CHECKS``."""
    source_per_second: float = 50.0
    """Refill rate of a source address's bucket (every user the API server forwards shares it)."""
    source_burst: int = 512
    """Its size. At least ``admission.MAX_ACCESS_CHECKS``."""
    max_callers: int = 4096
    """Buckets kept per kind (least recently used dropped first): the memory bound."""

    def problems(self, per_review: int) -> list[str]:
        out = []
        for name, rate, burst in (("user", self.user_per_second, self.user_burst),
                                  ("source", self.source_per_second, self.source_burst)):
            if not rate > 0:
                out.append(f"--webhook-rate-{name}-per-second must be > 0 (got {rate})")
            if burst < per_review:
                out.append(f"--webhook-rate-{name}-burst must be at least {per_review}, the access checks one review "
                           f"may need (got {burst})")
        if self.max_callers < 1:
            out.append(f"--webhook-rate-max-callers must be at least 1 (got {self.max_callers})")
        return out


class _Buckets:
    """Token buckets by key, least recently used dropped beyond ``size`` (a dropped caller starts full again)."""

    def __init__(self, per_second: float, burst: int, size: int) -> None:
        self.per_second, self.burst, self.size = per_second, burst, size
        self._b: OrderedDict[Any, tuple[float, float]] = OrderedDict()

    def wait(self, key: Any, n: int, now: float) -> float:
        """Seconds until ``n`` tokens are there (0: now)."""
        tokens, then = self._b.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.per_second)
        self._b[key] = (tokens, now)
        while len(self._b) > self.size:
            self._b.popitem(last=False)
        return 0.0 if tokens >= n else (n - tokens) / self.per_second

    def take(self, key: Any, n: int) -> None:
        tokens, now = self._b[key]
        self._b[key] = (tokens - n, now)

    def __len__(self) -> int:
        return len(self._b)


@dataclass(frozen=True)
class Refusal:
    """Why a caller may not have its access checks now."""

    who: str
    per_second: float
    burst: int
    retry_after: float

    def __str__(self) -> str:
        return (f"{self.who} may have {self.per_second:g} SubjectAccessReviews a second asked for it (bursts of "
                f"{self.burst}); retry in {math.ceil(self.retry_after * 10) / 10:g} s")


class RateLimiter:
    """The per-caller budget of SubjectAccessReviews (:class:`RateConfig`), on an injectable clock."""

    def __init__(self, config: RateConfig, clock: Callable[[], float]) -> None:
        self.config, self.clock = config, clock
        self.users = _Buckets(config.user_per_second, config.user_burst, config.max_callers)
        self.sources = _Buckets(config.source_per_second, config.source_burst, config.max_callers)

    def charge(self, source: str, user: str, n: int) -> Refusal | None:
        """Take ``n`` from both of the caller's buckets, or nothing and the refusal when either is short."""
        if n <= 0:
            return None
        now = self.clock()
        c = self.config
        waits = [(self.sources.wait(source, n, now), f"source {source}", c.source_per_second, c.source_burst),
                 (self.users.wait((source, user), n, now), f"user {user!r} from {source}", c.user_per_second,
                  c.user_burst)]
        wait, who, rate, burst = max(waits, key=lambda w: w[0])
        if wait > 0:
            return Refusal(who, rate, burst, wait)
        self.sources.take(source, n)
        self.users.take((source, user), n)
        return None


@dataclass(frozen=True)
class Caller:
    """Who sent the review being answered: the peer address and, with client certificates, the names of its
    verified certificate."""

    source: str
    names: tuple[str, ...] = ()


CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("kubetitan_webhook_caller", default=None)
"""Set by :class:`GuardedServer` around each review; the kopf handler runs in the same context."""


def cert_names(peercert: Any) -> tuple[str, ...]:
    """The common names and DNS names of a verified peer certificate (``ssl.SSLSocket.getpeercert()``)."""
    if not isinstance(peercert, dict):
        return ()
    cns = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    dns = [v for k, v in peercert.get("subjectAltName", ()) if k == "DNS"]
    return tuple(cns + dns)


class Aggregated:
    """One log line per ``every`` seconds; the lines that came in between are counted into the next one, so a burst
    (1,211 refused reviews, a flood of garbage) costs one line per window instead of one per request."""

    def __init__(self, logger: logging.Logger, level: int, every: float, clock: Callable[[], float]) -> None:
        self.logger, self.level, self.every, self.clock = logger, level, every, clock
        self.last: float | None = None
        self.held = 0

    def log(self, msg: str, *args: Any) -> bool:
        """Log now (True), or count it into the next line."""
        now = self.clock()
        if self.last is not None and now - self.last < self.every:
            self.held += 1
            return False
        if self.held:
            msg += f" (and {self.held} more like it in the {now - (self.last or now):.0f} s before)"
        self.logger.log(self.level, msg, *args)
        self.last, self.held = now, 0
        return True


LOG_EVERY_SECONDS = 10.0
"""The most often a refused or malformed review is logged (:class:`Aggregated`)."""


def review_problem(data: Any) -> str | None:
    """What makes ``data`` not an AdmissionReview kopf can decide (None: it is one). The API server never sends
    such a body; anyone else who reaches the port may, and gets 400 with this reason instead of kopf's 500."""
    if not isinstance(data, dict):
        return f"the body is a JSON {type(data).__name__}, not an AdmissionReview object"
    req = data.get("request")
    if not isinstance(req, dict):
        return "request is missing or not an object"
    for key in ("uid", "operation"):
        if not isinstance(req.get(key), str):
            return f"request.{key} is missing or not a string"
    for key in ("userInfo", "kind", "resource"):
        if not isinstance(req.get(key), dict):
            return f"request.{key} is missing or not an object"
    new, old = req.get("object"), req.get("oldObject")
    if not isinstance(new, (dict, type(None))) or not isinstance(old, (dict, type(None))) or new is old is None:
        return "request.object and request.oldObject must be objects or null, and one of them an object"
    return None


class GuardedServer(kopf.WebhookServer):
    """kopf's webhook server, reading bodies up to :data:`MAX_REVIEW_BYTES` (aiohttp's default is 1 MiB), and with
    ``client_names`` a verified client certificate of one of those names required (kopf's ``verify_cafile`` with
    ``verify_mode=ssl.CERT_REQUIRED`` makes the handshake require a certificate of that CA: :func:`server`)."""

    def __init__(self, *args: Any, client_names: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client_names = client_names
        self.malformed = Aggregated(log, logging.WARNING, LOG_EVERY_SECONDS, clock)

    async def _serve(self, fn: Any, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:  # type: ignore[override]
        if request.content_length is not None and request.content_length > MAX_REVIEW_BYTES:
            raise aiohttp.web.HTTPRequestEntityTooLarge(max_size=MAX_REVIEW_BYTES,
                                                        actual_size=request.content_length)
        peercert = request.transport.get_extra_info("peercert") if request.transport else None
        names = cert_names(peercert)
        if self.client_names and not set(names) & set(self.client_names):
            raise aiohttp.web.HTTPForbidden(reason="client certificate not among --webhook-client-names")
        request = request.clone(client_max_size=MAX_REVIEW_BYTES)
        try:
            why = review_problem(json.loads(await request.text()))
        except ValueError as e:  # not JSON, or not UTF-8
            why = f"the body is not JSON: {e}"
        if why is not None:
            self.malformed.log("Answered 400 to a request from %s that is not an AdmissionReview: %s",
                               request.remote, why)
            raise aiohttp.web.HTTPBadRequest(reason=why)
        token = CALLER.set(Caller(request.remote or "unknown", names))
        try:
            return await kopf.WebhookServer._serve(fn, request)  # reads the body aiohttp keeps, again
        finally:
            CALLER.reset(token)


def server(addr: str, port: int, cert_file: str | None, key_file: str | None, check_seconds: float,
           client_ca_file: str | None = None, client_names: tuple[str, ...] = (),
           clock: Callable[[], float] = time.monotonic) -> GuardedServer:
    """The webhook's HTTPS server; with ``client_ca_file``, only callers presenting a certificate it signed (and,
    with ``client_names``, of one of those names) get past the handshake."""
    verify: dict[str, Any] = {}
    if client_ca_file:
        verify = {"verify_cafile": client_ca_file, "verify_mode": ssl.CERT_REQUIRED}
    return GuardedServer(addr=addr, port=port, certfile=cert_file, pkeyfile=key_file, file_check_interval=check_seconds,
                         client_names=client_names, clock=clock, **verify)
