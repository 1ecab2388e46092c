"""The Helm chart, checked with the real helm binary and kubernetes-validate.

Every rendered object of a values matrix is validated for the oldest and newest supported
Kubernetes versions; the kinds kubernetes-validate does not know are validated against
their own schemas (the Prometheus Operator's CRD models), never skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from kubetitan_core import crd as crdmod
from kubetitan import rbac
from kubetitan.monitoring import alerts, config as mcfg

from chartlib import CHART, MATRIX, MATRIX_IDS, NAMESPACE, REPO, by_kind, helm, render, values_args
from support import yamlio

pytestmark = pytest.mark.xdist_group("chart")
"""One worker: each process that validates a monitoring object imports cloudcoil's prometheus-operator models
(~2.3 CPU s), and kubernetes-validate's schemas for both versions, once."""

KUBE_VERSIONS = ["1.27", "1.35"]
PROM_OPERATOR_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
"""Checked against cloudcoil's models of the prometheus-operator CRDs (imported on first use, not at collection: it
would be in every xdist worker then)."""


def _dropped(sent: Any, kept: Any, path: str = "") -> list[str]:
    """Fields present in ``sent`` but missing from ``kept`` (what a non-strict model dropped)."""
    if isinstance(sent, dict):
        out = []
        for k, v in sent.items():
            if not isinstance(kept, dict) or k not in kept:
                out.append(f"{path}.{k}")
            else:
                out += _dropped(v, kept[k], f"{path}.{k}")
        return out
    if isinstance(sent, list):
        return [p for i, v in enumerate(sent) for p in _dropped(v, kept[i] if i < len(kept) else None, f"{path}[{i}]")]
    return []


def validate_object(doc: dict[str, Any], kube: str) -> str:
    """Validate one rendered object; returns how (asserted per kind by the caller)."""
    kind = doc["kind"]
    if kind in PROM_OPERATOR_KINDS:
        # Prometheus Operator CRDs are not in kubernetes-validate: check against the CRD's own
        # schema (cloudcoil's generated models); the models ignore unknown fields, so compare
        # what they kept with what was sent to get strict behaviour.
        from cloudcoil.models.prometheus_operator import v1 as promop

        model = getattr(promop, kind).model_validate(doc)
        kept = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert not _dropped(doc, kept), f"{kind}: unknown fields {_dropped(doc, kept)}"
        return "prometheus-operator-schema"
    if kind == "CustomResourceDefinition" and doc["metadata"]["name"] == "llamapretrains.kubetitan.io" and kube == "1.27":
        # 1.27's ValidationRule has no fieldPath/reason (added in 1.28): the chart's CRD is the
        # 1.28+ one; on 1.27 install the variant `kubetitan crd --kubernetes-version 1.27` gives
        # (docs/install.md). Validate that variant, and that the chart's copy differs only there.
        variant = crdmod.crd(kubernetes_version="1.27")
        assert kubernetes_validate.validate(variant, kube, strict=True) == kube
        with pytest.raises(kubernetes_validate.ValidationError, match="fieldPath|reason"):
            kubernetes_validate.validate(doc, kube, strict=True)
        return "kubernetes-validate-1.27-variant"
    assert kubernetes_validate.validate(doc, kube, strict=True) == kube
    return "kubernetes-validate"


# --------------------------------------------------------------------------- lint + validate
@pytest.mark.parametrize("files, sets", [m[1:] for m in MATRIX], ids=MATRIX_IDS)
def test_helm_lint_strict(files, sets):
    proc = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(files, sets))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("files, sets", [m[1:] for m in MATRIX], ids=MATRIX_IDS)
def test_every_rendered_object_validates(files, sets, kube):
    docs = render(files, sets)
    how = {validate_object(doc, kube) for doc in docs}
    assert "kubernetes-validate" in how
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "Service", "ClusterRole"} <= kinds


def test_monitoring_matrix_renders_every_optional_kind():
    kinds = {d["kind"] for d in render(*MATRIX[MATRIX_IDS.index("monitoring")][1:])}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} <= kinds
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} & {d["kind"] for d in render()}


def test_strict_check_catches_unknown_prometheus_operator_fields():
    doc = by_kind(render([], ["monitoring.podMonitor.enabled=true"]), "PodMonitor")[0]
    doc["spec"]["podMetricsEndpoints"][0]["scrapeIntervall"] = "1s"
    with pytest.raises(AssertionError, match="scrapeIntervall"):
        validate_object(doc, "1.35")


# ------------------------------------------------------------------------- generated files
def test_chart_crd_is_byte_identical_to_generated_crd():
    src = REPO / "crds" / "kubetitan.io_llamapretrains.yaml"
    assert (CHART / "crds" / src.name).read_bytes() == src.read_bytes()


def test_generated_chart_files_have_no_drift():
    proc = subprocess.run([sys.executable, str(REPO / "charts" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_prometheusrule_is_the_generated_rules_file_with_the_configured_runbook_base():
    base = "https://runbooks.example.internal/kubetitan"
    rule = by_kind(render([], ["monitoring.rules.enabled=true", f"monitoring.rules.runbookBaseURL={base}"]),
                   "PrometheusRule")[0]
    want = alerts.rule_groups(mcfg.MonitoringConfig(runbook_url_base=base))
    assert rule["spec"] == want
    # The chart's default base and the generator's are the same string (the template replaces it).
    assert yamlio.load((CHART / "values.yaml").read_text())["monitoring"]["rules"]["runbookBaseURL"] == mcfg.DEFAULT.runbook_url_base
    assert mcfg.DEFAULT.runbook_url_base in (CHART / "templates" / "prometheusrule.yaml").read_text()


@pytest.mark.parametrize("label, value", [("grafana_dashboard", "1"), ("example.com/dashboards", "kubetitan")],
                         ids=["kube-prometheus-stack", "custom"])
def test_dashboard_configmaps_carry_the_sidecar_label(label, value):
    cms = by_kind(render([], ["monitoring.dashboards.enabled=true", f"monitoring.dashboards.label={label}",
                              f"str:monitoring.dashboards.labelValue={value}"]), "ConfigMap")
    assert sorted(next(iter(cm["data"])) for cm in cms) == ["kubetitan-operator.json", "kubetitan-run.json"]
    for cm in cms:
        assert cm["metadata"]["labels"][label] == value
        (name, body), = cm["data"].items()
        assert json.loads(body) == json.loads((CHART / "files" / "dashboards" / name).read_text())


# ------------------------------------------------------------------------------------ RBAC
def _triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def _table(exclude: set[str]) -> set[tuple[str, str, str]]:
    return {(row.api_group, row.resource, v) for row in rbac.RULES if row.resource not in exclude for v in row.verbs}


LEASE_ROWS = set(rbac.LEADER_ELECTION) | set(rbac.WEBHOOK_CERTIFICATES)
"""Granted by objects of their own: the Lease by a Role in the release namespace (``*-leader-election``), the
webhook's certificates by a Role and a ClusterRole limited to the chart's Secret and configuration
(``*-webhook-certificates``), and in namespaced mode the Events about that configuration by a Role in ``default``
(``*-webhook-events``; test_webhook_chart)."""


@pytest.mark.parametrize(
    "sets, role_namespaces, want_cluster, want_role",
    [
        ([], [], _table(LEASE_ROWS), set()),
        (["watch.mode=namespaced", "watch.namespaces={ml,research}"], ["ml", "research"],
         _table({"namespaces"} | {r.resource for r in rbac.RULES if r.resource not in rbac.CLUSTER_SCOPED}),
         _table(set(rbac.CLUSTER_SCOPED) | LEASE_ROWS)),
        (["watch.mode=namespaced"], [NAMESPACE],
         _table({"namespaces"} | {r.resource for r in rbac.RULES if r.resource not in rbac.CLUSTER_SCOPED}),
         _table(set(rbac.CLUSTER_SCOPED) | LEASE_ROWS)),
    ],
    ids=["cluster", "namespaced", "namespaced-release-namespace"],
)
def test_rbac_grants_exactly_the_declared_table(sets, role_namespaces, want_cluster, want_role):
    docs = [d for d in render([], sets) if not d["metadata"]["name"].endswith(("-webhook-certificates",
                                                                               "-webhook-events"))]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert _triples(cluster_role["rules"]) == want_cluster
    roles = by_kind(docs, "Role")
    (lease_role,) = [r for r in roles if r["metadata"]["name"].endswith("-leader-election")]
    assert lease_role["metadata"]["namespace"] == NAMESPACE
    assert _triples(lease_role["rules"]) == {t for t in _table(set()) if t[1] in rbac.LEADER_ELECTION}
    roles = [r for r in roles if r is not lease_role]
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(role_namespaces)
    for role in roles:
        assert _triples(role["rules"]) == want_role
        assert not {r for _, r, _ in _triples(role["rules"])} & rbac.CLUSTER_SCOPED
    bindings = by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding")
    assert len(bindings) == len(roles) + 2  # + the ClusterRoleBinding and the Lease's RoleBinding
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "kt-kubetitan", "namespace": NAMESPACE}]
    # Together the objects grant the whole table (less namespace discovery in namespaced mode).
    assert _triples(cluster_role["rules"]) | want_role | _triples(lease_role["rules"]) <= _table(set())


@pytest.mark.parametrize("files, sets", [m[1:] for m in MATRIX], ids=MATRIX_IDS)
def test_rbac_has_no_wildcards(files, sets):
    for doc in by_kind(render(files, sets), "Role") + by_kind(render(files, sets), "ClusterRole"):
        for rule in doc["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key] and all("*" not in x for x in rule[key]), rule


# ------------------------------------------------------------------------- operator pod
@pytest.mark.parametrize("files, sets", [m[1:] for m in MATRIX], ids=MATRIX_IDS)
def test_operator_pod_is_hardened_and_probed(files, sets):
    (dep,) = by_kind(render(files, sets), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] and sc["runAsNonRoot"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["port"] == c["readinessProbe"]["httpGet"]["port"] == "health"
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in c["args"]
    assert f"--metrics-port={ports['metrics']}" in c["args"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    replicas = dep["spec"]["replicas"]
    assert replicas == 1 or "--leader-elect" in c["args"], "HA needs the leader Lease"


@pytest.mark.parametrize(
    "sets, want_args",
    [
        ([], ["--all-namespaces", "--leader-elect", "--leader-elect-resource-name=kt-kubetitan",
              f"--leader-elect-resource-namespace={NAMESPACE}", "--leader-elect-lease-duration=15",
              "--leader-elect-renew-deadline=10", "--leader-elect-retry-period=2"]),
        (["watch.mode=namespaced", "watch.namespaces={a,b}", "leaderElection.leaseName=kt-lock",
          "leaderElection.leaseDurationSeconds=30", "leaderElection.renewDeadlineSeconds=20"],
         ["--namespace=a", "--namespace=b", "--leader-elect", "--leader-elect-resource-name=kt-lock",
          f"--leader-elect-resource-namespace={NAMESPACE}", "--leader-elect-lease-duration=30",
          "--leader-elect-renew-deadline=20", "--leader-elect-retry-period=2"]),
        (["replicaCount=1", "leaderElection.enabled=false"], ["--all-namespaces"]),
    ],
    ids=["cluster", "namespaced", "standalone"],
)
def test_watch_mode_and_leader_election(sets, want_args):
    docs = render([], sets)
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--all-namespaces", "--namespace", "--leader-elect"))] == want_args
    assert not [d for d in docs if "kopf.dev" in d.get("apiVersion", "")]


# -------------------------------------------------------------------------- values schema
@pytest.mark.parametrize(
    "sets, message",
    [
        (["replicaCount=-1"], "replicaCount: Must be greater than or equal to 0"),
        (["watch.mode=everywhere"], "watch.mode: watch.mode must be one of the following"),
        (["watch.namespaces={Bad_Name}"], "watch.namespaces.0: Does not match pattern"),
        (["operator.metricsPort=80"], "operator.metricsPort: Must be greater than or equal to 1024"),
        (["image.pullPolicy=Sometimes"], "image.pullPolicy: image.pullPolicy must be one of the following"),
        (["monitoring.podMonitor.interval=fast"], "monitoring.podMonitor.interval: Does not match pattern"),
        (["monitoring.rules.runbookBaseURL=docs/runbook.md"], "runbookBaseURL: Does not match pattern '^https?://'"),
        (["monitoring.dashboard.enabled=true"], "Additional property dashboard is not allowed"),
        (["replicas=3"], "Additional property replicas is not allowed"),
        (["operator.logFormat=xml"], "operator.logFormat: operator.logFormat must be one of the following"),
        (["operator.verbose=maybe"], "operator.verbose: Invalid type. Expected: boolean, given: string"),
        (["leaderElection.retryPeriodSeconds=0"], "leaderElection.retryPeriodSeconds: Must be greater than or equal to 1"),
        (["leaderElection.leaseName=Bad_Name"], "leaderElection.leaseName: Does not match pattern"),
    ],
    ids=["replicas-negative", "bad-mode", "bad-namespace", "privileged-port", "pull-policy", "bad-interval",
         "relative-runbook", "typo-nested", "typo-top", "log-format", "verbose", "lease-retry-zero", "lease-name"],
)
def test_invalid_values_are_rejected_with_a_clear_message(sets, message):
    proc = helm("template", "kt", str(CHART), *values_args([], sets), check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(("sets", "message"), [
    (["leaderElection.leaseDurationSeconds=10"], "leaseDurationSeconds must be longer than leaderElection.renewDeadline"),
    (["leaderElection.retryPeriodSeconds=9"], "renewDeadlineSeconds must be longer than 1.2 x"),
], ids=["lease-not-longer-than-deadline", "deadline-vs-retry"])
def test_lease_durations_are_checked_at_render_time(sets, message):
    """The operator's own rules (kubetitan.leader.LeaseConfig.problems) fail the install, not the pods."""
    proc = helm("template", "kt", str(CHART), *values_args([], sets), check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_replicas_without_leader_election_fail_with_a_fix():
    proc = helm("template", "kt", str(CHART), "--set", "leaderElection.enabled=false", check=False)
    assert proc.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled=true" in proc.stderr
    proc = helm("template", "kt", str(CHART), "--set", "peering.enabled=true", check=False)
    assert proc.returncode != 0 and "peering was removed" in proc.stderr and "leaderElection.enabled" in proc.stderr


def _schema_paths(schema: dict[str, Any], defs: dict[str, Any], value: Any, path: str) -> list[str]:
    """Paths of ``value`` the schema does not describe (every key needs a described property)."""
    if "$ref" in schema:
        schema = {**defs[schema["$ref"].split("/")[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}
    missing = []
    if isinstance(value, dict) and "properties" in schema:
        assert schema.get("additionalProperties") is False, f"{path or '<root>'}: additionalProperties must be false"
        for k, v in value.items():
            if k not in schema["properties"]:
                missing.append(f"{path}.{k}")
            else:
                missing += _schema_paths(schema["properties"][k], defs, v, f"{path}.{k}")
    return missing


@pytest.mark.parametrize("values_file", ["values.yaml", "values-eks-p5.yaml", "values-hyperpod.yaml"])
def test_values_schema_covers_every_value(values_file):
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yamlio.load((CHART / values_file).read_text())
    assert _schema_paths(schema, schema["definitions"], values, "") == []
    jsonschema.validate(values, schema)
    # ... and every top-level property has a description or is an object of described ones.
    for key, prop in schema["properties"].items():
        assert prop.get("description") or "$ref" in prop, key


# ------------------------------------------------------------------- trainer pods, NOTES
@pytest.mark.parametrize("example", ["debug-cpu.yaml", "llama3-8b-p5-4node.yaml", "llama3-8b-hyperpod.yaml"])
def test_trainer_pods_get_no_api_token_and_match_the_podmonitor(example):
    out = subprocess.run([str(Path(sys.executable).parent / "kubetitan"), "render", str(REPO / "examples" / example)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    pods = [d for d in yamlio.load_all(out) if d and d["kind"] == "Pod"]
    assert pods
    (pm,) = by_kind(render([], ["monitoring.podMonitor.enabled=true"]), "PodMonitor")
    (expr,) = pm["spec"]["selector"]["matchExpressions"]
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    for pod in pods:
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert expr["operator"] == "Exists" and expr["key"] in pod["metadata"]["labels"]
        assert port in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        relabel_sources = {s for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"] for s in r.get("sourceLabels", [])}
        for src in relabel_sources:
            label = src.removeprefix("__meta_kubernetes_pod_label_")
            assert any(k.replace(".", "_").replace("/", "_") == label for k in pod["metadata"]["labels"]), src


HOST_PATH_REFUSED = "which this release's\n   policy refuses: policy.hostPathPrefixes is empty"
ROLLOUT = "rollout status deploy/kt-kubetitan"
OUT_OF_CLUSTER = "Run the operator yourself, out of cluster"
ARGS = "get deploy/kt-kubetitan \\\n       -o jsonpath='{.spec.template.spec.containers[0].args}'"


@pytest.mark.parametrize(
    "sets, expect, absent",
    [
        ([], ["watches LlamaPretrains in ALL namespaces", "Monitoring is off", "kubectl apply -n <namespace>",
              ROLLOUT, "kubetitan validate --policy kt-values.yaml", HOST_PATH_REFUSED,
              "helm upgrade kt <chart> -n kubetitan-system --reuse-values --set 'policy.hostPathPrefixes="],
         [OUT_OF_CLUSTER]),
        (["watch.mode=namespaced", "watch.namespaces={ml}", "monitoring.rules.enabled=true",
          "policy.hostPathPrefixes={/var/lib/kubetitan}"],
         ["watches LlamaPretrains in: ml.", "kubectl apply -n ml", "PrometheusRule (alerts", ROLLOUT],
         [HOST_PATH_REFUSED]),
        (["replicaCount=0", "webhook.url=https://127.0.0.1:9443"],
         [OUT_OF_CLUSTER, "calls its webhook at\n   https://127.0.0.1:9443/validate-llamapretrain", ARGS,
          "create token kt-kubetitan"],
         [ROLLOUT, "replica(s)", "the others stand by"]),
        (["replicaCount=0", "webhook.url=https://127.0.0.1:9443", "webhook.enabled=false"],
         [OUT_OF_CLUSTER, ARGS], ["calls its webhook"]),
        (["replicaCount=0"], ["the webhook (failurePolicy Fail) refuses every create",
                              "helm upgrade kt <chart> -n kubetitan-system --reuse-values --set replicaCount=2"],
         [ROLLOUT, OUT_OF_CLUSTER]),
        (["replicaCount=0", "leaderElection.enabled=false", "webhook.failurePolicy=Ignore"],
         ["the webhook (failurePolicy Ignore) admits creates unchecked", "--set replicaCount=1"],
         ["refuses every create", "leader election"]),
    ],
    ids=["defaults", "namespaced-monitoring-hostpath-allowed", "out-of-cluster", "out-of-cluster-no-webhook",
         "no-replica", "no-replica-no-election-ignore"],
)
def test_notes_tell_what_to_run_next(tmp_path, sets, expect, absent):
    # helm prints NOTES only on install (which needs a cluster): render them as a ConfigMap
    # through `tpl` in a copy of the chart.
    chart = tmp_path / "kubetitan"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes-probe.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    out = helm("template", "kt", str(chart), "-n", NAMESPACE, "--show-only", "templates/notes-probe.yaml",
               *values_args([], sets)).stdout
    notes = yamlio.load(out)["data"]["notes"]
    for text in expect:
        assert text in notes, notes
    for text in absent:
        assert text not in notes, notes


@pytest.mark.parametrize(
    "sets, want",
    [
        ([], {"all_namespaces": True, "namespaces": [], "leader_elect": True}),
        (["watch.mode=namespaced", "watch.namespaces={a,b}"],
         {"all_namespaces": False, "namespaces": ["a", "b"], "leader_elect": True}),
        (["replicaCount=1", "leaderElection.enabled=false", "operator.verbose=true"],
         {"all_namespaces": True, "namespaces": [], "leader_elect": False}),
    ],
    ids=["cluster", "namespaced", "standalone"],
)
def test_the_operator_accepts_the_rendered_command_line(sets, want):
    """The container runs ``kubetitan operator`` with the rendered arguments, and the operator's own argument parser
    accepts them."""
    from kubetitan import runner

    (c,) = by_kind(render([], sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kubetitan", "operator"]
    p = runner.build_parser().parse_args(c["args"])
    assert {"all_namespaces": p.all_namespaces, "namespaces": p.namespace, "leader_elect": p.leader_elect} == want
    if p.leader_elect:  # the rendered Lease settings pass the operator's own check (client-go's rules)
        assert runner.lease_from_args(p).problems() == []
    assert p.metrics_port == 8080 and p.liveness == "http://0.0.0.0:8081/healthz" and p.log_format == "json"
    assert (p.scrape_max_bytes, p.scrape_timeout, p.scrape_concurrency) == (4194304, 3.0, 8)  # values.yaml's
    if not want["leader_elect"]:
        assert p.verbose is True


def test_the_scrape_bounds_reach_the_operator_and_nonsense_is_refused():
    """operator.scrape.* become --scrape-* flags the operator parses; a bound of 0 fails `helm template` (schema)."""
    from kubetitan import runner

    sets = ["operator.scrape.maxBytes=1048576", "operator.scrape.timeoutSeconds=2", "operator.scrape.concurrency=2"]
    (c,) = by_kind(render([], sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    opts = runner.options_from_args(runner.build_parser().parse_args(c["args"]))
    assert (opts.scrape_max_bytes, opts.scrape_timeout, opts.scrape_concurrency) == (1048576, 2.0, 2)
    with pytest.raises(AssertionError, match=r"(?s)failed:.*operator.scrape.maxBytes"):
        render([], ["operator.scrape.maxBytes=0"])


def test_the_pod_group_switch_reaches_the_operator_and_nonsense_is_refused():
    """operator.podGroups becomes --pod-groups (default auto)."""
    from kubetitan import runner

    def parsed(sets):
        (c,) = by_kind(render([], sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
        return runner.options_from_args(runner.build_parser().parse_args(c["args"]))

    assert parsed([]).pod_groups == "auto"
    assert parsed(["operator.podGroups=disabled"]).pod_groups == "disabled"
    with pytest.raises(AssertionError, match=r"(?s)failed:.*podGroups"):
        render([], ["operator.podGroups=off"])


def test_the_resize_interval_reaches_the_operator_and_nonsense_is_refused():
    """operator.resizeMinIntervalSeconds becomes --resize-min-interval-seconds (the default is the operator's own)."""
    from kubetitan import observation, runner

    def parsed(sets):
        (c,) = by_kind(render([], sets), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
        return runner.options_from_args(runner.build_parser().parse_args(c["args"]))

    assert parsed([]).resize_min_interval_seconds == observation.DEFAULT_RESIZE_MIN_INTERVAL_SECONDS
    assert parsed(["operator.resizeMinIntervalSeconds=1800"]).resize_min_interval_seconds == 1800
    with pytest.raises(AssertionError, match=r"(?s)failed:.*resizeMinIntervalSeconds"):
        render([], ["operator.resizeMinIntervalSeconds=0"])
