"""``kubetitan prepare-data --render-job``: the Kubernetes Indexed Job that prepares a corpus too big for one machine.

Pod ``i`` of ``--parts N`` (``completionMode: Indexed``; Kubernetes sets ``JOB_COMPLETION_INDEX`` in it) runs
``python -m kubetitan_trainer.data.prepare INPUTS -o OUT --parts N`` on the shared claim: it computes the same plan as
every other pod (a pure function of the input list and options; the first pod writes ``plan.json``, the others
check theirs against it), tokenizes the contiguous block of work units that is part ``i``, and records each unit
as it finishes. The merge is the last step of every pod: the one that finds every unit done writes ``index.json``
(atomically; two pods finishing together write the same bytes). ``kubetitan prepare-data --merge -o OUT`` does it
by hand. A pod that is retried (node lost, OOM) skips the units it had finished.

Failure policy: exit code 2 (bad input or options: the message names the file and line) fails the whole Job at once
(``podFailurePolicy`` ``FailJob``), pod disruptions (preemption, drain) are not counted, and any other failure is
retried up to ``backoffLimit`` (2 per part) times. Pod Security ``restricted``: non-root (uid 10001, the trainer
image's user), no privilege escalation, every capability dropped, the runtime's seccomp profile, no API token.
"""

from __future__ import annotations

import argparse
import posixpath
from typing import Any

import yaml

from kubetitan_trainer.data.shards import DataError
from kubetitan_trainer.data.shards import data_error as _fix

UID = 10001
CONTAINER = "prepare"


def _under(path: str, mount: str) -> bool:
    p = posixpath.normpath(path)
    return posixpath.isabs(p) and (p == mount or p.startswith(mount.rstrip("/") + "/"))


# long: one Kubernetes manifest written out as a literal, as the planner's pod is
def render_job(a: argparse.Namespace) -> dict[str, Any]:
    """The Indexed Job (a plain dict) for the parsed prepare-data arguments; DataError for unusable options."""
    if not a.job_image:
        raise _fix("--render-job needs --job-image", "pass the trainer image (images/trainer.Dockerfile)")
    if not a.job_claim:
        raise _fix("--render-job needs --job-claim", "pass a ReadWriteMany PersistentVolumeClaim holding the inputs")
    if not a.inputs:
        raise _fix("no INPUT given", "pass the inputs as paths inside the pods (under --job-mount-path)")
    if a.merge:
        raise _fix("--render-job and --merge do not go together", "the Job's last part merges; drop --merge")
    mount = posixpath.normpath(a.job_mount_path)
    paths = [("INPUT", p) for p in a.inputs] + [("--output", a.output)] + (
        [("--tokenizer", a.tokenizer)] if a.tokenizer != "builtin" else [])
    for what, p in paths:
        if not _under(p, mount):
            raise _fix(f"--render-job: {what} {p} is not an absolute path under --job-mount-path {mount}",
                       "give paths as the pods see them on the claim")
    if a.parts < 1 or a.job_cpus < 1 or a.job_parallelism < 0:
        raise _fix("--parts and --job-cpus must be 1 or more, --job-parallelism 0 or more", "fix the numbers")
    args = [*a.inputs, "-o", a.output, "--parts", str(a.parts), "--workers", str(a.job_cpus),
            "--tokenizer", a.tokenizer, "--text-field", a.text_field, "--dtype", a.dtype,
            "--unit-mb", f"{a.unit_mb:g}", "--shard-tokens", str(a.shard_tokens), "--batch-size", str(a.batch_size)]
    memory = a.job_memory or f"{a.job_cpus}Gi"
    labels = {"app.kubernetes.io/name": "kubetitan", "app.kubernetes.io/component": "prepare-data",
              "app.kubernetes.io/instance": a.job_name}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": a.job_name, "namespace": a.job_namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": a.parts,
            "parallelism": a.job_parallelism or a.parts,
            "backoffLimit": 2 * a.parts,
            "podFailurePolicy": {"rules": [
                # an empty onPodConditions: the batch/v1 schema of Kubernetes 1.27 requires the key on every rule
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2]},
                 "onPodConditions": []},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": CONTAINER,
                        "image": a.job_image,
                        "command": ["python", "-m", "kubetitan_trainer.data.prepare"],
                        "args": args,
                        "resources": {"requests": {"cpu": str(a.job_cpus), "memory": memory},
                                      "limits": {"memory": memory}},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                        "volumeMounts": [{"name": "data", "mountPath": mount}],
                    }],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": a.job_claim}}],
                },
            },
        },
    }


def render_job_yaml(a: argparse.Namespace) -> str:
    return yaml.safe_dump(render_job(a), sort_keys=False)


__all__ = ["DataError", "render_job", "render_job_yaml"]
