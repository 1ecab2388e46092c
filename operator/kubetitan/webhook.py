"""The validating admission webhook: kopf serves it on every replica; :mod:`kubetitan.admission` decides.

``kubetitan operator --webhook-port 9443 --webhook-cert-file tls.crt --webhook-key-file tls.key`` serves
``POST /validate-llamapretrain`` over HTTPS with kopf's own server (``kopf.WebhookServer``); the chart's
``ValidatingWebhookConfiguration`` points the API server at it through a Service (docs/operator.md, "Admission
webhook"). The handler asks the API server the requester checks' SubjectAccessReviews for the request's
``userInfo`` (``--requester-checks``; concurrently, with the user's uid and extra, answers reused briefly:
:mod:`kubetitan.access_cache`), then returns :func:`kubetitan.admission.review`'s verdict: a refusal is a
``kopf.AdmissionError`` with the review's message and code, warnings go into kopf's ``warnings`` list.

Callers (:mod:`kubetitan.webhook_guard`): reviews are read up to 7 MiB (sized from the API server's own request
limit), a request needing more than ``admission.MAX_ACCESS_CHECKS`` SubjectAccessReviews is refused before any is
asked, the reviews the cache cannot answer are charged to the caller's budget (per source address and per
(source, username); over it: 429), and with ``--webhook-client-ca-file`` only a caller presenting a certificate
of that CA (the API server's) gets past the TLS handshake.

Certificates: the files given (cert-manager's Secret, mounted), or with ``--webhook-certificates
operator`` the operator's own, issued, rotated and served by :mod:`kubetitan.certsync`.

Without ``--webhook-port`` no server runs (kopf is given one that never listens), and the operator's reconcile
alone refuses invalid specs, as before.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kubetitan import admission, certs, certsync, webhook_config, webhook_guard
from kubetitan.access_cache import AccessCache, Answer, CacheConfig, key
from kubetitan.webhook_guard import RateConfig, RateLimiter
from kubetitan_core import GROUP, PLURAL, VERSION

log = logging.getLogger("kubetitan.webhook")

WEBHOOK_ID = "validate-llamapretrain"
"""kopf handler id, and the URL path the ValidatingWebhookConfiguration calls (``/validate-llamapretrain``)."""
SAR_PATH = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


@dataclass(frozen=True)
class WebhookOptions:
    port: int | None = None
    """Port of the HTTPS webhook server (None: no webhook)."""
    addr: str = "0.0.0.0"
    cert_file: str | None = None
    key_file: str | None = None
    requester: admission.Requester = admission.Requester.REFERENCES
    cert_check_seconds: float = 60.0
    """How often the certificate files are re-read: a renewed pair (cert-manager renews the Secret, the kubelet swaps
    it into the mount) is served from then on without a restart (kopf restarts its server)."""
    access_cache: CacheConfig = CacheConfig()
    """How long the requester checks' SubjectAccessReview answers are reused (kubetitan.access_cache)."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    """The access cache's clock (tests advance a fake one instead of sleeping)."""
    rate: RateConfig = RateConfig()
    """The per-caller budget of SubjectAccessReviews (kubetitan.webhook_guard)."""
    client_ca_file: str | None = None
    """Require a client certificate signed by this CA (the API server's, where it is configured to present one)."""
    client_names: tuple[str, ...] = ()
    """With ``client_ca_file``: the certificate's common or DNS name must be one of these (none: any)."""
    certificates: certsync.CertSync | None = None
    """``--webhook-certificates operator``: the operator issues, rotates and serves its own pair (kubetitan.certsync;
    ``cert_file``/``key_file`` are then the files it writes). None: serve the files given (cert-manager's Secret,
    mounted)."""


def _add_certificate_flags(p: argparse.ArgumentParser) -> None:
    """Who issues the serving certificate and where the API server dials (Service or URL)."""
    p.add_argument("--webhook-certificates", choices=["files", "operator"], default="files",
                   help="files (default): serve --webhook-cert-file/--webhook-key-file (cert-manager's Secret, "
                        "mounted); operator: issue a self-signed CA and serving certificate into "
                        "--webhook-secret, keep --webhook-configuration's caBundle, rotate both before they expire")
    p.add_argument("--webhook-secret", metavar="NS/NAME",
                   help="operator certificates: the Secret holding the CA and pair (the chart ships it empty)")
    p.add_argument("--webhook-configuration", metavar="NAME",
                   help="operator certificates: the ValidatingWebhookConfiguration whose caBundle the operator keeps")
    p.add_argument("--webhook-configuration-webhooks", metavar="JSON",
                   help="operator certificates: the configuration's webhooks as the chart renders them (a JSON list); "
                        "every field but caBundle is restored to these when it drifts, with a Warning Event")
    p.add_argument("--webhook-service", metavar="NS/NAME",
                   help="operator certificates: the webhook's Service (the certificate's DNS names)")
    p.add_argument("--webhook-url", metavar="URL",
                   help="operator certificates, out of cluster (the chart's webhook.url): the https URL the API "
                        "server calls instead of the Service; the certificate is issued for its host (a DNS name or "
                        "an IP address). Exclusive with --webhook-service")
    p.add_argument("--webhook-cert-dir", metavar="DIR", default=None,
                   help="operator certificates: where the served pair is written (default: a new private temporary "
                        "directory; the chart sets an in-memory emptyDir)")
    p.add_argument("--webhook-cert-days", type=int, default=certs.CertPolicy.cert_days, metavar="D",
                   help="operator certificates: serving certificate lifetime, re-issued in its last third "
                        "(default %(default)s)")
    p.add_argument("--webhook-ca-days", type=int, default=certs.CertPolicy.ca_days, metavar="D",
                   help="operator certificates: CA lifetime, a new CA in its last third (default %(default)s)")
    p.add_argument("--webhook-cert-check-seconds", type=float, default=60.0, metavar="S",
                   help="re-read the certificate files this often and serve a renewed pair without a restart "
                        "(default 60)")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--webhook-port", type=int, default=None, metavar="PORT",
                   help="serve the validating admission webhook over HTTPS on this port (default: no webhook; the "
                        "chart sets 9443)")
    p.add_argument("--webhook-addr", default="0.0.0.0", metavar="ADDR", help="address the webhook listens on")
    p.add_argument("--webhook-cert-file", metavar="FILE", help="the webhook's serving certificate (PEM)")
    p.add_argument("--webhook-key-file", metavar="FILE", help="its private key (PEM)")
    _add_certificate_flags(p)
    p.add_argument("--requester-checks", choices=[m.value for m in admission.Requester],
                   default=admission.Requester.REFERENCES.value,
                   help="what the requesting user must be allowed herself for the Secrets, ConfigMaps, claims, "
                        "service account and priority class a spec references (docs/install.md, 'Trust model'): "
                        "off, podCreate (create pods in the namespace) or references (each one; the default)")
    p.add_argument("--requester-cache-allowed-seconds", type=float, default=CacheConfig.allowed_seconds,
                   metavar="S", help="reuse an allowed SubjectAccessReview answer of the same user and access this "
                   "long: the longest a revoked permission is still honoured (default %(default)s; 0: never)")
    p.add_argument("--requester-cache-denied-seconds", type=float, default=CacheConfig.denied_seconds,
                   metavar="S", help="reuse a denied answer this long: the longest a new grant is still refused "
                   "(default %(default)s; 0: never)")
    p.add_argument("--webhook-rate-user-per-second", type=float, default=RateConfig.user_per_second, metavar="R",
                   help="SubjectAccessReviews (not answered from the cache) a second per requesting user and source "
                        "address; a review that would exceed it is refused with 429 (default %(default)s)")
    p.add_argument("--webhook-rate-user-burst", type=int, default=RateConfig.user_burst, metavar="N",
                   help=f"... in bursts of up to N (at least {admission.MAX_ACCESS_CHECKS}; default %(default)s)")
    p.add_argument("--webhook-rate-source-per-second", type=float, default=RateConfig.source_per_second,
                   metavar="R", help="the same per source address, every user it sends together (default "
                                     "%(default)s)")
    p.add_argument("--webhook-rate-source-burst", type=int, default=RateConfig.source_burst, metavar="N",
                   help=f"... in bursts of up to N (at least {admission.MAX_ACCESS_CHECKS}; default %(default)s)")
    p.add_argument("--webhook-rate-max-callers", type=int, default=RateConfig.max_callers, metavar="N",
                   help="rate buckets kept per kind, least recently used dropped first (default %(default)s)")
    p.add_argument("--webhook-client-ca-file", metavar="FILE", default=None,
                   help="require callers to present a client certificate signed by this CA (PEM): the API server's, "
                        "where its AdmissionConfiguration gives it one for this webhook (docs/install.md)")
    p.add_argument("--webhook-client-names", metavar="NAME,...", default="",
                   help="with --webhook-client-ca-file: the certificate's common name or a DNS name must be one of "
                        "these (default: any the CA signed)")
    p.add_argument("--requester-cache-max-entries", type=int, default=CacheConfig.max_entries, metavar="N",
                   help="the most answers kept, least recently used dropped first (default %(default)s; 0: no cache)")


def _ns_name(flag: str, value: str | None) -> tuple[str, str]:
    ns, _, name = (value or "").rpartition("/")
    if not ns or not name:
        raise SystemExit(f"error: --webhook-certificates operator needs {flag} NAMESPACE/NAME (the chart sets it)")
    return ns, name


def _server_names(a: argparse.Namespace) -> tuple[str, ...]:
    if a.webhook_url and a.webhook_service:
        raise SystemExit("error: give --webhook-service (in cluster) or --webhook-url (out of cluster), not both")
    if a.webhook_url:
        if not a.webhook_url.startswith("https://"):
            raise SystemExit(f"error: --webhook-url {a.webhook_url!r} must be an https:// URL (the API server calls "
                             "webhooks over HTTPS only)")
        try:
            return certsync.url_names(a.webhook_url)
        except ValueError as e:
            raise SystemExit(f"error: --webhook-url: {e}") from None
    return certsync.service_dns_names(*_ns_name("--webhook-service", a.webhook_service))


def _cert_sync(a: argparse.Namespace) -> certsync.CertSync:
    secret_ns, secret = _ns_name("--webhook-secret", a.webhook_secret)
    names = _server_names(a)
    if not a.webhook_configuration:
        raise SystemExit("error: --webhook-certificates operator needs --webhook-configuration NAME (the chart sets it)")
    if not a.webhook_configuration_webhooks:
        raise SystemExit("error: --webhook-certificates operator needs --webhook-configuration-webhooks JSON (the "
                         "chart sets it: the webhooks it renders into the configuration, which the operator keeps)")
    try:
        hooks = webhook_config.parse(a.webhook_configuration_webhooks)
    except ValueError as e:
        raise SystemExit(f"error: --webhook-configuration-webhooks {e} (the chart renders it; re-install or upgrade "
                         "the release)") from None
    policy = certs.CertPolicy(cert_days=a.webhook_cert_days, ca_days=a.webhook_ca_days)
    if problems := policy.problems():
        raise SystemExit("error: " + "; ".join(problems))
    cert_dir = a.webhook_cert_dir or tempfile.mkdtemp(prefix="kubetitan-webhook-")
    return certsync.CertSync(secret_ns, secret, a.webhook_configuration, names,
                             cert_dir, policy, interval=a.webhook_cert_check_seconds, webhooks=hooks)


def from_args(a: argparse.Namespace) -> WebhookOptions:
    sync = _cert_sync(a) if a.webhook_port is not None and a.webhook_certificates == "operator" else None
    if a.webhook_port is not None and sync is None and not (a.webhook_cert_file and a.webhook_key_file):
        raise SystemExit("error: --webhook-port needs --webhook-cert-file and --webhook-key-file (the chart mounts "
                         "them from its webhook Secret), or --webhook-certificates operator; the API server calls "
                         "webhooks over HTTPS only")
    rate = RateConfig(user_per_second=a.webhook_rate_user_per_second, user_burst=a.webhook_rate_user_burst,
                      source_per_second=a.webhook_rate_source_per_second, source_burst=a.webhook_rate_source_burst,
                      max_callers=a.webhook_rate_max_callers)
    if problems := rate.problems(admission.MAX_ACCESS_CHECKS):
        raise SystemExit("error: " + "; ".join(problems))
    names = tuple(n.strip() for n in a.webhook_client_names.split(",") if n.strip())
    if names and not a.webhook_client_ca_file:
        raise SystemExit("error: --webhook-client-names needs --webhook-client-ca-file (the CA that signs the API "
                         "server's client certificate)")
    return WebhookOptions(port=a.webhook_port, addr=a.webhook_addr, rate=rate,
                          client_ca_file=a.webhook_client_ca_file, client_names=names,
                          cert_file=sync.cert_file if sync else a.webhook_cert_file,
                          key_file=sync.key_file if sync else a.webhook_key_file, certificates=sync, requester=admission.Requester(a.requester_checks),
                          cert_check_seconds=a.webhook_cert_check_seconds,
                          access_cache=CacheConfig(allowed_seconds=a.requester_cache_allowed_seconds,
                                                   denied_seconds=a.requester_cache_denied_seconds,
                                                   max_entries=a.requester_cache_max_entries))


async def _no_server(_fn: Any) -> AsyncIterator[Any]:
    """kopf refuses to start with admission handlers and no server: without ``--webhook-port``, one that never
    listens (and never yields a client configuration)."""
    await asyncio.Event().wait()
    yield  # pragma: no cover - never reached


class _RefusalsAreNotErrors(logging.Filter):
    """kopf logs a refused admission as an ERROR of the object ("Webhook ... failed permanently"); a refusal is the
    answer to a user's mistake, which the user gets from the API server. The operator logs it at INFO instead
    (``validate_llamapretrain``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(f"Webhook {WEBHOOK_ID!r} failed permanently")


_REFUSAL_FILTER = _RefusalsAreNotErrors()


def configure(settings: kopf.OperatorSettings, options: WebhookOptions | None,
              client: Any = None) -> asyncio.Task[None] | None:
    """Give kopf its webhook server (at start-up); with operator certificates, start keeping them
    (kubetitan.certsync; the task is returned for the cleanup to cancel) and serve once the first pair is written.

    The chart ships the ValidatingWebhookConfiguration itself, so kopf manages none (``settings.admission.managed``
    unset): kopf's managed mode rewrites the whole configuration from the handlers (no matchConditions, its own
    names) and each replica would write its own self-signed certificate into it, while every replica here serves
    one pair from the Secret; the operator keeps the caBundle, and restores the chart's webhooks
    (``kubetitan.webhook_config``)."""
    logging.getLogger("kopf.objects").addFilter(_REFUSAL_FILTER)  # a set: adding it again is a no-op
    if options is None or options.port is None:
        settings.admission.server = _no_server
        return None
    server = webhook_guard.server(options.addr, options.port, options.cert_file, options.key_file,
                                  options.cert_check_seconds, options.client_ca_file, options.client_names,
                                  options.clock)
    if options.certificates is None:
        settings.admission.server = server
        return None
    ready = asyncio.Event()

    async def serve_when_ready(fn: Any) -> AsyncIterator[Any]:
        await ready.wait()
        async for client_config in server(fn):
            yield client_config

    settings.admission.server = serve_when_ready
    return asyncio.create_task(certsync.run(client, options.certificates, ready), name="webhook certificates")


async def _ask(client: Any, check: admission.Access, user: Mapping[str, Any]) -> tuple[Answer, bool]:
    """One SubjectAccessReview: (True, or why not; whether the answer may be cached). A review that failed
    refuses with the API's error and is never cached. Not fenced: a SubjectAccessReview stores nothing, and every
    replica (a standby too) answers admission requests."""
    try:
        out = await client._call("authorization.k8s.io", "subjectaccessreviews", "create", "POST", SAR_PATH,
                                 check.sar(user), fenced=False)
    except Exception as e:  # noqa: BLE001 - an unanswerable check refuses, with the reason
        return f"the SubjectAccessReview failed: {e}", False
    status = (out or {}).get("status") or {}
    if status.get("allowed"):
        return True, True
    if status.get("evaluationError") and not status.get("denied"):
        return f"the SubjectAccessReview could not be evaluated: {status['evaluationError']}", False
    return status.get("reason") or "denied", True


def access_cache(ctx: Any, opts: WebhookOptions) -> AccessCache:
    """The operator's SubjectAccessReview cache (one per replica; a new one when its configuration changed)."""
    cache = getattr(ctx, "access_cache", None)
    if cache is None or cache.config != opts.access_cache or cache.clock is not opts.clock:
        cache = ctx.access_cache = AccessCache(opts.access_cache, opts.clock)
    return cache


def refusal_log(ctx: Any, opts: WebhookOptions) -> webhook_guard.Aggregated:
    """The replica's refused-review log line: at most one per ``LOG_EVERY_SECONDS``, the rest counted into it."""
    agg = getattr(ctx, "webhook_refusals", None)
    if agg is None or agg.clock is not opts.clock:
        agg = ctx.webhook_refusals = webhook_guard.Aggregated(log, logging.INFO, webhook_guard.LOG_EVERY_SECONDS,
                                                              opts.clock)
    return agg


def rate_limiter(ctx: Any, opts: WebhookOptions) -> RateLimiter:
    """The replica's per-caller budget of SubjectAccessReviews (a new one when its configuration changed)."""
    limiter = getattr(ctx, "webhook_rate", None)
    if limiter is None or limiter.config != opts.rate or limiter.clock is not opts.clock:
        limiter = ctx.webhook_rate = RateLimiter(opts.rate, opts.clock)
    return limiter


def _charge(ctx: Any, opts: WebhookOptions, checks: list[admission.Access], user: Mapping[str, Any]
            ) -> webhook_guard.Refusal | None:
    """Charge the SubjectAccessReviews this review would send (the checks the cache cannot answer) to its caller."""
    cache = access_cache(ctx, opts)
    asks = sum(1 for c in checks if cache.lookup(key(c, user)) is None)
    caller = webhook_guard.CALLER.get() or webhook_guard.Caller("unknown")
    return rate_limiter(ctx, opts).charge(caller.source, str(user.get("username", "")), asks)


async def answers_for(ctx: Any, opts: WebhookOptions, checks: list[admission.Access], user: Mapping[str, Any]
                      ) -> dict[admission.Access, Answer]:
    """Every check's answer: cached ones at once, the others asked concurrently (one request each)."""
    cache = access_cache(ctx, opts)
    results = await asyncio.gather(*(cache.get(c, user, lambda c=c: _ask(ctx.client, c, user)) for c in checks))
    return dict(zip(checks, results))


def _name(obj: Mapping[str, Any] | None) -> str:
    meta = (obj or {}).get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name') or meta.get('generateName')}"


@kopf.on.validate(GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])
async def validate_llamapretrain(new: Any, old: Any, operation: str, userinfo: Mapping[str, Any],
                                 warnings: list[str], memo: Any, **_: Any) -> None:
    ctx = memo["ctx"] if isinstance(memo, Mapping) else memo.ctx
    opts: WebhookOptions = ctx.options.webhook or WebhookOptions()
    obj = dict(new) if new is not None else None
    was = dict(old) if old is not None else None
    answers: dict[admission.Access, bool | str] = {}
    if obj is not None:
        checks = admission.access_checks(obj, was, operation, opts.requester)
        if 0 < len(checks) <= admission.MAX_ACCESS_CHECKS:  # more: review refuses without asking any
            if (refusal := _charge(ctx, opts, checks, userinfo)) is not None:
                refusal_log(ctx, opts).log("Refused %s of LlamaPretrain %s by %s for now: %s", operation,
                                           _name(obj), userinfo.get("username"), refusal)
                raise kopf.AdmissionError(f"the admission webhook answers the requester checks of this request "
                                          f"later: {refusal}", code=429)
            answers = await answers_for(ctx, opts, checks, userinfo)
    verdict = admission.review(obj, was, operation, ctx.options.policy, opts.requester, answers)
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        refusal_log(ctx, opts).log("Refused %s of LlamaPretrain %s by %s: %s", operation, _name(obj or was or {}),
                                   userinfo.get("username"), "; ".join(verdict.errors))
        raise kopf.AdmissionError(verdict.message, code=verdict.code)
