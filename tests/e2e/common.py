"""Shared builders and readers for the end-to-end scenarios and bench/goodput_bench.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kmockx.harness import free_port  # noqa: F401 - the tests' one port allocator, re-exported for the scenarios

NS = "ml"
CLAIM = "checkpoints"
"""The ReadWriteMany claim every scenario checkpoints to (the e2e kubelet maps it to a temp dir)."""


def e2e_spec(ckpt_dir: Path, steps: int, interval: int, metrics_port: int, **run_policy: Any) -> dict[str, Any]:
    """2 "nodes" x 1 process, torchtitan's debug model on CPU (gloo), checkpoints every ``interval`` steps."""
    return {
        "model": {"flavor": "debug"},
        "training": {"steps": steps, "seqLen": 32, "localBatchSize": 2, "learningRate": 0.002,
                     "warmupSteps": 2, "seed": 42},
        "parallelism": {"dataParallelShardDegree": 2},
        "precision": {"compile": False, "activationCheckpointing": "none"},
        "data": {"source": "synthetic"},
        "tokenizer": {"source": "builtin"},
        "checkpoint": {"intervalSteps": interval, "asyncMode": "disabled", "saveTimeoutSeconds": 10,
                       "mountPath": str(ckpt_dir), "storage": {"persistentVolumeClaim": {"claimName": CLAIM}}},
        "resources": {"nodes": 2, "gpusPerNode": 0, "processesPerNode": 1, "shmSize": "1Gi"},
        "runPolicy": {"maxRestarts": 20, "backoffSeconds": 0, "nodeFailureGraceSeconds": 0,
                      "hangTimeoutSeconds": 10, "startupTimeoutSeconds": 300, **run_policy},
        "monitoring": {"metricsPort": metrics_port, "logFrequencySteps": 1},
    }


def lpt(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def step_log(ckpt_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's per-step records (``<dump folder>/kubetitan/steps.jsonl``), across every attempt."""
    path = Path(ckpt_dir) / "kubetitan" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def attempts_in_log(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split rank 0's step records into attempts: by the attempt each record carries (the pod's attempt, from
    the trainer's environment), else (older logs) wherever a step repeats or goes back."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if not out or ("attempt" in r and r["attempt"] != out[-1][-1].get("attempt")) \
                or ("attempt" not in r and r["step"] <= out[-1][-1]["step"]):
            out.append([])
        out[-1].append(r)
    return out


def loss_by_step(records: list[dict[str, Any]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        out.setdefault(r["step"], []).append(r["loss"])
    return out


def complete_checkpoints(ckpt_dir: Path) -> list[int]:
    """Steps with a complete DCP checkpoint (the one resume rule: ``step-N`` with its ``.metadata``)."""
    folder = Path(ckpt_dir) / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step-")
                  and (p / ".metadata").exists())
