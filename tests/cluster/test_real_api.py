"""The product against a real kube-apiserver (built from k8s.io/kubernetes by ``make cluster``): the chart installed
with helm, the CRD's schema and CEL rules as the server enforces them, the webhook called by the server, the
requester checks answered by the server's authorizer, server-side apply, ``kubectl explain``, PodSecurity,
ResourceQuota and garbage collection by the controller-manager.

Where these tests and the API double (tests/kmockx) disagree, the real server is right: docs/testing.md lists each
difference found and what changed.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetitan import plan
from kubetitan_core.validation import parse
from support import forkrun
from support.cluster import LPT, PODS, ApiError, ControlPlane, KubeCluster, kubernetes_version
from support.crd_answers import CEL_IDS, CORPUS, CRD, cel_ids, post_dry_run
from support.paths import EXAMPLES, REPO, load_example
from support.release import HELM, Release, kubectl, run_tool
from support.specs import cpu_spec, lpt, make_lpt
from support import yamlio

pytestmark = pytest.mark.xdist_group("real-cluster")
DENIED = 'admission webhook "validate.llamapretrains.kubetitan.io" denied the request'


def test_the_server_is_the_pinned_kubernetes(control_plane: ControlPlane) -> None:
    assert control_plane.version()["gitVersion"] == kubernetes_version()


def test_helm_installs_the_chart_and_the_crd_is_established(control_plane: ControlPlane, release: Release) -> None:
    crd = control_plane.admin.get("apiextensions.k8s.io/v1/customresourcedefinitions", None,
                                  "llamapretrains.kubetitan.io")
    assert crd is not None
    conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conds.get("Established") == "True" and conds.get("NamesAccepted") == "True", conds
    kinds = {d["kind"] for d in release.manifest}
    assert {"ClusterRole", "ServiceAccount", "ValidatingWebhookConfiguration", "Deployment"} <= kinds, kinds
    out = kubectl("get", "lpt", "-A", kubeconfig=control_plane.admin_kubeconfig)
    assert out.returncode == 0  # the short name and the printer columns are served


def test_kubectl_explain_reads_the_typed_spec_descriptions(control_plane: ControlPlane, release: Release) -> None:
    out = kubectl("explain", "llamapretrain.spec.training", kubeconfig=control_plane.admin_kubeconfig).stdout
    assert "LlamaPretrain" in out and "seqLen" in out, out
    training = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["training"]
    for field in ("seqLen", "steps", "localBatchSize"):
        description = " ".join(training["properties"][field]["description"].split())
        assert description[:60] in " ".join(out.split()), (field, description, out)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_every_corpus_spec_is_refused_by_the_real_server_as_the_validator_refuses_it(
        case: dict[str, Any], control_plane: ControlPlane, operator: Any, dry_run_namespace: str) -> None:
    """The CRD's OpenAPI schema and CEL rules run in the server before any webhook: a spec they refuse is answered
    422 with exactly the CEL rules the Python validator reports for it; a spec they pass reaches the webhook, which
    refuses it with the validator's errors."""
    doc = make_lpt(case["spec"], name="c", namespace=dry_run_namespace)
    _, errors = parse(make_lpt(case["spec"]))
    py = {e.rule for e in errors}
    code, body, _ = post_dry_run(control_plane.admin, doc)
    assert code in (400, 403, 422), (code, body)
    message = body.get("message", "")
    if DENIED in message:
        assert not py & CEL_IDS and "schema" not in py, f"the CRD let through {sorted(py & CEL_IDS)}: {message}"
        for e in errors:
            assert e.path in message, (e.path, message)
    elif code == 400:  # strict decoding: an unknown field, before any validation
        assert body.get("reason") == "BadRequest" and "unknown field" in message and "schema" in py, body
    else:
        assert code == 422 and body.get("reason") == "Invalid", body
        assert cel_ids(body) == py & CEL_IDS, (message, sorted(py))


@pytest.fixture(scope="module")
def release_values(control_plane: ControlPlane, release: Release, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed release's values as the chart's NOTES tell users to save them (``helm get values --all``)."""
    values = tmp_path_factory.mktemp("release") / "values.yaml"
    values.write_text(run_tool(HELM, "get", "values", release.name, "-n", release.namespace, "--all",
                               kubeconfig=control_plane.admin_kubeconfig).stdout)
    return values


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_through_kubectl_dry_run_server_as_kubetitan_validate_says(
        path: Path, control_plane: ControlPlane, release_values: Path, operator: Any, dry_run_namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kubectl apply --dry-run=server`` of each example (CRD, CEL, the webhook with the chart's default policy)
    agrees with ``kubetitan validate --policy`` of the release's own values, as the chart's NOTES say to get them
    (``helm get values RELEASE --all``; ``validate``'s ``main`` runs in this process: the command's process itself
    is tests/api/test_cli.py's)."""
    from kubetitan import cli as kubetitan_cli

    code = kubetitan_cli.main(["validate", "--policy", str(release_values), str(path)])
    said = capsys.readouterr()
    own = yamlio.load(path.read_text())["metadata"].get("namespace")
    if own:
        control_plane.admin.ensure_namespace(own)
    out = kubectl("apply", "--dry-run=server", "-n", own or dry_run_namespace, "-f", str(path),
                  kubeconfig=control_plane.admin_kubeconfig, check=False)
    assert (out.returncode == 0) == (code == 0), (out.stdout, out.stderr, said.out, said.err)
    if out.returncode:
        assert DENIED in out.stderr, out.stderr  # refused by the admin policy in the webhook, not by the schema


def test_a_refusal_and_a_warning_through_real_kubectl(control_plane: ControlPlane, operator: Any,
                                                      namespace: str, tmp_path: Path) -> None:
    bad = lpt("bad", {**cpu_spec(), "parallelism": {"dataParallelShardDegree": 3}}, namespace=namespace)
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    out = kubectl("apply", "-f", str(f), kubeconfig=control_plane.admin_kubeconfig, check=False)
    assert out.returncode != 0 and "spec.parallelism" in out.stderr, out.stderr
    warned = lpt("warned", {**cpu_spec(), "checkpoint": {**cpu_spec()["checkpoint"], "intervalSteps": 1000}},
                 namespace=namespace)
    f.write_text(yaml.safe_dump(warned))
    out = kubectl("apply", "--dry-run=server", "-f", str(f), kubeconfig=control_plane.admin_kubeconfig)
    assert "Warning: [checkpoint.interval-beyond-run]" in out.stderr, out.stderr


def test_server_side_apply_of_a_run_tracks_its_field_managers(control_plane: ControlPlane, operator: Any,
                                                                namespace: str, tmp_path: Path) -> None:
    """``kubectl apply --server-side`` creates and updates a run (the double answered NotFound), and a second
    manager's conflicting change is refused until forced."""
    doc = lpt("ssa", cpu_spec(), namespace=namespace)
    doc["spec"]["runPolicy"]["suspend"] = True  # nothing to reconcile into pods
    f = tmp_path / "ssa.yaml"
    f.write_text(yaml.safe_dump(doc))
    kc = control_plane.admin_kubeconfig
    out = kubectl("apply", "--server-side", "--field-manager=alice", "-f", str(f), kubeconfig=kc)
    assert "serverside-applied" in out.stdout, out.stdout
    doc["spec"]["training"]["steps"] = 200
    f.write_text(yaml.safe_dump(doc))
    kubectl("apply", "--server-side", "--field-manager=alice", "-f", str(f), kubeconfig=kc)
    obj = control_plane.admin.get(LPT, namespace, "ssa")
    assert obj["spec"]["training"]["steps"] == 200 and obj["metadata"]["generation"] == 2
    assert "alice" in {m["manager"] for m in obj["metadata"]["managedFields"]}
    doc["spec"]["training"]["steps"] = 300
    f.write_text(yaml.safe_dump(doc))
    out = kubectl("apply", "--server-side", "--field-manager=bob", "-f", str(f), kubeconfig=kc, check=False)
    assert out.returncode != 0 and "conflict" in out.stderr.lower(), out.stderr
    kubectl("apply", "--server-side", "--field-manager=bob", "--force-conflicts", "-f", str(f), kubeconfig=kc)
    assert control_plane.admin.get(LPT, namespace, "ssa")["spec"]["training"]["steps"] == 300


def _tenant(control_plane: ControlPlane, namespace: str, name: str) -> Path:
    """A tenant (``ControlPlane.tenant``: LlamaPretrains and their pods' logs and events in ``namespace``) who may
    also read the team's checkpoint claim, and nothing else; the server's RBAC authorizer judges."""
    return control_plane.tenant(name, namespace, ({"apiGroups": [""], "resources": ["persistentvolumeclaims"],
                                                   "verbs": ["get"], "resourceNames": ["ckpt"]},))


def test_requester_checks_are_answered_by_the_servers_authorizer(
        control_plane: ControlPlane, operator: Any, namespace: str, tmp_path: Path) -> None:
    """A tenant may not make the operator mount a Secret she could not read herself: the webhook's
    SubjectAccessReview is answered by the real RBAC authorizer, and a grant (a Role on that one Secret) lets the
    same spec through."""
    alice = _tenant(control_plane, namespace, "alice")
    f = tmp_path / "run.yaml"

    def create(name: str, secret: str) -> subprocess.CompletedProcess[str]:
        spec = cpu_spec()
        spec["runPolicy"]["suspend"] = True
        spec["resources"]["env"] = [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret,
                                                                                             "key": "k"}}}]
        f.write_text(yaml.safe_dump(lpt(name, spec, namespace=namespace)))
        return kubectl("create", "-f", str(f), kubeconfig=alice, check=False)

    out = create("denied", "admin-creds")
    assert out.returncode != 0 and DENIED in out.stderr, out.stderr
    assert "spec.resources.env[0].valueFrom.secretKeyRef.name: Secret admin-creds" in out.stderr, out.stderr
    assert "may not get secrets 'admin-creds'" in out.stderr, out.stderr
    control_plane.admin.create("rbac.authorization.k8s.io/v1/roles", namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "alice-team-creds"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["team-creds"]}]})
    control_plane.admin.create("rbac.authorization.k8s.io/v1/rolebindings", namespace, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "alice-team-creds"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice-team-creds"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]})
    out = create("granted", "team-creds")
    assert out.returncode == 0, out.stderr
    # what she may not do herself, the server refuses her directly too (no Role of hers names that Secret)
    out = kubectl("get", "secret", "admin-creds", "-n", namespace, kubeconfig=alice, check=False)
    assert out.returncode != 0 and "forbidden" in out.stderr.lower(), out.stderr
    out = kubectl("delete", "lpt", "granted", "-n", namespace, kubeconfig=alice, check=False)
    assert out.returncode == 0, out.stderr  # her own run she may delete (ControlPlane.tenant's Role)


def test_a_tenant_cannot_move_an_admins_secret_into_her_code_by_editing_the_run(
        control_plane: ControlPlane, operator: Any, namespace: str) -> None:
    """Two users through real kubectl: the admin's run uses Secret db-creds as an image pull secret (only the kubelet
    reads it); alice, who may patch runs but not read db-creds, moves it into ``env`` and swaps the image. The edit
    is checked as if she created the run as it now stands: refused, naming the field and the access she lacks."""
    alice = _tenant(control_plane, namespace, "alice")
    spec = cpu_spec()
    spec["runPolicy"]["suspend"] = True
    spec["resources"]["imagePullSecrets"] = ["db-creds"]
    control_plane.admin.create(LPT, namespace, lpt("admins-run", spec, namespace=namespace))
    patch = {"spec": {"resources": {"image": "tenant.example/mine:1", "env": [
        {"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db-creds", "key": "password"}}}]}}}
    out = kubectl("patch", "lpt", "admins-run", "-n", namespace, "--type", "merge", "-p", json.dumps(patch),
                  kubeconfig=alice, check=False)
    assert out.returncode != 0 and DENIED in out.stderr, out.stderr
    assert "spec.resources.env[0].valueFrom.secretKeyRef.name: Secret db-creds" in out.stderr, out.stderr
    assert "may not get secrets 'db-creds'" in out.stderr, out.stderr
    stored = control_plane.admin.get(LPT, namespace, "admins-run")
    assert "env" not in stored["spec"]["resources"], stored["spec"]["resources"]
    assert stored["spec"]["resources"]["image"] == "kubetitan/trainer:0.1.0"  # the default, unchanged


# ------------------------------------------------------------------------------------------------ Pod Security
HOSTPATH_ALLOWANCE = {'restricted volume types (volume "checkpoints" uses restricted volume type "hostPath")'}
"""The one documented allowance (docs/install.md, "Admin policy"): the single-node examples' hostPath checkpoint
volume, which Pod Security forbids from ``baseline`` up (``restricted``'s volume-type check supersedes baseline's
hostPath check, so the server names only the former)."""


def _rendered_pods(doc: dict[str, Any], namespace: str) -> tuple[Any, list[dict[str, Any]]]:
    doc["metadata"].update(namespace=namespace, uid="6f1c2d1e-0000-4000-8000-000000000001")
    run, errors = parse(doc)
    assert not errors, errors
    return run, [c for c in plan.attempt_children(run, attempt=1, avoid_nodes=["n1"]) if c["kind"] == "Pod"]


def _pod_security_violations(api: Any, namespace: str, pod: dict[str, Any]) -> set[str]:
    """What the server's PodSecurity admission says of ``pod`` in ``namespace`` (a dry-run create: nothing is
    stored); an empty set when it is admitted. The pod goes without its ``priorityClassName``: PodSecurity does not
    read it, and the Priority admission plugin looks classes up in its informer's cache only, so a class created
    a moment before may not be there yet (a 403 "no PriorityClass with name ... was found" that says nothing of
    the pod's security)."""
    spec = {k: v for k, v in pod["spec"].items() if k != "priorityClassName"}
    pod = {**pod, "metadata": {**pod["metadata"], "namespace": namespace, "ownerReferences": []}, "spec": spec}
    try:
        api.create(PODS, namespace, pod, dryRun="All")
    except ApiError as e:
        message = e.body.get("message", "") if isinstance(e.body, dict) else str(e.body)
        assert e.status == 403 and 'violates PodSecurity "restricted:latest": ' in message, (e.status, message)
        return set(re.split(r", (?=[a-zA-Z][^(]* \()", message.split('restricted:latest": ', 1)[1]))
    return set()


@pytest.fixture
def restricted(control_plane: ControlPlane, namespace: str) -> str:
    """The test's namespace, enforcing Pod Security ``restricted``."""
    api = control_plane.admin
    api.patch("v1/namespaces", None, namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    return namespace


def test_every_examples_pods_and_the_prepare_job_pass_pod_security_restricted(
        control_plane: ControlPlane, restricted: str) -> None:
    """The server's own PodSecurity admission (``restricted:latest``) judges every example's rendered pods and the
    prepare-data Job's pod: admitted, except the documented hostPath allowance of the single-node examples."""
    api = control_plane.admin
    accounts: set[str] = set()
    for path in EXAMPLES:
        run, pods = _rendered_pods(load_example(path), restricted)
        assert pods, path
        for pod in pods:
            sa = pod["spec"].get("serviceAccountName")
            if sa and sa not in accounts:  # the ServiceAccount admission plugin wants it to exist
                api.create("v1/serviceaccounts", restricted, {"apiVersion": "v1", "kind": "ServiceAccount",
                                                               "metadata": {"name": sa}})
                accounts.add(sa)
            found = _pod_security_violations(api, restricted, pod)
            want = HOSTPATH_ALLOWANCE if run.spec.checkpoint.storage.host_path else set()
            assert found == want, (path.name, found)
    job = yamlio.load(subprocess.run(
        [*forkrun.python(), "-m", "kubetitan.cli", "prepare-data", "--render-job", "/data/in", "-o", "/data/shards",
         "--parts", "2", "--job-name", "prep", "--job-namespace", restricted, "--job-image", "trainer:test",
         "--job-claim", "corpus", "--job-mount-path", "/data"], capture_output=True, text=True, check=True).stdout)
    template = job["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template.get("metadata", {}), "name": "prep-0"},
           "spec": template["spec"]}
    assert _pod_security_violations(api, restricted, pod) == set()


def test_the_hostpath_examples_are_exactly_the_documented_single_node_ones() -> None:
    """The allowance above is not a blanket one: docs/install.md names these examples."""
    host_path = {p.stem for p in EXAMPLES if parse(load_example(p))[0].spec.checkpoint.storage.host_path}
    assert host_path == {"debug-cpu", "llama3-1b-h200", "llama3-3b-h200"}
    install = (REPO / "docs" / "install.md").read_text()
    for stem in host_path:
        assert f"examples/{stem}.yaml" in install


def test_a_pod_without_the_security_context_is_refused_restricted(control_plane: ControlPlane,
                                                                    restricted: str) -> None:
    """The check is real: the same pod without its security contexts breaks four of ``restricted``'s rules."""
    _, pods = _rendered_pods(make_lpt({"resources": {"instanceType": "p5.48xlarge", "platform": "eks"},
                                       "checkpoint": {"storage": {"persistentVolumeClaim": {"claimName": "ck"}}}}),
                             restricted)
    pod = pods[0]
    pod["spec"].pop("serviceAccountName", None)
    assert _pod_security_violations(control_plane.admin, restricted, pod) == set()
    del pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    titles = {v.split(" (")[0] for v in _pod_security_violations(control_plane.admin, restricted, pod)}
    assert titles == {"allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                      "seccompProfile"}


# ------------------------------------------------------------------------------------------------ webhook configuration
VWCS = "admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def test_a_drifted_webhook_configuration_is_restored_with_the_operators_own_rbac(
        control_plane: ControlPlane, release: Release, operator: Any, tmp_path: Path) -> None:
    """The configuration as the server stores it (its defaults filled in) is no drift; a ``secrets`` rule added and
    failurePolicy flipped by an admin are put back by one certificate round run with the release's ServiceAccount
    (update on its own configuration by name, the Event in namespace default: the server accepts both), and the
    Warning Event is stored about the configuration."""
    import asyncio

    from kubetitan import certsync, kube, runner

    opts = runner.options_from_args(runner.build_parser().parse_args(release.operator_args(cert_dir=str(tmp_path))))
    sync = opts.webhook.certificates
    client = kube.Client(kube.load_config(str(release.operator_kubeconfig())))

    async def one_round() -> None:
        try:
            await certsync.sync_once(client, sync)
        finally:
            await client.aclose()

    before = control_plane.admin.get(VWCS, None, release.fullname)
    asyncio.run(one_round())
    assert control_plane.admin.get(VWCS, None, release.fullname)["metadata"]["resourceVersion"] == \
        before["metadata"]["resourceVersion"]  # the stored defaults are no drift: nothing written
    drifted = control_plane.admin.get(VWCS, None, release.fullname)
    drifted["webhooks"][0]["rules"].append({"apiGroups": [""], "apiVersions": ["v1"], "resources": ["secrets"],
                                            "operations": ["CREATE"]})
    drifted["webhooks"][0]["failurePolicy"] = "Ignore"
    control_plane.admin.request("PUT", f"/apis/{VWCS}/{release.fullname}", drifted)
    client = kube.Client(kube.load_config(str(release.operator_kubeconfig())))
    asyncio.run(one_round())
    (w,) = control_plane.admin.get(VWCS, None, release.fullname)["webhooks"]
    assert [r["resources"] for r in w["rules"]] == [["llamapretrains"]] and w["failurePolicy"] == "Fail", w
    assert w["clientConfig"]["caBundle"] == before["webhooks"][0]["clientConfig"]["caBundle"]
    events = [e for e in control_plane.admin.list("v1/events", "default")
              if e.get("reason") == certsync.RESTORED and e["involvedObject"]["name"] == release.fullname]
    assert events and events[0]["type"] == "Warning" and "failurePolicy, rules" in events[0]["message"], events
