"""The validating admission webhook: kopf serves it on every replica; :mod:`kubetitan.admission` decides.

``kubetitan operator --webhook-port 9443 --webhook-cert-file tls.crt --webhook-key-file tls.key`` serves
``POST /validate-llamapretrain`` over HTTPS with kopf's own server (``kopf.WebhookServer``); the chart's
``ValidatingWebhookConfiguration`` points the API server at it through a Service (docs/operator.md, "Admission
webhook"). The handler asks the API server the requester checks' SubjectAccessReviews for the request's
``userInfo`` (``--requester-checks``), then returns :func:`kubetitan.admission.review`'s verdict: a refusal is a
``kopf.AdmissionError`` with the review's message and code, warnings go into kopf's ``warnings`` list.

Without ``--webhook-port`` no server runs (kopf is given one that never listens), and the operator's reconcile
alone refuses invalid specs, as before.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kubetitan import admission
from kubetitan.access_cache import AccessCache, Answer, CacheConfig
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
    """How often the certificate files are re-read: a renewed pair (cert-manager, or a new helm Secret, which the
    kubelet swaps into the mount) is served from then on without a restart (kopf restarts its server)."""
    access_cache: CacheConfig = CacheConfig()
    """How long the requester checks' SubjectAccessReview answers are reused (kubetitan.access_cache)."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    """The access cache's clock (tests advance a fake one instead of sleeping)."""


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--webhook-port", type=int, default=None, metavar="PORT",
                   help="serve the validating admission webhook over HTTPS on this port (default: no webhook; the "
                        "chart sets 9443)")
    p.add_argument("--webhook-addr", default="0.0.0.0", metavar="ADDR", help="address the webhook listens on")
    p.add_argument("--webhook-cert-file", metavar="FILE", help="the webhook's serving certificate (PEM)")
    p.add_argument("--webhook-key-file", metavar="FILE", help="its private key (PEM)")
    p.add_argument("--webhook-cert-check-seconds", type=float, default=60.0, metavar="S",
                   help="re-read the certificate files this often and serve a renewed pair without a restart "
                        "(default 60)")
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
    p.add_argument("--requester-cache-max-entries", type=int, default=CacheConfig.max_entries, metavar="N",
                   help="the most answers kept, least recently used dropped first (default %(default)s; 0: no cache)")


def from_args(a: argparse.Namespace) -> WebhookOptions:
    if a.webhook_port is not None and not (a.webhook_cert_file and a.webhook_key_file):
        raise SystemExit("error: --webhook-port needs --webhook-cert-file and --webhook-key-file (the chart mounts "
                         "them from its webhook Secret); the API server calls webhooks over HTTPS only")
    return WebhookOptions(port=a.webhook_port, addr=a.webhook_addr, cert_file=a.webhook_cert_file,
                          key_file=a.webhook_key_file, requester=admission.Requester(a.requester_checks),
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


def configure(settings: kopf.OperatorSettings, options: WebhookOptions | None) -> None:
    """Give kopf its webhook server (at start-up). The chart ships the ValidatingWebhookConfiguration itself, so
    kopf manages none (``settings.admission.managed`` unset: no RBAC on webhook configurations)."""
    logging.getLogger("kopf.objects").addFilter(_REFUSAL_FILTER)  # a set: adding it again is a no-op
    if options is None or options.port is None:
        settings.admission.server = _no_server
        return
    settings.admission.server = kopf.WebhookServer(addr=options.addr, port=options.port, certfile=options.cert_file,
                                                   pkeyfile=options.key_file,
                                                   file_check_interval=options.cert_check_seconds)


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


async def answers_for(ctx: Any, opts: WebhookOptions, checks: list[admission.Access], user: Mapping[str, Any]
                      ) -> dict[admission.Access, Answer]:
    """Every check's answer: cached ones at once, the others asked concurrently (one request each)."""
    cache = access_cache(ctx, opts)
    results = await asyncio.gather(*(cache.get(c, user, lambda c=c: _ask(ctx.client, c, user)) for c in checks))
    return dict(zip(checks, results))


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
        if checks:
            answers = await answers_for(ctx, opts, checks, userinfo)
    verdict = admission.review(obj, was, operation, ctx.options.policy, opts.requester, answers)
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        meta = (obj or was or {}).get("metadata") or {}
        log.info("Refused %s of LlamaPretrain %s/%s by %s: %s", operation, meta.get("namespace"),
                 meta.get("name") or meta.get("generateName"), userinfo.get("username"),
                 "; ".join(verdict.errors))
        raise kopf.AdmissionError(verdict.message, code=verdict.code)
