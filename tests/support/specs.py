"""The one set of LlamaPretrain builders for the tests and the bench scripts.

- ``lpt`` / ``make_lpt``: the raw object a user would write (a dict), around any spec;
- ``cpu_spec``: a small valid CPU spec for the operator-against-the-double tests (pods never run it);
- ``e2e_spec``: the spec the end-to-end scenarios really train (``TEST_MODEL`` on CPU, gloo);
- ``TINY`` / ``tiny_lpt`` / ``write_config``: the trainer tests' run (``TEST_MODEL``), typed, and its rendered TOML.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import tomli_w

from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain

TEST_MODEL: dict[str, Any] = {"flavor": "custom", "custom": {"dim": 64, "nLayers": 2, "nHeads": 4, "vocabSize": 2048,
                                                          "multipleOf": 64}}
"""The model every test that trains runs: torchtitan's Llama 3 at 2 blocks of width 64 (~0.4 M parameters) with the
builtin tokenizer's 2,048-token vocabulary. Every code path (FSDP per block, checkpoints, FP8 layers) is the debug
flavour's, at a quarter of its CPU per step (0.053 against 0.228 s a step, 2 ranks:
bench/results/suite/s16_test_model_step_cost.txt); the ``debug`` flavour itself runs in ``make demo``
(examples/debug-cpu.yaml) and its dimensions are checked against
torchtitan's (tests/trainer/test_units.py). A model this small takes a larger learning rate (0.01 on the builtin text,
0.02 on the synthetic phrases) to show within a few steps that it learns, as the tests that check the loss ask."""

NS = "ml"
"""The namespace every test object lives in unless a test says otherwise."""
CLAIM = "checkpoints"
"""The ReadWriteMany claim every e2e scenario checkpoints to (the e2e kubelet maps it to a temp dir)."""


def lpt(name: str = "run", spec: dict[str, Any] | None = None, metrics_port: int | None = None, *,
        namespace: str = NS, uid: str | None = None) -> dict[str, Any]:
    """A raw LlamaPretrain object named ``name`` around a copy of ``spec`` (``metrics_port`` sets
    ``spec.monitoring.metricsPort``)."""
    spec = copy.deepcopy(spec or {})
    if metrics_port is not None:
        spec.setdefault("monitoring", {})["metricsPort"] = metrics_port
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", "metadata": meta, "spec": spec}


def make_lpt(spec: dict[str, Any] | None = None, name: str = "run", namespace: str = NS,
             uid: str | None = None) -> dict[str, Any]:
    """``lpt`` with the spec first (the API tests' calling order)."""
    return lpt(name, spec, namespace=namespace, uid=uid)


def cpu_spec(nodes: int = 2, **run_policy: Any) -> dict[str, Any]:
    """A small valid CPU spec (the debug model), ``nodes`` pods per attempt."""
    return {
        "model": {"flavor": "debug"},
        "training": {"steps": 100, "seqLen": 256, "localBatchSize": 8, "warmupSteps": 10},
        "parallelism": {"dataParallelShardDegree": 2 * nodes},
        "precision": {"compile": False, "activationCheckpointing": "none"},
        "data": {"source": "synthetic"},
        "tokenizer": {"source": "builtin"},
        "checkpoint": {"intervalSteps": 10, "asyncMode": "disabled", "storage": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
        "resources": {"nodes": nodes, "gpusPerNode": 0, "processesPerNode": 2, "shmSize": "1Gi"},
        "runPolicy": {"backoffSeconds": 0, "nodeFailureGraceSeconds": 0, **run_policy},
    }


def e2e_spec(ckpt_dir: Path, steps: int, interval: int, metrics_port: int, **run_policy: Any) -> dict[str, Any]:
    """2 "nodes" x 1 process, ``TEST_MODEL`` on CPU (gloo), checkpoints every ``interval`` steps."""
    return {
        "model": copy.deepcopy(TEST_MODEL),
        "training": {"steps": steps, "seqLen": 32, "localBatchSize": 2, "learningRate": 0.02,
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


def e2e_elastic_spec(ckpt_dir: Path, steps: int, interval: int, metrics_port: int, global_batch: int = 6,
                     elastic: dict[str, Any] | None = None, nodes: int = 3) -> dict[str, Any]:
    """``e2e_spec`` on ``nodes`` "nodes" with ``runPolicy.elastic {minNodes: nodes - 1}`` (``elastic=None``: not
    elastic, the same run otherwise), every size's shard degree (-1) and a global batch of ``global_batch`` samples
    (local batch 1: with the defaults, gradient accumulation 2 at 3 nodes, 3 at 2)."""
    spec = e2e_spec(ckpt_dir, steps, interval, metrics_port, maxInPlaceRestarts=0,
                    **({"elastic": {"minNodes": nodes - 1, **elastic}} if elastic is not None else {}))
    spec["resources"]["nodes"] = nodes
    spec["parallelism"] = {"dataParallelShardDegree": -1}
    spec["training"].update(localBatchSize=1, globalBatchSize=global_batch)
    return spec


def with_debug_model(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with torchtitan's debug flavour and the 0.002 learning rate the e2e specs had before ``TEST_MODEL``:
    what the bench scripts behind documented numbers (bench/elastic_loss.py, goodput_bench.py, gang_cpu.py,
    kubectl_sample.py) ran, so that they still reproduce them."""
    spec = copy.deepcopy(spec)
    spec["model"] = {"flavor": "debug"}
    spec["training"]["learningRate"] = 0.002
    return spec


TINY: dict[str, Any] = {
    "model": TEST_MODEL,
    "training": {"steps": 8, "seqLen": 64, "localBatchSize": 4, "learningRate": 0.01, "warmupSteps": 2, "seed": 7},
    "parallelism": {"dataParallelShardDegree": 2},
    # bf16 matmuls are ~5x slower than fp32 on CPU; the debug runs use fp32 parameters.
    "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32"},
    "data": {"source": "huggingface", "huggingface": {"dataset": "builtin", "streaming": False}},
    "tokenizer": {"source": "builtin"},
    "checkpoint": {"intervalSteps": 4, "asyncMode": "disabled", "keepLatestK": 0},
    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
    "monitoring": {"logFrequencySteps": 1},
}
"""The trainer tests' run: ``TEST_MODEL``, 2 local processes, 8 steps, a checkpoint every 4."""


def tiny_lpt(overrides: dict[str, Any] | None = None, name: str = "tiny") -> LlamaPretrain:
    """``TINY`` as a typed LlamaPretrain, each section of ``overrides`` merged over TINY's (or replacing it)."""
    spec = copy.deepcopy(TINY)
    for section, values in (overrides or {}).items():
        if isinstance(values, dict) and isinstance(spec.get(section), dict):
            spec[section] = {**spec[section], **values}
        else:
            spec[section] = values
    return LlamaPretrain.model_validate(lpt(name, spec, namespace="t"))


def write_config(path: Path, obj: LlamaPretrain, dump: Path, patch: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write the trainer TOML the operator renders for ``obj`` (dump folder ``dump``), each ``patch`` section merged in."""
    cfg = render.trainer_config(obj, dump_folder=str(dump))
    for section, values in (patch or {}).items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(tomli_w.dumps(cfg))
    return path
