"""The operator's own webhook certificates, kept in step (``--webhook-certificates operator``; kubetitan.certs
decides).

Every replica runs :func:`run`: each ``interval`` it reads the Secret, and

1. if :func:`kubetitan.certs.decide` says so, issues new material, first adds its CA to the configuration's
   caBundle, then writes the Secret with the ``resourceVersion`` it read (a replica that wrote meanwhile wins: 409
   Conflict, and this one takes the winner's material on its next read, at once);
2. keeps the ValidatingWebhookConfiguration's caBundle to :func:`kubetitan.certs.vwc_bundle` (restored within one
   interval if an apply of the chart or a person removed it), and every other field of its webhooks to the chart's
   (``--webhook-configuration-webhooks``, :mod:`kubetitan.webhook_config`): a drift (a rule added, the scope widened,
   ``failurePolicy`` flipped, ``clientConfig`` pointed elsewhere) is put back within one interval, with a Warning
   Event ``WebhookConfigurationRestored`` naming what was restored;
3. writes the serving pair to ``cert_dir`` when it changed (a new directory, then one symbolic-link swap: kopf
   never reads a certificate with another's key) and kopf's server, which re-reads the files every
   ``--webhook-cert-check-seconds``, serves it.

The webhook server starts once the first pair is on disk (``ready``). The chart ships the Secret empty and grants
exactly get/update on it and on the configuration (by name: RBAC cannot narrow an update to one field, hence the
restoring of the other fields); any replica may write, and they agree through the
Secret's resourceVersion: the first writer wins, the others read its material.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetitan import certs, webhook_config
from kubetitan.events import Recorder

log = logging.getLogger("kubetitan.certsync")

VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
RESTORED = "WebhookConfigurationRestored"
"""Reason of the Warning Event sent when the configuration's webhooks drifted from the chart's and were put back."""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class CertSync:
    """What ``--webhook-certificates operator`` keeps: the Secret, the configuration, the names, the files."""

    secret_namespace: str
    secret_name: str
    configuration: str
    dns_names: tuple[str, ...]
    cert_dir: str
    policy: certs.CertPolicy = certs.CertPolicy()
    interval: float = 60.0
    webhooks: tuple[dict[str, Any], ...] = ()
    """The configuration's webhooks as the chart renders them (``--webhook-configuration-webhooks``): every field
    but ``caBundle`` is restored to these. Empty: only the caBundle is kept (tests of the certificates alone)."""
    now: Callable[[], dt.datetime] = field(default=utcnow, compare=False, repr=False)
    """Wall clock for the decisions (tests move a fake one)."""

    @property
    def cert_file(self) -> str:
        return str(Path(self.cert_dir) / "current" / "tls.crt")

    @property
    def key_file(self) -> str:
        return str(Path(self.cert_dir) / "current" / "tls.key")

    def secret_path(self) -> str:
        return f"/api/v1/namespaces/{self.secret_namespace}/secrets/{self.secret_name}"


def url_names(url: str) -> tuple[str, ...]:
    """The name the API server dials for a URL client configuration: its host (a DNS name or an IP address)."""
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise ValueError(f"webhook URL {url!r} has no host")
    return (host,)


def service_dns_names(namespace: str, service: str) -> tuple[str, ...]:
    """The names the API server may dial for a service reference (it verifies ``<svc>.<ns>.svc``)."""
    return (f"{service}.{namespace}.svc", service, f"{service}.{namespace}", f"{service}.{namespace}.svc.cluster.local")


def write_pair(cert_dir: str, m: certs.Material) -> bool:
    """Put the serving pair under ``cert_dir/current`` (one atomic swap); False when it is there already."""
    base = Path(cert_dir)
    current = base / "current"
    if (current / "tls.crt").exists() and (current / "tls.crt").read_bytes() == m.cert \
            and (current / "tls.key").read_bytes() == m.key:
        return False
    base.mkdir(parents=True, exist_ok=True)
    version = base / f".v-{secrets.token_hex(4)}"
    version.mkdir(mode=0o700)
    for name, data in (("tls.key", m.key), ("tls.crt", m.cert)):
        fd = os.open(version / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    old = os.readlink(current) if current.is_symlink() else None
    tmp = base / f".current-{secrets.token_hex(4)}"
    tmp.symlink_to(version.name)
    os.replace(tmp, current)
    if old:
        for name in ("tls.crt", "tls.key"):
            (base / old / name).unlink(missing_ok=True)
        (base / old).rmdir()
    return True


def _involved(vwc: dict[str, Any]) -> dict[str, Any]:
    """The configuration as the object of an Event (cluster-scoped: the Event goes to namespace ``default``)."""
    meta = vwc.get("metadata") or {}
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": meta.get("name"), "uid": meta.get("uid")}}


def _with_bundle(vwc: dict[str, Any], s: CertSync, bundle: bytes) -> tuple[list[str], bool]:
    """Put the chart's webhooks back into ``vwc`` (in place) and each caBundle to :func:`certs.vwc_bundle`: (what
    drifted, whether anything changed)."""
    import base64

    live = vwc.get("webhooks") or []
    drifted = webhook_config.drift(live, s.webhooks) if s.webhooks else []
    if drifted:
        vwc["webhooks"] = webhook_config.restored(live, s.webhooks)
    changed = bool(drifted)
    for w in vwc.get("webhooks") or []:
        cc = w.setdefault("clientConfig", {})
        now = base64.b64decode(cc.get("caBundle") or "")
        want = certs.vwc_bundle(now, bundle, s.now())
        if want != now:
            cc["caBundle"] = base64.b64encode(want).decode()
            changed = True
    return drifted, changed


async def _sync_bundle(client: Any, s: CertSync, bundle: bytes) -> bool:
    """The configuration's caBundle made :func:`certs.vwc_bundle` and its other fields the chart's; True when it was
    changed. A concurrent write (another replica adding its CA) is a 409: read again and merge with it."""
    from kubetitan.kube import ApiError

    path = f"{VWC_PATH}/{s.configuration}"
    for _ in range(5):
        vwc = await client._call("admissionregistration.k8s.io", "validatingwebhookconfigurations", "get", "GET",
                                 path)
        if vwc is None:
            raise LookupError(f"ValidatingWebhookConfiguration {s.configuration} not found: the chart ships it "
                              "(webhook.enabled); re-install or upgrade the release")
        drifted, changed = _with_bundle(vwc, s, bundle)
        if not changed:
            return False
        try:
            await client._call("admissionregistration.k8s.io", "validatingwebhookconfigurations", "update", "PUT",
                               path, vwc, fenced=False)
        except ApiError as e:
            if e.status == 409:
                continue
            raise
        if drifted:
            what = "; ".join(drifted)
            log.warning("Restored ValidatingWebhookConfiguration %s to the chart's webhooks (%s)", s.configuration,
                        what)
            # every replica keeps the configuration (a standby too): its Event is not fenced either
            await Recorder(client, fenced=False).record(
                _involved(vwc), "Warning", RESTORED, f"Restored to the webhooks the chart renders (only caBundle is "
                f"the operator's to change): {what}. Whoever changed it holds write access to this configuration: "
                "check who (the API server's audit log) and change the chart's values instead")
        else:
            log.info("Updated the caBundle of ValidatingWebhookConfiguration %s", s.configuration)
        return True
    raise RuntimeError(f"ValidatingWebhookConfiguration {s.configuration} kept changing under this replica "
                       "(5 conflicts in a row)")


async def sync_once(client: Any, s: CertSync) -> certs.Material:
    """One round: read, re-issue if due, keep the configuration's bundle, write the files. Returns what is
    served."""
    from kubetitan.kube import ApiError

    for _ in range(3):  # a conflict means another replica wrote: read again and take its material
        secret = await client._call("", "secrets", "get", "GET", s.secret_path())
        if secret is None:
            raise LookupError(f"Secret {s.secret_namespace}/{s.secret_name} not found: the chart ships it empty for "
                              "the operator to fill (webhook.certificates: operator); re-install or upgrade the "
                              "release")
        m = certs.Material.from_secret(secret.get("data"))
        action, why = certs.decide(m, s.now(), s.dns_names, s.policy)
        if action == certs.Action.KEEP:
            break
        assert m is not None or action == certs.Action.ISSUE_CA
        new = certs.issue(m, action, s.now(), s.dns_names, s.policy)
        await _sync_bundle(client, s, new.ca_bundle)  # trusted before anyone serves it
        secret["data"] = new.secret_data()
        try:
            await client._call("", "secrets", "update", "PUT", s.secret_path(), secret, fenced=False)
        except ApiError as e:
            if e.status == 409:
                log.info("Secret %s/%s was written by another replica; reading its certificate",
                         s.secret_namespace, s.secret_name)
                continue
            raise
        log.info("Issued a new webhook %s (%s) into Secret %s/%s", "CA and certificate" if action ==
                 certs.Action.ISSUE_CA else "serving certificate", why, s.secret_namespace, s.secret_name)
        m = new
        break
    else:
        raise RuntimeError("the webhook Secret kept changing under this replica (3 conflicts in a row)")
    assert m is not None
    await _sync_bundle(client, s, m.ca_bundle)
    if write_pair(s.cert_dir, m):
        log.info("Serving the webhook certificate from Secret %s/%s", s.secret_namespace, s.secret_name)
    return m


async def run(client: Any, s: CertSync, ready: asyncio.Event) -> None:
    """Keep the certificates in step until cancelled; ``ready`` is set once a pair is on disk. A failed round
    (API error, missing Secret) is logged and retried at the next interval (sooner while nothing is served)."""
    while True:
        try:
            await sync_once(client, s)
            ready.set()
            delay = s.interval
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the next round retries; the webhook keeps serving what it has
            from kubetitan.kube import message_of

            log.warning("Could not keep the webhook certificates in step: %s", message_of(e))
            delay = s.interval if ready.is_set() else min(s.interval, 5.0)
        await asyncio.sleep(delay)
