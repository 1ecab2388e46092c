"""Builders for trainer tests: a debug-model LlamaPretrain and its rendered config."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import tomli_w

from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain

TINY: dict[str, Any] = {
    "model": {"flavor": "debug"},
    "training": {"steps": 8, "seqLen": 64, "localBatchSize": 4, "learningRate": 0.002, "warmupSteps": 2, "seed": 7},
    "parallelism": {"dataParallelShardDegree": 2},
    # bf16 matmuls are ~5x slower than fp32 on CPU; the debug runs use fp32 parameters.
    "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32"},
    "data": {"source": "huggingface", "huggingface": {"dataset": "builtin", "streaming": False}},
    "tokenizer": {"source": "builtin"},
    "checkpoint": {"intervalSteps": 4, "asyncMode": "disabled", "keepLatestK": 0},
    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 2},
    "monitoring": {"logFrequencySteps": 1},
}


def lpt(overrides: dict[str, Any] | None = None, name: str = "tiny") -> LlamaPretrain:
    spec = copy.deepcopy(TINY)
    for section, values in (overrides or {}).items():
        if isinstance(values, dict) and isinstance(spec.get(section), dict):
            spec[section] = {**spec[section], **values}
        else:
            spec[section] = values
    return LlamaPretrain.model_validate(
        {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", "metadata": {"name": name, "namespace": "t"}, "spec": spec}
    )


def write_config(path: Path, obj: LlamaPretrain, dump: Path, patch: dict[str, dict[str, Any]] | None = None) -> Path:
    cfg = render.trainer_config(obj, dump_folder=str(dump))
    for section, values in (patch or {}).items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(tomli_w.dumps(cfg))
    return path
