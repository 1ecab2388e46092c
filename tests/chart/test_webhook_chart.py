"""The chart's admission webhook: ValidatingWebhookConfiguration, Service, certificates (the operator's or
cert-manager's),
NetworkPolicy, the operator's flags and RBAC, rendered by the real helm. tests/operator/test_webhook.py runs the
operator with this very Secret and configuration against kmockx (certificate verified for the Service's name)."""

from __future__ import annotations

import base64
import subprocess

import pytest

from chartlib import CHART, NAMESPACE, RELEASE, by_kind, helm, render, values_args
from kmockx.harness import Cluster
from kubetitan import admission, runner
from kubetitan.webhook import WEBHOOK_ID
from support import yamlio


def _one(docs, kind, suffix=""):
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def _container(docs):
    (c,) = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    return c


def test_defaults_ship_a_fail_closed_webhook_served_by_every_replica():
    docs = render()
    vwc = _one(docs, "ValidatingWebhookConfiguration")
    (w,) = vwc["webhooks"]
    assert w["failurePolicy"] == "Fail" and w["timeoutSeconds"] == 5 and w["sideEffects"] == "None"
    assert w["admissionReviewVersions"] == ["v1"]
    assert w["rules"] == [{"apiGroups": ["kubetitan.io"], "apiVersions": ["v1alpha1"], "resources": ["llamapretrains"],
                           "operations": ["CREATE", "UPDATE"], "scope": "Namespaced"}]
    svc = _one(docs, "Service", "-webhook")
    ref = w["clientConfig"]["service"]
    assert (ref["name"], ref["namespace"], ref["port"], ref["path"]) == (
        svc["metadata"]["name"], svc["metadata"]["namespace"], 443, f"/{WEBHOOK_ID}")
    # the Service reaches every replica's webhook port
    deploy = by_kind(docs, "Deployment")[0]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    c = _container(docs)
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in c["ports"]
    assert svc["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    # the operator parses its flags into a webhook on 9443 with references checks
    opts = runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook
    assert opts.port == 9443 and opts.requester == admission.Requester.REFERENCES


def test_with_cert_manager_the_operator_serves_the_mounted_secret():
    """cert-manager (or whoever fills the Secret the Certificate names) provides the pair: the operator serves the
    mounted files and re-reads them; tests/operator/test_webhook.py serves such a pair to the API double."""
    docs = render(sets=["webhook.certificates=certManager"])
    c = _container(docs)
    opts = runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook
    assert opts.certificates is None
    mount = next(m for m in c["volumeMounts"] if m["name"] == "webhook-tls")
    assert opts.cert_file == f"{mount['mountPath']}/tls.crt" and opts.key_file == f"{mount['mountPath']}/tls.key"
    vol = next(v for v in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "webhook-tls")
    assert vol["secret"]["secretName"] == _one(docs, "Certificate")["spec"]["secretName"]


def test_helm_generated_certificates_are_not_offered():
    """Two ways remain: the operator's own (the default) and cert-manager's (any issuer, a corporate CA too)."""
    out = helm("template", "kt", str(CHART), "--set", "webhook.certificates=helm", check=False)
    assert out.returncode != 0 and "webhook.certificates" in out.stderr
    assert "operator" in out.stderr and "certManager" in out.stderr, out.stderr


def test_the_network_policy_lets_the_api_server_reach_the_webhook_and_keeps_metrics_open():
    np = _one(render(), "NetworkPolicy", "-operator")
    ports = [[p["port"] for p in rule["ports"]] for rule in np["spec"]["ingress"]]
    assert ports == [[9443], [8080, 8081]]
    assert "from" not in np["spec"]["ingress"][0]  # any source: the API server cannot be selected by labels
    narrowed = _one(render(sets=["webhook.networkPolicy.from[0].ipBlock.cidr=10.0.0.0/16"]), "NetworkPolicy",
                    "-operator")
    assert narrowed["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
    assert not [d for d in render(sets=["webhook.networkPolicy.enabled=false"])
                if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-operator")]


def test_cert_manager_issues_the_certificate_and_injects_the_ca():
    docs = render(sets=["webhook.certificates=certManager"])
    vwc = _one(docs, "ValidatingWebhookConfiguration")
    cert = _one(docs, "Certificate")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{cert['metadata']['namespace']}/{cert['metadata']['name']}"
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-webhook-tls")]
    assert cert["spec"]["secretName"].endswith("-webhook-tls")
    svc = _one(docs, "Service", "-webhook")
    assert f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] == _one(docs, "Issuer")["metadata"]["name"]
    own = render(sets=["webhook.certificates=certManager", "webhook.certManager.issuerRef.name=corp-ca",
                       "webhook.certManager.issuerRef.kind=ClusterIssuer"])
    assert _one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    assert not by_kind(own, "Issuer")


def test_namespaced_mode_calls_the_webhook_only_for_the_watched_namespaces():
    docs = render(sets=["watch.mode=namespaced", "watch.namespaces={ml,research}"])
    (w,) = _one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert w["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "research"]}]}


@pytest.mark.parametrize("sets", [[], ["watch.mode=namespaced", "watch.namespaces={ml}"]], ids=["cluster", "namespaced"])
def test_the_operator_may_create_subject_access_reviews(sets):
    rules = [r for d in by_kind(render(sets=sets), "ClusterRole") for r in d["rules"]]
    assert {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]} in rules


def test_values_choose_failure_policy_timeout_and_requester_checks():
    docs = render(sets=["webhook.failurePolicy=Ignore", "webhook.timeoutSeconds=2", "webhook.requesterChecks=off"])
    (w,) = _one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert (w["failurePolicy"], w["timeoutSeconds"]) == ("Ignore", 2)
    c = _container(docs)
    assert runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook.requester == \
        admission.Requester.OFF


def test_webhook_off_ships_none_of_it():
    docs = render(sets=["webhook.enabled=false"])
    assert not by_kind(docs, "ValidatingWebhookConfiguration")
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-webhook", "-webhook-tls"))]
    c = _container(docs)
    assert not [a for a in c["args"] if a.startswith("--webhook-")]
    assert runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook.port is None


@pytest.mark.parametrize("bad", ["webhook.failurePolicy=Maybe", "webhook.timeoutSeconds=31",
                                 "webhook.requesterChecks=all", "webhook.certificates=vault",
                                 "webhook.requesterCache.allowedSeconds=301",
                                 "webhook.operatorCertificates.certificateDays=0"])
def test_the_schema_refuses_bad_webhook_values(bad):
    out = helm("template", "kt", str(render.__globals__["CHART"]), *values_args([], [bad]), check=False)
    assert out.returncode != 0 and bad.split("=")[0].split(".")[-1] in out.stderr


def test_metadata_only_updates_never_reach_the_webhook_on_1_28_and_later():
    (w,) = _one(render(), "ValidatingWebhookConfiguration")["webhooks"]
    assert w["matchConditions"] == [{"name": "creates-or-changes-spec",
                                     "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"}]
    out = helm("template", "kt", str(render.__globals__["CHART"]), "--kube-version", "1.27.0").stdout
    (vwc,) = [d for d in yamlio.load_all(out) if d and d["kind"] == "ValidatingWebhookConfiguration"]
    assert "matchConditions" not in vwc["webhooks"][0]  # 1.27 has no matchConditions (the webhook passes those)


def test_operator_certificates_are_the_default_with_rbac_on_exactly_the_secret_and_the_configuration():
    docs = render()
    fullname = _one(docs, "ValidatingWebhookConfiguration")["metadata"]["name"]
    (w,) = _one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert "caBundle" not in w["clientConfig"] and "annotations" not in \
        _one(docs, "ValidatingWebhookConfiguration")["metadata"]  # the operator fills it; helm never writes it
    secret = _one(docs, "Secret", "-webhook-tls")
    # shipped empty, with helm's type (immutable: an upgrade from helm's certificates must not fail on it)
    assert secret["data"] == {"tls.crt": "", "tls.key": ""} and secret["type"] == "kubernetes.io/tls"
    # exactly get/update, on exactly these two objects
    role = next(d for d in by_kind(docs, "Role") if d["metadata"]["name"].endswith("-webhook-certificates"))
    crole = next(d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"].endswith("-webhook-certificates"))
    assert role["metadata"]["namespace"] == secret["metadata"]["namespace"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "update"],
                              "resourceNames": [secret["metadata"]["name"]]}]
    assert crole["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"],
                               "resources": ["validatingwebhookconfigurations"], "verbs": ["get", "update"],
                               "resourceNames": [fullname]}]
    for kind, role_kind in (("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")):
        b = next(d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith("-webhook-certificates"))
        assert b["roleRef"]["kind"] == role_kind and b["roleRef"]["name"].endswith("-webhook-certificates")
    # the operator parses its flags into a CertSync of that Secret, configuration and Service, writing to memory
    c = _container(docs)
    opts = runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook
    svc = _one(docs, "Service", "-webhook")
    sync = opts.certificates
    assert (sync.secret_namespace, sync.secret_name, sync.configuration) == (
        secret["metadata"]["namespace"], secret["metadata"]["name"], fullname)
    assert sync.dns_names[0] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert (sync.policy.cert_days, sync.policy.ca_days, sync.interval) == (90, 365, 60)
    # the webhooks it restores when they drift are exactly those the chart puts into the configuration
    assert list(sync.webhooks) == _one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "webhook-tls")
    assert opts.cert_file == f"{mount['mountPath']}/current/tls.crt" and not mount["readOnly"]
    vol = next(v for v in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "webhook-tls")
    assert vol["emptyDir"]["medium"] == "Memory"
    # the other modes grant none of it
    for mode in ("certManager",):
        assert not [d for d in render(sets=[f"webhook.certificates={mode}"])
                    if d["metadata"]["name"].endswith(("-webhook-certificates", "-webhook-events"))]
        assert "--webhook-configuration-webhooks" not in " ".join(_container(render(
            sets=[f"webhook.certificates={mode}"]))["args"])


@pytest.mark.parametrize(("sets", "events_role"), [
    ([], False),  # cluster mode: the ClusterRole's Events row covers namespace default
    (["watch.mode=namespaced", "watch.namespaces={ml}"], True),
    (["watch.mode=namespaced", "watch.namespaces={ml,default}"], False),  # default's Role has the row
], ids=["cluster", "namespaced", "namespaced-watching-default"])
def test_the_configurations_events_may_be_sent_to_namespace_default(sets: list[str], events_role: bool) -> None:
    """A restored configuration's Warning Event is about a cluster-scoped object, so it goes to namespace default:
    in namespaced mode a Role there grants the Events row alone (create/get/patch, no resourceNames: Event names
    are generated); the restored webhooks are the namespaced ones (their namespaceSelector)."""
    docs = render(sets=sets)
    roles = [d for d in by_kind(docs, "Role") if d["metadata"]["name"].endswith("-webhook-events")]
    assert len(roles) == int(events_role)
    if events_role:
        assert roles[0]["metadata"]["namespace"] == "default"
        assert roles[0]["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["get", "create", "patch"]}]
        (b,) = [d for d in by_kind(docs, "RoleBinding") if d["metadata"]["name"].endswith("-webhook-events")]
        assert b["metadata"]["namespace"] == "default" and b["roleRef"]["name"] == roles[0]["metadata"]["name"]
    sync = runner.options_from_args(runner.build_parser().parse_args(_container(docs)["args"])).webhook.certificates
    assert list(sync.webhooks) == _one(docs, "ValidatingWebhookConfiguration")["webhooks"]


def test_the_requester_cache_values_become_flags():
    c = _container(render(sets=["webhook.requesterCache.allowedSeconds=60", "webhook.requesterCache.deniedSeconds=0",
                                "webhook.requesterCache.maxEntries=100"]))
    cache = runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook.access_cache
    assert (cache.allowed_seconds, cache.denied_seconds, cache.max_entries) == (60, 0, 100)


def test_the_rate_limit_and_client_auth_values_become_flags():
    from kubetitan.webhook_guard import RateConfig

    def webhook(*sets):
        docs = render(sets=list(sets))
        c = _container(docs)
        return runner.options_from_args(runner.build_parser().parse_args(c["args"])).webhook, \
            by_kind(docs, "Deployment")[0]

    opts, dep = webhook()
    assert opts.rate == RateConfig() and opts.client_ca_file is None  # the chart's defaults are the operator's
    assert not [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-client-ca"]
    opts, dep = webhook("webhook.rateLimit.userPerSecond=2", "webhook.rateLimit.sourceBurst=1024",
                        "webhook.clientAuth.caConfigMap=apiserver-webhook-client-ca",
                        "webhook.clientAuth.names={kube-apiserver,front-proxy-client}")
    assert (opts.rate.user_per_second, opts.rate.source_burst) == (2, 1024)
    assert opts.client_ca_file == "/etc/kubetitan/webhook-client-ca/ca.crt"
    assert opts.client_names == ("kube-apiserver", "front-proxy-client")
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "webhook-client-ca"]
    assert vol["configMap"]["name"] == "apiserver-webhook-client-ca"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "webhook-client-ca"]
    assert opts.client_ca_file == f"{mount['mountPath']}/{vol['configMap']['items'][0]['path']}"



def test_an_upgrade_renders_the_certificates_the_operator_wrote_so_helm_keeps_them():
    """Helm 3's upgrade patch is a three-way merge that writes every value the chart renders over the live one; the
    chart therefore renders the operator-written Secret's live data (lookup, which `--dry-run=server` runs against
    the API server: kmockx here), so the upgrade's patch of the Secret is empty."""
    secret = _one(render(), "Secret", "-webhook-tls")
    live = {"tls.crt": base64.b64encode(b"operator cert").decode(), "tls.key": base64.b64encode(b"key").decode(),
            "ca.crt": base64.b64encode(b"operator CAs").decode()}
    with Cluster(namespaces=(NAMESPACE,)) as c:
        def rendered_secret():
            out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=server",
                       "--kubeconfig", c.admin_kubeconfig, "--show-only", "templates/webhook.yaml").stdout
            return next(d for d in yamlio.load_all(out) if d and d["kind"] == "Secret")

        assert rendered_secret()["data"] == {"tls.crt": "", "tls.key": ""}  # install: the keys, empty
        c.call(c.k.put("v1/secrets", {**secret, "data": live}))
        assert rendered_secret()["data"] == live  # an upgrade: exactly what the operator wrote


@pytest.mark.parametrize("value", ["true", "false"])
def test_the_removed_cert_manager_switch_names_its_replacement(value):
    out = helm("template", "kt", str(CHART), "--set", f"webhook.certManager.enabled={value}", check=False)
    assert out.returncode != 0
    assert f"webhook.certManager.enabled (here {value}) was removed: set webhook.certificates=certManager" in out.stderr
