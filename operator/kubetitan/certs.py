"""The webhook's own certificates (chart ``webhook.certificates: operator``): a self-signed CA and a serving
certificate for the webhook Service, issued and rotated by the operator; the decisions as pure functions.

Material lives in one Secret the chart ships empty (``<fullname>-webhook-tls``): ``ca.crt`` (the CA bundle: the
current CA first, then earlier CAs not yet expired), ``ca.key``, ``tls.crt``, ``tls.key``. :func:`decide` says
what a replica must do with what it read, given the time (injected: tests move it instead of waiting):

- nothing there, unreadable, a CA key that does not match, or a CA in the last third of its life: a new CA and a
  new serving certificate (the old CA stays in the bundle until it expires, so a replica still serving the old
  pair keeps verifying);
- a serving certificate that is missing, not signed by the CA, for other names, with another key, or in the last
  third of its life: a new serving certificate from the same CA;
- else keep it.

:func:`vwc_bundle` is the caBundle the ValidatingWebhookConfiguration must carry: every CA it carries now or the
Secret has, less the expired ones. It only ever grows by the Secret's CAs, so a replica that read an older Secret
never takes a new CA out, and the writer adds the new CA to the configuration before it writes the Secret: at no
moment does a replica serve a certificate the API server cannot verify. kubetitan.certsync does the I/O.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KEYS = ("ca.crt", "ca.key", "tls.crt", "tls.key")
"""The Secret's keys (``ca.crt`` is the bundle)."""
SKEW = dt.timedelta(minutes=5)
"""Certificates start this long before they are issued: a replica or API server whose clock is a little behind
accepts them at once."""


@dataclass(frozen=True)
class CertPolicy:
    cert_days: int = 90
    """Lifetime of the serving certificate; re-issued in the last third of it (30 days before expiry)."""
    ca_days: int = 365
    """Lifetime of the CA; a new CA in the last third of it, the old one kept in the bundle until it expires."""

    def problems(self) -> list[str]:
        out = []
        if self.cert_days < 1 or self.ca_days < 1:
            out.append("certificate and CA lifetimes must be at least 1 day")
        if self.ca_days < self.cert_days:
            out.append(f"the CA lifetime ({self.ca_days} days) must be at least the serving certificate's "
                       f"({self.cert_days} days): a certificate cannot outlive the CA that signed it")
        return out


class Action(str, Enum):
    KEEP = "keep"
    ISSUE_CERT = "issueCertificate"
    ISSUE_CA = "issueCA"


@dataclass(frozen=True)
class Material:
    """PEM bytes of the Secret's four keys."""

    ca_bundle: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    @classmethod
    def from_secret(cls, data: Mapping[str, str] | None) -> Material | None:
        """From a Secret's ``data`` (base64), or None when a key is missing or not base64."""
        data = data or {}
        try:
            vals = [base64.b64decode(data[k], validate=True) for k in KEYS]
        except (KeyError, ValueError, TypeError):
            return None
        return cls(*vals)

    def secret_data(self) -> dict[str, str]:
        return dict(zip(KEYS, (base64.b64encode(v).decode() for v in (self.ca_bundle, self.ca_key, self.cert,
                                                                      self.key))))


def certificates(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle ([] when it is not one)."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def _remaining_share(cert: x509.Certificate, now: dt.datetime) -> float:
    life = (cert.not_valid_after_utc - cert.not_valid_before_utc).total_seconds()
    return (cert.not_valid_after_utc - now).total_seconds() / life if life > 0 else 0.0


def _same_key(cert: x509.Certificate, key_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt)


def _names(cert: x509.Certificate) -> set[str]:
    """The certificate's DNS names and IP addresses (as text)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(san.get_values_for_type(x509.DNSName)) | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def _san(name: str) -> x509.GeneralName:
    """An IP address SAN for an address (the out-of-cluster URL mode: ``https://127.0.0.1:9443``), else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def decide(m: Material | None, now: dt.datetime, dns_names: tuple[str, ...], policy: CertPolicy
           ) -> tuple[Action, str]:
    """What to do with the Secret's material at ``now`` (timezone-aware UTC), and why."""
    cas = certificates(m.ca_bundle) if m is not None else []
    if m is None or not cas:
        return Action.ISSUE_CA, "no CA yet"
    ca = cas[0]
    if not _same_key(ca, m.ca_key):
        return Action.ISSUE_CA, "the CA key does not match the CA certificate"
    if _remaining_share(ca, now) <= 1 / 3:
        return Action.ISSUE_CA, f"the CA expires at {ca.not_valid_after_utc.isoformat()}"
    (cert, *_) = certificates(m.cert) or [None]
    if cert is None:
        return Action.ISSUE_CERT, "no serving certificate yet"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as e:  # noqa: BLE001 - InvalidSignature and friends
        return Action.ISSUE_CERT, f"the serving certificate is not signed by the current CA ({type(e).__name__})"
    if _names(cert) != set(dns_names):
        return Action.ISSUE_CERT, f"the serving certificate is for {sorted(_names(cert))}, not {sorted(dns_names)}"
    if not _same_key(cert, m.key):
        return Action.ISSUE_CERT, "the serving key does not match the serving certificate"
    if _remaining_share(cert, now) <= 1 / 3:
        return Action.ISSUE_CERT, f"the serving certificate expires at {cert.not_valid_after_utc.isoformat()}"
    return Action.KEEP, "valid"


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _new_ca(now: dt.datetime, days: int, common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} {now:%Y%m%dT%H%M%SZ}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(m: Material | None, action: Action, now: dt.datetime, dns_names: tuple[str, ...], policy: CertPolicy,
          common_name: str = "kubetitan webhook CA") -> Material:
    """New material for ``action`` (ISSUE_CERT keeps the CA; ISSUE_CA makes a new one and keeps the earlier CAs
    that have not expired in the bundle)."""
    assert action != Action.KEEP
    earlier = [c for c in (certificates(m.ca_bundle) if m is not None else []) if c.not_valid_after_utc > now]
    if action == Action.ISSUE_CA or m is None:
        ca, ca_key = _new_ca(now, policy.ca_days, common_name)
        bundle = [ca] + earlier
    else:
        ca = earlier[0]
        loaded = serialization.load_pem_private_key(m.ca_key, password=None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        ca_key, bundle = loaded, earlier
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + dt.timedelta(days=policy.cert_days), ca.not_valid_after_utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in dns_names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Material(b"".join(_pem(c) for c in bundle), _pem_key(ca_key), _pem(cert), _pem_key(key))


def vwc_bundle(current: bytes, secret_bundle: bytes, now: dt.datetime) -> bytes:
    """The caBundle the configuration must carry: the Secret's CAs, then those it carries now that the Secret no
    longer has, less every expired one (PEM, no duplicates)."""
    out: list[x509.Certificate] = []
    for c in certificates(secret_bundle) + certificates(current):
        if c.not_valid_after_utc > now and c not in out:
            out.append(c)
    return b"".join(_pem(c) for c in out)
