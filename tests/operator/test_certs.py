"""kubetitan.certs: when the operator issues a new CA or serving certificate, and what it issues (an injected
time, no waiting); kubetitan.certsync's file swap. tests/operator/test_webhook.py::test_operator_certificates...
runs the same against the API double (the configuration's caBundle set, the double's HTTPS call verified)."""

from __future__ import annotations

import base64
import datetime as dt
import contextlib
import ssl
from pathlib import Path

import pytest

from kubetitan import certs, certsync

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
"""The handshake tests issue around the real time: ``ssl`` checks validity against the real clock."""
DAY = dt.timedelta(days=1)
NAMES = certsync.service_dns_names("kubetitan-system", "kt-kubetitan-webhook")
POLICY = certs.CertPolicy(cert_days=90, ca_days=365)


def fresh(at: dt.datetime = T0) -> certs.Material:
    return certs.issue(None, certs.Action.ISSUE_CA, at, NAMES, POLICY)


def _one(pem: bytes):
    (c,) = certs.certificates(pem)
    return c


FIRST = fresh()
OTHER = fresh()  # another CA and pair


def _mix(**parts: bytes) -> certs.Material:
    return certs.Material(**{"ca_bundle": FIRST.ca_bundle, "ca_key": FIRST.ca_key, "cert": FIRST.cert,
                             "key": FIRST.key, **parts})


CASES = [
    ("nothing-yet", None, T0, certs.Action.ISSUE_CA, "no CA yet"),
    ("garbage-bundle", _mix(ca_bundle=b"not a certificate"), T0, certs.Action.ISSUE_CA, "no CA yet"),
    ("ca-key-of-another-ca", _mix(ca_key=OTHER.ca_key), T0, certs.Action.ISSUE_CA, "CA key does not match"),
    ("fresh", FIRST, T0, certs.Action.KEEP, "valid"),
    ("cert-at-59-days", FIRST, T0 + 59 * DAY, certs.Action.KEEP, "valid"),
    ("cert-in-its-last-third", FIRST, T0 + 61 * DAY, certs.Action.ISSUE_CERT, "serving certificate expires"),
    ("cert-expired", FIRST, T0 + 91 * DAY, certs.Action.ISSUE_CERT, "serving certificate expires"),
    ("ca-in-its-last-third", FIRST, T0 + 244 * DAY, certs.Action.ISSUE_CA, "the CA expires"),
    ("no-cert", _mix(cert=b""), T0, certs.Action.ISSUE_CERT, "no serving certificate"),
    ("cert-of-another-ca", _mix(cert=OTHER.cert, key=OTHER.key), T0, certs.Action.ISSUE_CERT, "not signed by"),
    ("key-of-another-cert", _mix(key=OTHER.key), T0, certs.Action.ISSUE_CERT, "serving key does not match"),
]


@pytest.mark.parametrize("material, now, action, why", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(material, now, action, why):
    got_action, got_why = certs.decide(material, now, NAMES, POLICY)
    assert got_action == action and why in got_why, got_why


def test_other_names_need_a_new_certificate():
    action, why = certs.decide(FIRST, T0, certsync.service_dns_names("other-ns", "kt-kubetitan-webhook"), POLICY)
    assert action == certs.Action.ISSUE_CERT and "not [" in why


def _verifies(bundle: bytes, cert: bytes, key: bytes, tmp: Path, name: str = NAMES[0]) -> bool:
    """A TLS handshake check without sockets: the client context (the bundle) verifies the chain and name."""
    (tmp / "c.pem").write_bytes(cert)
    (tmp / "k.pem").write_bytes(key)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
    client = ssl.create_default_context(cadata=bundle.decode())
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    cl = client.wrap_bio(c_in, c_out, server_hostname=name)
    sv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (cl, sv):
            try:
                with contextlib.suppress(ssl.SSLWantReadError):  # the other side has not answered yet
                    side.do_handshake()
            except ssl.SSLCertVerificationError:
                return False
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    return True


def test_an_issued_certificate_verifies_for_the_service_name_against_the_bundle(tmp_path):
    m, other = fresh(NOW), fresh(NOW)
    assert _verifies(m.ca_bundle, m.cert, m.key, tmp_path)
    assert not _verifies(other.ca_bundle, m.cert, m.key, tmp_path)
    assert not _verifies(m.ca_bundle, m.cert, m.key, tmp_path, name="elsewhere.svc")
    cert = _one(FIRST.cert)
    assert cert.not_valid_before_utc == T0 - certs.SKEW and cert.not_valid_after_utc == T0 + 90 * DAY


def test_an_out_of_cluster_url_gets_a_certificate_for_its_ip_address(tmp_path):
    """``--webhook-url https://127.0.0.1:9443`` (the chart's webhook.url): an IP address SAN the API server's
    client verifies, kept as valid (no re-issue every check) and re-issued when the URL's host changes."""
    names = certsync.url_names("https://127.0.0.1:9443")
    assert names == ("127.0.0.1",)
    m = certs.issue(None, certs.Action.ISSUE_CA, NOW, names, POLICY)
    assert _verifies(m.ca_bundle, m.cert, m.key, tmp_path, name="127.0.0.1")
    assert not _verifies(m.ca_bundle, m.cert, m.key, tmp_path, name="127.0.0.2")
    assert certs.decide(m, NOW, names, POLICY)[0] == certs.Action.KEEP
    assert certs.decide(m, NOW, certsync.url_names("https://webhook.example:9443"), POLICY)[0] == \
        certs.Action.ISSUE_CERT


def test_a_renewed_certificate_keeps_the_ca_and_a_new_ca_keeps_the_old_one_trusted_until_it_expires(tmp_path):
    t0 = NOW - 244 * DAY  # the first CA was issued then: it is in its last third now
    first = fresh(t0)
    renewed = certs.issue(first, certs.Action.ISSUE_CERT, NOW - 30 * DAY, NAMES, POLICY)
    assert renewed.ca_bundle == first.ca_bundle and renewed.ca_key == first.ca_key and renewed.cert != first.cert
    assert certs.decide(renewed, NOW - 30 * DAY, NAMES, POLICY)[0] == certs.Action.KEEP
    assert certs.decide(renewed, NOW, NAMES, POLICY)[0] == certs.Action.ISSUE_CA
    rotated = certs.issue(renewed, certs.Action.ISSUE_CA, NOW, NAMES, POLICY)
    new_ca, old_ca = certs.certificates(rotated.ca_bundle)
    assert old_ca == _one(first.ca_bundle) and new_ca != old_ca
    assert certs.decide(rotated, NOW, NAMES, POLICY)[0] == certs.Action.KEEP
    # both pairs verify against the new bundle: a replica still serving the old pair keeps working
    assert _verifies(rotated.ca_bundle, renewed.cert, renewed.key, tmp_path)
    assert _verifies(rotated.ca_bundle, rotated.cert, rotated.key, tmp_path)
    # the next CA rotation, after the first CA expired, drops it
    later = certs.issue(rotated, certs.Action.ISSUE_CA, NOW + 244 * DAY, NAMES, POLICY)
    assert old_ca not in certs.certificates(later.ca_bundle) and new_ca in certs.certificates(later.ca_bundle)


def test_a_certificate_never_outlives_its_ca():
    late = certs.issue(FIRST, certs.Action.ISSUE_CERT, T0 + 300 * DAY, NAMES, POLICY)
    assert _one(late.cert).not_valid_after_utc == _one(FIRST.ca_bundle).not_valid_after_utc


def test_the_configurations_bundle_only_grows_by_the_secrets_cas_and_loses_expired_ones():
    a, b = _one(FIRST.ca_bundle), _one(OTHER.ca_bundle)
    both = certs.vwc_bundle(FIRST.ca_bundle, OTHER.ca_bundle, T0)
    assert certs.certificates(both) == [b, a]  # a replica with an older Secret never takes the newer CA out
    assert certs.vwc_bundle(both, OTHER.ca_bundle, T0) == both  # stable: no patch churn
    assert certs.vwc_bundle(b"", FIRST.ca_bundle, T0) == FIRST.ca_bundle  # an emptied caBundle is restored
    later = fresh(T0 + 300 * DAY)
    assert certs.certificates(certs.vwc_bundle(both, later.ca_bundle, T0 + 366 * DAY)) == [_one(later.ca_bundle)]


def test_policy_problems():
    assert certs.CertPolicy().problems() == []
    assert "must be at least the serving certificate's" in certs.CertPolicy(cert_days=90, ca_days=30).problems()[0]


def test_the_secret_round_trip():
    assert certs.Material.from_secret(FIRST.secret_data()) == FIRST
    assert certs.Material.from_secret({}) is None
    assert certs.Material.from_secret({**FIRST.secret_data(), "tls.key": "%%"}) is None


def test_the_served_pair_is_swapped_in_one_step(tmp_path):
    d = str(tmp_path / "w")
    assert certsync.write_pair(d, FIRST) and not certsync.write_pair(d, FIRST)
    assert (tmp_path / "w" / "current" / "tls.crt").read_bytes() == FIRST.cert
    first_version = (tmp_path / "w" / "current").resolve()
    assert certsync.write_pair(d, OTHER)
    assert (tmp_path / "w" / "current" / "tls.key").read_bytes() == OTHER.key
    assert not first_version.exists()  # the old version is gone
    assert oct((tmp_path / "w" / "current" / "tls.key").stat().st_mode & 0o777) == "0o600"


class FakeApi:
    """The Secret and the configuration, with resourceVersions as the API server keeps them (a PUT with a stale
    one is 409 Conflict); ``before_put`` runs once before this client's first PUT (another replica's turn)."""

    def __init__(self, store: dict[str, dict], before_put=None) -> None:
        self.store, self.before_put, self.puts = store, before_put, []

    async def _call(self, group, resource, verb, method, path, body=None, fenced=True, **_):
        import copy

        from kubetitan.kube import ApiError

        assert fenced is False or method == "GET"
        if method == "GET":
            return copy.deepcopy(self.store.get(path))
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            await hook()
        now = self.store[path]
        if resource == "secrets":  # the CA it writes is trusted by the configuration already
            vwc = next(v for k, v in self.store.items() if k.startswith(certsync.VWC_PATH))
            trusted = certs.certificates(base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]))
            assert certs.certificates(base64.b64decode(body["data"]["ca.crt"]))[0] in trusted
        if body["metadata"]["resourceVersion"] != now["metadata"]["resourceVersion"]:
            raise ApiError(409, method, path, b'{"kind":"Status","reason":"Conflict","message":"modified"}')
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(int(now["metadata"]["resourceVersion"]) + 1)
        self.store[path] = body
        self.puts.append(resource)
        return body


def _store(sync: certsync.CertSync) -> dict[str, dict]:
    return {sync.secret_path(): {"metadata": {"name": sync.secret_name, "resourceVersion": "1"},
                                 "type": "kubernetes.io/tls", "data": {"tls.crt": "", "tls.key": ""}},
            f"{certsync.VWC_PATH}/{sync.configuration}": {"metadata": {"name": sync.configuration,
                                                                        "resourceVersion": "1"},
                                                           "webhooks": [{"clientConfig": {"service": {}}}]}}


def test_replicas_agree_through_the_secrets_resource_version(tmp_path):
    """Two replicas find the Secret empty at once: A writes first, B's write is refused (409) and B serves A's
    pair; the configuration trusts A's CA (written before the Secret). B's own CA, added to the configuration before
    its refused write, signs nothing anyone serves (its key is gone) and drops out when it expires; B's configuration
    write that raced A's is merged (409, read again), not lost."""
    import asyncio

    def sync(name: str) -> certsync.CertSync:
        return certsync.CertSync("kubetitan-system", "kt-webhook-tls", "kt", NAMES, str(tmp_path / name),
                                 now=lambda: NOW)

    a, b = sync("a"), sync("b")
    store = _store(a)
    api_a = FakeApi(store)
    api_b = FakeApi(store, before_put=lambda: certsync.sync_once(api_a, a))
    served_b = asyncio.run(certsync.sync_once(api_b, b))
    secret = certs.Material.from_secret(store[a.secret_path()]["data"])
    assert served_b == secret and (tmp_path / "b" / "current" / "tls.crt").read_bytes() == secret.cert
    assert (tmp_path / "a" / "current" / "tls.crt").read_bytes() == secret.cert
    assert api_a.puts.count("secrets") == 1 and "secrets" not in api_b.puts
    bundle = base64.b64decode(store[f"{certsync.VWC_PATH}/kt"]["webhooks"][0]["clientConfig"]["caBundle"])
    # A's CA is trusted; B added its own issued CA before its refused write (harmless: it signs nothing served)
    assert certs.certificates(secret.ca_bundle)[0] in certs.certificates(bundle)
    # a later round changes nothing
    puts = len(api_a.puts) + len(api_b.puts)
    asyncio.run(certsync.sync_once(api_b, b))
    assert len(api_a.puts) + len(api_b.puts) == puts


def test_a_removed_ca_bundle_is_restored_and_a_missing_secret_says_how_to_fix_it(tmp_path):
    import asyncio

    s = certsync.CertSync("kubetitan-system", "kt-webhook-tls", "kt", NAMES, str(tmp_path / "w"), now=lambda: NOW)
    store = _store(s)
    api = FakeApi(store)
    m = asyncio.run(certsync.sync_once(api, s))
    vwc_path = f"{certsync.VWC_PATH}/kt"
    del store[vwc_path]["webhooks"][0]["clientConfig"]["caBundle"]  # a GitOps apply of the chart dropped it
    assert asyncio.run(certsync.sync_once(api, s)) == m
    assert store[vwc_path]["webhooks"][0]["clientConfig"]["caBundle"]
    del store[s.secret_path()]
    with pytest.raises(LookupError, match="the chart ships it empty .* re-install or upgrade the release"):
        asyncio.run(certsync.sync_once(api, s))


# ------------------------------------------------------------------ the configuration's other fields (drift)
CHART_WEBHOOK = {
    "name": "validate.llamapretrains.kubetitan.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
    "failurePolicy": "Fail", "timeoutSeconds": 5, "matchPolicy": "Equivalent",
    "matchConditions": [{"name": "creates-or-changes-spec",
                         "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"}],
    "rules": [{"apiGroups": ["kubetitan.io"], "apiVersions": ["v1alpha1"], "resources": ["llamapretrains"],
               "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}],
    "clientConfig": {"service": {"name": "kt-webhook", "namespace": "kubetitan-system",
                                 "path": "/validate-llamapretrain", "port": 443}},
}
SECRETS_RULE = {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["secrets"], "operations": ["CREATE"]}


def _stored(w: dict) -> dict:
    """``w`` as the API server stores it: its defaults filled in, a caBundle."""
    import copy

    out = copy.deepcopy(w)
    out.setdefault("namespaceSelector", {})
    out.setdefault("objectSelector", {})
    out["clientConfig"]["caBundle"] = "Q0E="
    return out


@pytest.mark.parametrize(("change", "want"), [
    ({}, []),
    ({"failurePolicy": "Ignore"}, ["webhook validate.llamapretrains.kubetitan.io: failurePolicy"]),
    ({"rules": CHART_WEBHOOK["rules"] + [SECRETS_RULE]}, ["webhook validate.llamapretrains.kubetitan.io: rules"]),
    ({"namespaceSelector": {"matchLabels": {"x": "y"}}, "matchConditions": []},
     ["webhook validate.llamapretrains.kubetitan.io: namespaceSelector, matchConditions"]),
    ({"clientConfig": {"url": "https://evil.example/validate", "caBundle": "Q0E="}},
     ["webhook validate.llamapretrains.kubetitan.io: clientConfig"]),
    ({"timeoutSeconds": 30, "sideEffects": "Some"},
     ["webhook validate.llamapretrains.kubetitan.io: sideEffects, timeoutSeconds"]),
], ids=["defaults-and-ca-bundle-are-no-drift", "failure-policy", "a-secrets-rule", "scope", "client-config",
        "timeout-side-effects"])
def test_drift_is_every_field_but_the_ca_bundle_and_the_servers_defaults(change: dict, want: list[str]) -> None:
    from kubetitan import webhook_config

    assert webhook_config.drift([{**_stored(CHART_WEBHOOK), **change}], [CHART_WEBHOOK]) == want


def test_an_added_or_removed_webhook_is_drift() -> None:
    from kubetitan import webhook_config

    extra = {**_stored(CHART_WEBHOOK), "name": "secrets.example.com", "rules": [SECRETS_RULE]}
    assert webhook_config.drift([_stored(CHART_WEBHOOK), extra], [CHART_WEBHOOK]) == \
        ["webhook secrets.example.com added"]
    assert webhook_config.drift([], [CHART_WEBHOOK]) == ["webhook validate.llamapretrains.kubetitan.io removed"]
    with pytest.raises(ValueError, match="non-empty JSON list"):
        webhook_config.parse("{}")


class EventsApi(FakeApi):
    """FakeApi with core/v1 Events (the Recorder's create, get and patch)."""

    def __init__(self, store: dict[str, dict]) -> None:
        super().__init__(store)
        self.events: list[tuple[dict, bool]] = []

    async def create(self, obj, fenced=True):
        self.events.append((obj, fenced))
        return True


def test_a_drifted_configuration_is_restored_with_a_warning_event(tmp_path):
    """A ``secrets`` rule added and failurePolicy flipped to Ignore (what anyone holding the operator's update on its
    configuration can do): the next round puts the chart's webhook back, keeps the caBundle, and sends one Warning
    Event about the configuration naming both (unfenced: every replica keeps the configuration); a round with
    nothing drifted writes nothing."""
    import asyncio

    s = certsync.CertSync("kubetitan-system", "kt-webhook-tls", "kt", NAMES, str(tmp_path / "w"), now=lambda: NOW,
                          webhooks=(CHART_WEBHOOK,))
    store = _store(s)
    vwc_path = f"{certsync.VWC_PATH}/kt"
    store[vwc_path]["webhooks"] = [_stored(CHART_WEBHOOK)]
    store[vwc_path]["metadata"]["uid"] = "vwc-uid"
    api = EventsApi(store)
    asyncio.run(certsync.sync_once(api, s))
    bundle = store[vwc_path]["webhooks"][0]["clientConfig"]["caBundle"]
    assert not api.events and base64.b64decode(bundle)  # the first round: only the caBundle
    puts = len(api.puts)
    asyncio.run(certsync.sync_once(api, s))
    assert len(api.puts) == puts  # nothing drifted: nothing written
    drifted = store[vwc_path]["webhooks"][0]
    drifted["rules"].append(SECRETS_RULE)
    drifted["failurePolicy"] = "Ignore"
    asyncio.run(certsync.sync_once(api, s))
    (w,) = store[vwc_path]["webhooks"]
    assert w["rules"] == CHART_WEBHOOK["rules"] and w["failurePolicy"] == "Fail"
    assert w["clientConfig"]["caBundle"] == bundle
    ((ev, fenced),) = api.events
    assert ev["type"] == "Warning" and ev["reason"] == certsync.RESTORED and fenced is False
    assert "webhook validate.llamapretrains.kubetitan.io: failurePolicy, rules" in ev["message"]
    assert ev["metadata"]["namespace"] == "default" and ev["involvedObject"] == {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "name": "kt",
        "uid": "vwc-uid"}  # cluster-scoped: no involvedObject.namespace (the API server refuses one)
