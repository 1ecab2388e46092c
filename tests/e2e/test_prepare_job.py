"""``kubetitan prepare-data --render-job``: the Indexed Job is valid for every supported Kubernetes version, is
admitted by the strict API double (schema of 1.32; its pod passes Pod Security ``restricted`` on the real API
server, tests/cluster/test_real_api.py), and its pods, run as processes by
the e2e kubelet with this test playing the Job controller (one pod per completion index, created from the template
with the labels, annotation and ``JOB_COMPLETION_INDEX`` env the controller adds), write the same shards and
``index.json`` as a one-machine run. A bad input line fails its pod with exit code 2 and FILE:LINE in the
termination message: the code the Job's ``podFailurePolicy`` turns into ``FailJob`` (no retries)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from common import NS
from kubelet import Kubelet

from kmockx.harness import PODS, Cluster, wait_for
from support import forkrun
from support import yamlio

JOBS = "batch/v1/jobs"
CLAIM = "corpus"
K8S_VERSIONS = ["1.27", "1.35", "1.37"]  # as tests/api/test_examples.py: the oldest and newest supported
IDX = "batch.kubernetes.io/job-completion-index"


def render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*forkrun.python(), "-m", "kubetitan.cli", "prepare-data", "--render-job", *args],
                          capture_output=True, text=True, timeout=60)


def write_corpus(root: Path, bad_line: bool = False) -> list[str]:
    (root / "in").mkdir(parents=True)
    for k in range(3):
        lines = [json.dumps({"text": f"File {k}, doc {i}: the red fox ran {i} miles by the river. " * (1 + i % 4)})
                 for i in range(150)]
        if bad_line and k == 2:
            lines[99] = '{"text": "no end'
        (root / "in" / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return [str(root / "in")]


def job_args(root: Path, inputs: list[str], parts: int) -> list[str]:
    return [*inputs, "-o", str(root / "shards"), "--parts", str(parts), "--unit-mb", "0.02",
            "--job-name", "prep", "--job-namespace", NS, "--job-image", "kubetitan-trainer:test",
            "--job-claim", CLAIM, "--job-mount-path", str(root), "--job-cpus", "1"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_rendered_job_passes_the_kubernetes_schemas(tmp_path: Path, version: str) -> None:
    r = render(*job_args(tmp_path, [str(tmp_path / "in")], 4))
    assert r.returncode == 0, r.stderr
    job = yamlio.load(r.stdout)
    kubernetes_validate.validate(job, version, strict=True)
    s = job["spec"]
    assert (s["completionMode"], s["completions"], s["parallelism"]) == ("Indexed", 4, 4)
    assert {"action": "FailJob", "onExitCodes": {"containerName": "prepare", "operator": "In", "values": [2]},
            "onPodConditions": []} in s["podFailurePolicy"]["rules"]
    job["spec"]["template"]["spec"]["containers"][0]["cpuCount"] = 1  # the same call refuses an unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, version, strict=True)


@pytest.mark.parametrize(("args", "want"), [
    (["/data/in", "-o", "/data/out", "--job-claim", "c"], "--render-job needs --job-image"),
    (["/data/in", "-o", "/data/out", "--job-image", "i"], "--render-job needs --job-claim"),
    (["/elsewhere/in", "-o", "/data/out", "--job-image", "i", "--job-claim", "c"],
     "INPUT /elsewhere/in is not an absolute path under --job-mount-path /data"),
], ids=["no-image", "no-claim", "input-off-the-claim"])
def test_render_job_refuses_unusable_options(args: list[str], want: str) -> None:
    r = render(*args)
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr


def job_pod(job: dict[str, Any], index: int) -> dict[str, Any]:
    """The pod the Job controller creates for one completion index (pkg/controller/job: labels, annotation, env,
    hostname ``<job>-<index>``, owner reference)."""
    t = json.loads(json.dumps(job["spec"]["template"]))
    meta, name = job["metadata"], job["metadata"]["name"]
    uid = meta.get("uid", "")
    labels = {**t["metadata"].get("labels", {}), "batch.kubernetes.io/job-name": name, "job-name": name,
              "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid, IDX: str(index)}
    for c in t["spec"]["containers"]:
        c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
            "fieldRef": {"fieldPath": f"metadata.annotations['{IDX}']"}}})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{index}-x{index:04d}", "namespace": meta["namespace"], "labels": labels,
                         "annotations": {IDX: str(index)},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                              "controller": True, "blockOwnerDeletion": True}]},
            "spec": {**t["spec"], "hostname": f"{name}-{index}"}}


def run_job(c: Cluster, k: Kubelet, job: dict[str, Any]) -> list[tuple[int, str]]:
    """Create the Job and its pods (as the controller would with parallelism = completions); wait for every pod's
    exit; (exit code, termination message) per index."""
    c.k.declare(JOBS, "Job", status=True, builtin=True)
    created = c.call(c.k.put(JOBS, job))  # admission: the Job against Kubernetes' own schema, strict
    pods = [job_pod(created, i) for i in range(job["spec"]["completions"])]
    for p in pods:
        c.call(c.k.put(PODS, p))  # admission: the schema
    names = [p["metadata"]["name"] for p in pods]
    wait_for(lambda: all(((c.get(PODS, NS, n).get("status") or {}).get("phase") in ("Succeeded", "Failed")) for n in names),
             timeout=240, what="the Job's pods to exit")
    out = []
    for n in names:
        term = (c.get(PODS, NS, n)["status"]["containerStatuses"][0]["state"]).get("terminated") or {}
        out.append((term.get("exitCode"), term.get("message", "")))
    return out


@pytest.fixture
def cluster(tmp_path: Path):
    root = tmp_path / "vol"
    root.mkdir()
    with Cluster() as c:
        with Kubelet(c, tmp_path / "kubelet", nodes=2, claims={CLAIM: root}) as k:
            yield c, k, root
            assert not k.errors, k.errors


def test_the_indexed_job_writes_what_one_machine_writes(cluster, tmp_path: Path) -> None:
    c, k, root = cluster
    inputs = write_corpus(root)
    r = render(*job_args(root, inputs, 3))
    assert r.returncode == 0, r.stderr
    results = run_job(c, k, yamlio.load(r.stdout))
    assert [code for code, _ in results] == [0, 0, 0], results
    logs = [k.log(NS, f"prep-{i}-x{i:04d}") for i in range(3)]
    assert all(f"part {i} of 3:" in logs[i] for i in range(3)), logs
    index = json.loads((root / "shards" / "index.json").read_text())  # written by the part that finished last
    assert index["units"] >= 3 and index["documents"] == 450

    local = tmp_path / "local"
    r = subprocess.run([*forkrun.python(), "-m", "kubetitan_trainer.data.prepare", *inputs, "-o", str(local), "--unit-mb",
                        "0.02", "--workers", "2", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((local / "index.json").read_text()) == index
    for f in index["files"]:
        assert (local / f["name"]).read_bytes() == (root / "shards" / f["name"]).read_bytes()


def test_a_bad_line_fails_its_pod_with_the_code_the_job_does_not_retry(cluster) -> None:
    c, k, root = cluster
    r = render(*job_args(root, write_corpus(root, bad_line=True), 2))
    job = yamlio.load(r.stdout)
    results = run_job(c, k, job)
    bad = str(root / "in" / "part-2.jsonl")
    # part 1 holds the last units (part-2.jsonl); part 0 finishes and leaves the index to the last part
    assert results[0][0] == 0 and results[1][0] == 2, results
    assert f"{bad}:100: malformed JSON" in results[1][1] and "Traceback" not in results[1][1], results[1][1]
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and results[1][0] in rule["onExitCodes"]["values"]
    assert not (root / "shards" / "index.json").exists()
