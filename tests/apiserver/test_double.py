"""Tests of the strict API double itself (tests/kmockx): each rule refuses a known-bad request with the API
server's status code and message shape, and accepts the repository's own objects; stock kubectl works on it."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from kmockx import validation
from kmockx.harness import CRD_FILE, Cluster, wait_for
from support.specs import NS, cpu_spec, lpt
from support import yamlio
from kmockx.rbac import render_chart

REPO = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl") or str(REPO / ".tools" / "bin" / "kubectl")
LPTS = f"/apis/kubetitan.io/v1alpha1/namespaces/{NS}/llamapretrains"
PODS = f"/api/v1/namespaces/{NS}/pods"
pytestmark = pytest.mark.xdist_group("apiserver")


def call(c: Cluster, method: str, path: str, body: Any = None, url: str | None = None,
         ctype: str = "application/json", **params: str) -> requests.Response:
    data = None if body is None else json.dumps(body)
    return requests.request(method, (url or c.url) + path, data=data, params=params,
                            headers={"Content-Type": ctype}, timeout=10)


def pod(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"containers": [{"name": "c", "image": "busybox"}], **spec}}


def kubectl(c: Cluster, *args: str, ok: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([KUBECTL, "--kubeconfig", c.admin_kubeconfig, *args], capture_output=True, text=True,
                         timeout=60, input=stdin)
    assert (out.returncode == 0) == ok, out.stderr
    return out


def _server(kubeconfig: str) -> str:
    return json.loads(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"]


# ------------------------------------------------------------------------------------------------ CRD
def test_crd_bounds_answer_422_with_the_api_servers_message(c: Cluster) -> None:
    bad = lpt("steps0", {**cpu_spec(), "training": {**cpu_spec()["training"], "steps": 0}})
    r = call(c, "POST", LPTS, bad)
    assert r.status_code == 422, r.text
    s = r.json()
    assert s["kind"] == "Status" and s["reason"] == "Invalid"
    assert s["message"] == ('LlamaPretrain.kubetitan.io "steps0" is invalid: spec.training.steps: Invalid value: 0: '
                            "spec.training.steps in body should be greater than or equal to 1")
    assert s["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "spec.training.steps",
                                       "message": "Invalid value: 0: spec.training.steps in body should be greater "
                                                  "than or equal to 1"}]
    assert s["details"]["kind"] == "LlamaPretrain" and s["details"]["group"] == "kubetitan.io"


def test_crd_types_enums_and_cel_rules(c: Cluster) -> None:
    spec = cpu_spec()
    spec["training"]["steps"] = "many"
    spec["precision"]["activationCheckpointing"] = "sometimes"
    spec["parallelism"]["dataParallelShardDegree"] = 3  # 3 != 2 nodes x 2 processes: the CEL rule
    s = call(c, "POST", LPTS, lpt("multi", spec)).json()
    fields = {cause["field"]: cause for cause in s["details"]["causes"]}
    assert fields["spec.training.steps"]["message"] == ('Invalid value: "string": spec.training.steps in body must '
                                                        'be of type integer: "string"')
    assert fields["spec.precision.activationCheckpointing"]["reason"] == "FieldValueNotSupported"
    assert fields["spec.precision.activationCheckpointing"]["message"].startswith(
        'Unsupported value: "sometimes": supported values: ')
    assert s["message"].startswith('LlamaPretrain.kubetitan.io "multi" is invalid: [')
    cel = fields["spec.parallelism"]
    assert cel["reason"] == "FieldValueInvalid" and "product of the parallel degrees" in cel["message"]


def test_crd_required_defaults_and_pruning(c: Cluster) -> None:
    spec = cpu_spec()
    spec["training"]["bogus"] = 1
    r = call(c, "POST", LPTS, lpt("pruned", spec))
    assert r.status_code == 201, r.text
    stored = r.json()
    assert "bogus" not in stored["spec"]["training"]  # pruned: no x-kubernetes-preserve-unknown-fields there
    assert stored["metadata"]["generation"] == 1 and stored["metadata"]["uid"]
    crd = yamlio.load(CRD_FILE.read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    defaulted = [k for k, v in props["training"]["properties"].items() if "default" in v and k not in spec["training"]]
    assert defaulted and all(k in stored["spec"]["training"] for k in defaulted)  # defaults applied
    r = call(c, "POST", LPTS, lpt("strict", spec), fieldValidation="Strict")
    assert r.status_code == 400 and 'strict decoding error: unknown field "spec.training.bogus"' in r.json()["message"]
    spec = cpu_spec()
    spec["checkpoint"]["storage"] = {"persistentVolumeClaim": {}}
    r = call(c, "POST", LPTS, lpt("noclaim", spec))
    assert r.status_code == 422 and r.json()["details"]["causes"] == [{
        "reason": "FieldValueRequired", "message": "Required value",
        "field": "spec.checkpoint.storage.persistentVolumeClaim.claimName"}]


def test_generation_moves_on_spec_changes_only_and_status_is_a_subresource(c: Cluster) -> None:
    obj = call(c, "POST", LPTS, lpt("gen", cpu_spec())).json()
    path = f"{LPTS}/gen"
    merge = "application/merge-patch+json"
    s1 = call(c, "PATCH", path + "/status", {"status": {"phase": "Running"}}, ctype=merge).json()
    assert s1["metadata"]["generation"] == 1 and s1["status"]["phase"] == "Running"
    ignored = call(c, "PATCH", path, {"status": {"phase": "Hacked"}, "metadata": {"labels": {"a": "b"}}},
                   ctype=merge).json()
    assert ignored["status"]["phase"] == "Running" and ignored["metadata"]["generation"] == 1
    s2 = call(c, "PATCH", path, {"spec": {"training": {"steps": 50}}}, ctype=merge).json()
    assert s2["metadata"]["generation"] == 2
    stale = copy.deepcopy(obj)
    r = call(c, "PUT", path, stale)
    assert r.status_code == 409 and r.json()["reason"] == "Conflict"
    assert r.json()["message"] == ('Operation cannot be fulfilled on llamapretrains.kubetitan.io "gen": the object '
                                   "has been modified; please apply your changes to the latest version and try again")
    r = call(c, "PATCH", path, {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "spec": {}},
             ctype=merge)
    assert r.status_code == 409


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_accepted(c: Cluster, example: Path) -> None:
    for doc in yamlio.load_all(example.read_text()):
        doc = copy.deepcopy(doc)
        doc["metadata"]["namespace"] = NS
        r = call(c, "POST", LPTS, doc, fieldValidation="Strict")
        assert r.status_code == 201, r.text
        call(c, "DELETE", f"{LPTS}/{doc['metadata']['name']}")


# ------------------------------------------------------------------------------------------------ built-ins
def test_names_labels_and_annotations(c: Cluster) -> None:
    r = call(c, "POST", PODS, pod("Bad_Name"))
    assert r.status_code == 422
    assert r.json()["message"].startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a '
                                          "lowercase RFC 1123 subdomain must consist of")
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "1svc"}, "spec": {"clusterIP": "None"}}
    r = call(c, "POST", f"/api/v1/namespaces/{NS}/services", svc)
    assert r.status_code == 422 and "DNS-1035 label" in r.json()["message"]
    long = pod("labels")
    long["metadata"]["labels"] = {"k": "x" * 64}
    assert call(c, "POST", PODS, long).status_code == 422
    big = pod("annotations")
    big["metadata"]["annotations"] = {"a": "x" * (256 * 1024)}
    r = call(c, "POST", PODS, big)
    assert r.status_code == 422 and "Too long: may not be more than 262144 bytes" in r.json()["message"]
    assert call(c, "POST", PODS, pod("x" * 254)).status_code == 422


def test_pod_schema_unknown_fields_and_immutability(c: Cluster) -> None:
    bad = pod("tol", tolerations=[{"key": "k", "operator": "Exists", "tolerationSeconds": "soon"}])
    r = call(c, "POST", PODS, bad)
    assert r.status_code == 422 and r.json()["details"]["causes"][0]["field"] == "spec.tolerations[0].tolerationSeconds"
    env = pod("env")
    env["spec"]["containers"][0]["env"] = [{"value": "no name"}]
    assert call(c, "POST", PODS, env).status_code == 422
    unknown = pod("unknown", hostnetwork=True)
    r = call(c, "POST", PODS, unknown)
    assert r.status_code == 400
    assert r.json()["message"] == ('Pod in version "v1" cannot be handled as a Pod: strict decoding error: '
                                   'unknown field "spec.hostnetwork"')
    assert call(c, "POST", PODS, pod("ok")).status_code == 201
    merge = "application/merge-patch+json"
    r = call(c, "PATCH", f"{PODS}/ok", {"spec": {"restartPolicy": "Always"}}, ctype=merge)
    assert r.status_code == 422 and "pod updates may not change fields other than" in r.json()["message"]
    img = call(c, "PATCH", f"{PODS}/ok", {"spec": {"containers": [{"name": "c", "image": "busybox:2"}]}},
               ctype="application/strategic-merge-patch+json")
    assert img.status_code == 200 and img.json()["spec"]["containers"][0]["image"] == "busybox:2"
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "frozen"}, "data": {"a": "1"},
          "immutable": True}
    assert call(c, "POST", f"/api/v1/namespaces/{NS}/configmaps", cm).status_code == 201
    r = call(c, "PATCH", f"/api/v1/namespaces/{NS}/configmaps/frozen", {"data": {"a": "2"}}, ctype=merge)
    assert r.status_code == 422 and "field is immutable when `immutable` is set" in r.json()["message"]
    r = call(c, "POST", "/api/v1/namespaces/nowhere/configmaps", {**cm, "metadata": {"name": "x"}})
    assert r.status_code == 404 and r.json()["message"] == 'namespaces "nowhere" not found'


def test_the_charts_own_objects_are_accepted(c: Cluster) -> None:
    kinds = {"ConfigMap": "configmaps", "Service": "services"}
    seen = 0
    for doc in render_chart("monitoring.dashboards.enabled=true"):
        if doc["kind"] in kinds:
            ns = doc["metadata"].get("namespace") or NS
            doc = {**doc, "metadata": {**doc["metadata"], "namespace": NS}}
            r = call(c, "POST", f"/api/v1/namespaces/{NS}/{kinds[doc['kind']]}", doc, fieldValidation="Strict")
            assert r.status_code == 201, (ns, r.text)
            seen += 1
    assert seen >= 1


def test_garbage_collection_and_finalizers(c: Cluster) -> None:
    def owned(name: str, owner: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"]}]}}

    cms = f"/api/v1/namespaces/{NS}/configmaps"
    for policy in ("Background", "Foreground"):
        owner = call(c, "POST", cms, {"apiVersion": "v1", "kind": "ConfigMap",
                                      "metadata": {"name": f"owner-{policy.lower()}"}}).json()
        call(c, "POST", cms, owned(f"child-{policy.lower()}", owner))
        r = call(c, "DELETE", f"{cms}/owner-{policy.lower()}", {"propagationPolicy": policy})
        assert r.status_code == 200
        assert call(c, "GET", f"{cms}/child-{policy.lower()}").status_code == 404
        assert call(c, "GET", f"{cms}/owner-{policy.lower()}").status_code == 404
    held = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "held", "finalizers": ["test/hold"]}}
    call(c, "POST", cms, held)
    gone = call(c, "DELETE", f"{cms}/held").json()
    assert gone["metadata"]["deletionTimestamp"]
    assert call(c, "GET", f"{cms}/held").status_code == 200  # blocked by its finalizer
    call(c, "PATCH", f"{cms}/held", {"metadata": {"finalizers": None}}, ctype="application/merge-patch+json")
    assert call(c, "GET", f"{cms}/held").status_code == 404


# ------------------------------------------------------------------------------------------------ RBAC
def test_rbac_refuses_what_the_chart_does_not_grant(c: Cluster) -> None:
    url = _server(c.operator_kubeconfig((NS,)))
    assert call(c, "GET", PODS, url=url).status_code == 200  # granted by the chart's Role in ml
    r = call(c, "POST", f"/api/v1/namespaces/{NS}/secrets", {}, url=url)
    assert r.status_code in (403, 404)
    r = call(c, "DELETE", f"/api/v1/namespaces/{NS}/configmaps/anything", url=url)
    assert r.status_code == 403
    assert r.json()["message"].startswith('configmaps "anything" is forbidden: User "system:serviceaccount:'
                                          'kubetitan-system:ktn-ml-kubetitan" cannot delete resource "configmaps" '
                                          'in API group "" in the namespace "ml"')
    r = call(c, "GET", "/api/v1/namespaces/default/pods", url=url)
    assert r.status_code == 403 and 'in the namespace "default"' in r.json()["message"]
    r = call(c, "POST", LPTS, lpt("nope", cpu_spec()), url=url)
    assert r.status_code == 403
    assert 'cannot create resource "llamapretrains" in API group "kubetitan.io"' in r.json()["message"]
    r = call(c, "GET", "/api/v1/namespaces", url=url)
    assert r.status_code == 403 and r.json()["message"] == (
        'namespaces is forbidden: User "system:serviceaccount:kubetitan-system:ktn-ml-kubetitan" cannot list '
        'resource "namespaces" in API group "" at the cluster scope')
    assert call(c, "GET", "/api/v1/nodes/n1", url=url).status_code == 404  # get is granted: not found


# ------------------------------------------------------------------------------------------------ faults
def _watch_in_thread(c: Cluster, path: str, rv: str, timeout: float = 10) -> tuple[threading.Thread,
                                                                                   list[dict[str, Any]]]:
    """A watch of ``path`` from ``rv`` read in a thread (``timeout``: the client's read time-out); its events land in
    the returned list."""
    lines: list[dict[str, Any]] = []

    def watch() -> None:
        with requests.get(c.url + path, params={"watch": "true", "resourceVersion": rv}, stream=True,
                          timeout=timeout) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))

    t = threading.Thread(target=watch)
    t.start()
    return t, lines


def test_faults_by_count_rate_latency_and_watch_expiry(c: Cluster) -> None:
    assert c.k is not None
    f = c.k.inject(verbs="create", resource="configmaps", code=429, count=2, retry_after=3)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "flaky"}}
    cms = f"/api/v1/namespaces/{NS}/configmaps"
    codes = [call(c, "POST", cms, cm) for _ in range(3)]
    assert [r.status_code for r in codes] == [429, 429, 201] and codes[0].headers["Retry-After"] == "3"
    assert f.hits == 2 and "(injected)" in c.k.log_text()
    c.k.clear_faults()
    c.k.seed = 7
    c.k._rng = None
    c.k.inject(verbs={"get"}, resource="configmaps", code=503, rate=0.5)
    first = [call(c, "GET", f"{cms}/flaky").status_code for _ in range(20)]
    c.k.clear_faults()
    c.k._rng = None
    c.k.inject(verbs={"get"}, resource="configmaps", code=503, rate=0.5)
    again = [call(c, "GET", f"{cms}/flaky").status_code for _ in range(20)]
    assert first == again and {200, 503} == set(first)  # seeded: the same sequence each time
    c.k.clear_faults()
    c.k.inject(verbs={"get"}, resource="configmaps", code=0, delay=0.3, count=1)
    with pytest.raises(requests.Timeout):
        requests.get(c.url + f"{cms}/flaky", timeout=0.1)
    c.k.clear_faults()
    rv = call(c, "GET", cms).json()["metadata"]["resourceVersion"]
    t, lines = _watch_in_thread(c, cms, rv)
    wait_for(lambda: c.k is not None and c.k._watchers.get(next(r for r in c.k.types if r.plural == "configmaps")),
             5, "the watch to start")
    c.k.expire_watches("configmaps")
    t.join(10)
    assert lines and lines[-1]["type"] == "ERROR" and lines[-1]["object"]["code"] == 410
    r = requests.get(c.url + cms, params={"watch": "true", "resourceVersion": rv}, timeout=10)
    assert json.loads(r.text.splitlines()[0])["object"]["code"] == 410  # resuming from before the expiry


def test_a_dropped_watch_ends_without_an_event_and_can_resume_from_its_version(c: Cluster) -> None:
    """drop_watches is a broken connection, not an expiry: the stream just ends (no ERROR, no 410), and a
    client that watches again from the resourceVersion it last saw gets the events it missed."""
    assert c.k is not None
    cms = f"/api/v1/namespaces/{NS}/configmaps"
    rv = call(c, "GET", cms).json()["metadata"]["resourceVersion"]
    res = next(r for r in c.k.types if r.plural == "configmaps")
    t, lines = _watch_in_thread(c, cms, rv)
    wait_for(lambda: c.k is not None and c.k._watchers.get(res), 5, "the watch to start")
    c.k.drop_watches("configmaps")
    t.join(10)
    assert not t.is_alive() and lines == []  # ended, and said nothing
    made = call(c, "POST", cms, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "after-drop"}})
    assert made.status_code == 201
    r = requests.get(c.url + cms, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"}, timeout=10)
    events = [json.loads(x) for x in r.text.splitlines()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "after-drop")]


# ------------------------------------------------------------------------------------------------ kubectl
def test_stock_kubectl_apply_get_describe_patch_watch_delete(c: Cluster, tmp_path: Path) -> None:
    out = kubectl(c, "apply", "-f", str(CRD_FILE)).stdout
    assert "customresourcedefinition.apiextensions.k8s.io/llamapretrains.kubetitan.io" in out
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(lpt("kc", cpu_spec())))
    assert "llamapretrain.kubetitan.io/kc created" in kubectl(c, "apply", "-f", str(f)).stdout
    bad = tmp_path / "bad.yaml"
    obj = lpt("kcbad", cpu_spec())
    obj["spec"]["training"]["bogus"] = 1
    bad.write_text(yaml.safe_dump(obj))
    err = kubectl(c, "apply", "-f", str(bad), ok=False).stderr
    assert 'unknown field "spec.training.bogus"' in err
    kubectl(c, "patch", "lpt", "kc", "-n", NS, "--subresource=status", "--type=merge",
            "-p", '{"status": {"phase": "Running"}}')
    assert kubectl(c, "get", "lpt", "kc", "-n", NS, "-o", "jsonpath={.status.phase}").stdout == "Running"
    uid = kubectl(c, "get", "lpt", "kc", "-n", NS, "-o", "jsonpath={.metadata.uid}").stdout
    ev = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "kc.1", "namespace": NS}, "type": "Warning",
          "reason": "TestReason", "message": "hello from the test", "involvedObject": {
              "apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", "name": "kc", "namespace": NS,
              "uid": uid}, "count": 1, "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z"}
    kubectl(c, "create", "-f", "-", stdin=json.dumps(ev))
    described = kubectl(c, "describe", "lpt", "kc", "-n", NS).stdout
    assert "TestReason" in described and "hello from the test" in described
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n0"}}
    kubectl(c, "apply", "-f", "-", stdin=json.dumps(node))
    assert "n0" in kubectl(c, "get", "nodes").stdout
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kcm", "namespace": NS}, "data": {"a": "1"}}
    kubectl(c, "apply", "-f", "-", stdin=json.dumps(cm))
    cm["data"]["a"] = "2"
    assert "configured" in kubectl(c, "apply", "-f", "-", stdin=json.dumps(cm)).stdout
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ksvc", "namespace": NS},
           "spec": {"clusterIP": "None", "selector": {"a": "b"}}}
    kubectl(c, "apply", "-f", "-", stdin=json.dumps(svc))
    watcher = subprocess.Popen([KUBECTL, "--kubeconfig", c.admin_kubeconfig, "get", "pods", "-n", NS, "-w"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any("watch" in e.verb and "pods" in e.path for e in c.k.log), 20, "kubectl's watch")
        kubectl(c, "apply", "-f", "-", stdin=json.dumps(pod("watched")))
        assert watcher.stdout is not None
        seen = ""
        while "watched" not in seen:
            seen += watcher.stdout.readline()
    finally:
        watcher.kill()
        watcher.wait(10)
    pods = kubectl(c, "get", "pods", "-n", NS).stdout
    assert pods.splitlines()[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert "describe" and "Events:" in kubectl(c, "describe", "pod", "watched", "-n", NS).stdout
    for what in (("lpt", "kc"), ("pod", "watched"), ("cm", "kcm"), ("svc", "ksvc")):
        kubectl(c, "delete", *what, "-n", NS)
    kubectl(c, "delete", "node", "n0")
    assert "kc " not in kubectl(c, "get", "lpt", "-n", NS).stdout


def test_validation_module_renders_multiple_causes() -> None:
    s = validation.invalid_status("Pod", "p", [validation.required("spec.a"), validation.required("spec.b")], "", "Pod")
    assert s["message"] == 'Pod "p" is invalid: [spec.a: Required value, spec.b: Required value]'


def test_a_cluster_that_stops_with_a_watch_open_leaves_no_task_behind() -> None:
    """The double's thread ends every task it served before its loop closes: a watch still waiting for events
    when the test ends was once left pending on a loop that closed later, and a later test's garbage collection
    finalised it ('Event loop is closed' in pytest's unraisable-exception hook, then CI's SystemError in
    ``ast.parse``: tests/support/pyparse.py). The client here waits far longer than the double's stop may take."""
    import asyncio

    with Cluster() as cluster:
        res = next(r for r in cluster.k.types if r.plural == "configmaps")
        t, _ = _watch_in_thread(cluster, f"/api/v1/namespaces/{NS}/configmaps", "0", timeout=120)
        wait_for(lambda: cluster.k._watchers.get(res), 5, "the watch to start")
        loop = cluster.loop
        holder: list[set[asyncio.Task]] = []
        cluster.loop.call_soon_threadsafe(lambda: holder.append(asyncio.all_tasks(loop)))
        wait_for(lambda: holder, 5, "the loop to list its tasks")
        serving = [task for task in holder[0] if task.get_coro().__qualname__ != "Cluster._serve"]
        assert serving, "the open watch is served by tasks of its own"
    assert not cluster.thread.is_alive()
    left = [task for task in serving if not task.done()]
    assert not left, f"tasks left pending when the double stopped: {left}"
    assert loop.is_closed()
    t.join(10)
    assert not t.is_alive()  # the watch ended when the double stopped, as a dropped connection does
