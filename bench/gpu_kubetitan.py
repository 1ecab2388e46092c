"""The kubetitan launch path of a bench case: LlamaPretrain YAML -> ``kubetitan run`` -> trainer -> torchtitan.

``kubetitan run`` renders the same ``trainer.toml`` the operator puts in the ConfigMap, starts the
pod entry point (``kubetitan_trainer.launch``: torchrun in-process) with kubetitan's TrainSpec,
metrics exporter, heartbeat and checkpoint glue, and writes torchtitan's log to ``train.log``.
The YAML matches ``gpu_bench.toml_for`` key for key (optimizer, schedule, batch, seq_len, compile,
FP8 recipe and filter, no activation checkpointing, log every step, seed); what differs is
kubetitan's own: its synthetic data source (a seeded Markov chain) and its runtime glue.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

MODE_PRECISION = {
    "eager": {"compile": False, "float8": {"enabled": False}},
    "compile": {"compile": True, "float8": {"enabled": False}},
    "fp8tw": {"compile": True, "float8": {"enabled": True, "recipe": "tensorwise"}},
    "fp8rw": {"compile": True, "float8": {"enabled": True, "recipe": "rowwise"}},
}


CDT_ENV = {"name": "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "value": "1"}
"""Inductor's coordinate-descent tuning of its Triton kernels, set through the spec (``cdt=1``)."""

ALLOC_CONF = {"exp": "expandable_segments:True"}
"""``alloc=`` values: PyTorch's CUDA caching-allocator settings (``PYTORCH_CUDA_ALLOC_CONF``)."""


def alloc_env(case: dict) -> dict:
    if case["alloc"] not in ALLOC_CONF:
        raise SystemExit(f"bad alloc={case['alloc']!r} in case {case['id']!r}: use one of {sorted(ALLOC_CONF)}")
    return {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": ALLOC_CONF[case["alloc"]]}


def spec_env(case: dict) -> list[dict]:
    """The case's ``spec.resources.env`` (plain values; ``kubetitan run`` gives them to the trainer)."""
    return ([dict(CDT_ENV)] if case.get("cdt") else []) + ([alloc_env(case)] if case.get("alloc") else [])


RECIPE_CASE = "3B:fp8tw:4:fp8out=1:alloc=exp"
"""The bench case that ``examples/llama3-3b-h200.yaml`` is (checked in tests/api/test_examples.py)."""

RECIPE_CASE_H100 = "3B:fp8tw:2:ac=selective:sac=7:fp8out=1:alloc=exp:gpu=H100"
"""The bench case that ``examples/llama3-3b-h100.yaml`` is (``bench/device/h100_recipe_vs_torchtitan.sh``'s RECIPE)."""


def _precision(case: dict) -> dict:
    p = {k: dict(v) if isinstance(v, dict) else v for k, v in MODE_PRECISION[case["mode"]].items()}
    if case.get("fp8out") and p["float8"]["enabled"]:
        p["float8"]["filterFqns"] = []
    return p


def _data(case: dict) -> dict:
    """spec.data: kubetitan's synthetic source, or (``data=shards``) the shards at ``shards=DIR`` in the shuffled
    order, as ``gpu_bench.kubetitan_data`` gives the plain path."""
    if case.get("data") == "shards":
        return {"source": "shards", "shards": {"path": case["shards"]}, "order": "shuffled",
                "attentionMask": case.get("mask", "causal")}
    return {"source": "synthetic"}


def _card() -> str:
    """The machine's GPU model as ``spec.resources.gpuProduct`` names it (``nvidia-smi``'s name read by the catalog,
    as the pre-flight gate reads it), so that a case without ``gpu=`` passes the gate's model check on whichever card
    the call got; H200 if unknown."""
    import subprocess

    from kubetitan_core.catalog import product_of

    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "H200"
    return product_of(name[0] if name else None) or "H200"


def _resources(case: dict) -> dict:
    """One GPU of the model ``gpu=`` names (default: the machine's); the debug model on a machine without a GPU (the
    bench's CPU dry runs): one CPU process."""
    if case["flavor"] == "debugmodel":
        from kubetitan_trainer.local import visible_gpus

        if not visible_gpus():
            return {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1}
    return {"nodes": 1, "gpusPerNode": 1, "gpuProduct": case.get("gpu") or _card()}


def _activation_checkpointing(case: dict) -> dict:
    """spec.precision's activation checkpointing; torchtitan's ``memory_budget`` mode is not in kubetitan's spec."""
    if case["ac"] == "memory_budget":
        raise SystemExit(f"case {case['id']!r}: kubetitan's spec has no memory_budget activation checkpointing "
                         "(use ac=none|selective|full, or path=plain)")
    sac = {"selectiveActivationCheckpointing": case.get("sac", "op")} if case["ac"] == "selective" else {}
    return {"activationCheckpointing": case["ac"], **sac}


def lpt_for(case: dict, name: str) -> dict:
    from gpu_bench import CKPT_ASYNC_MODE, SEQ_LEN

    ck = case["ckpt"] if case["ckpt"] != "none" else None
    return {
        "apiVersion": "kubetitan.io/v1alpha1",
        "kind": "LlamaPretrain",
        "metadata": {"name": name},
        "spec": {
            "model": {"flavor": {"debugmodel": "debug"}.get(case["flavor"], case["flavor"])},
            "training": {"steps": case["steps"], "seqLen": SEQ_LEN, "localBatchSize": case["batch"],
                         "learningRate": 3e-4, "warmupSteps": case.get("lrwarm", 4), "weightDecay": 0.1, "maxNorm": 1.0,
                         "seed": case["seed"], **({"globalBatchSize": case["gb"]} if case.get("gb") else {})},
            "parallelism": {"dataParallelShardDegree": -1},
            "precision": {**_precision(case), **_activation_checkpointing(case), "mixedPrecisionParam": "bfloat16",
                          **({"lossChunks": case["chunks"]} if case.get("chunks") else {})},
            "data": _data(case),
            "tokenizer": {"source": "path", "path": case["tok"]} if case.get("tok") else {"source": "builtin"},
            "checkpoint": {"enabled": ck is not None, "intervalSteps": case["ckint"],
                           "asyncMode": CKPT_ASYNC_MODE[case["ckpt"]],
                           "keepLatestK": 2},
            "resources": {**_resources(case), **({"env": spec_env(case)} if spec_env(case) else {})},
            "monitoring": {"logFrequencySteps": 1, "tensorboard": False},
            "runPolicy": {"maxRestarts": 3 if ck else 0},
        },
    }


def kubetitan_command(case: dict, work: Path) -> list[str]:
    name = "bench-" + "".join(ch if ch.isalnum() else "-" for ch in case["id"].lower())[:40].strip("-")
    f = work / "lpt.yaml"
    f.write_text(yaml.safe_dump(lpt_for(case, name), sort_keys=False))
    return [sys.executable, "-m", "kubetitan.cli", "run", str(f), "--output-dir", str(work / "out")]


SERIES = ("kubetitan_trainer_step", "kubetitan_trainer_last_checkpoint_step",
          "kubetitan_trainer_last_checkpoint_timestamp_seconds")


def metrics_scraper(work: Path, dest: Path, stop: threading.Event) -> threading.Thread:
    """Poll the trainer's /metrics (port from the rendered trainer.toml); keep the last good scrape,
    and append the step and newest-checkpoint gauges of every scrape to ``<dest>.series.tsv``."""
    from prometheus_client.parser import text_string_to_metric_families

    series = dest.with_suffix(".series.tsv")
    series.write_text("time\t" + "\t".join(SERIES) + "\n")

    def loop():
        port, n = None, 0
        while not stop.wait(2.0):
            try:
                if port is None:
                    import tomllib

                    cfg = tomllib.loads((work / "out" / "trainer.toml").read_text())
                    port = cfg["kubetitan"]["metrics_port"]
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
                n += 1
                dest.write_text(f"# scrape {n} at {time.strftime('%H:%M:%S')} from port {port}\n{text}")
                values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                with series.open("a") as f:
                    f.write("\t".join([f"{time.time():.1f}", *(str(values.get(k, "")) for k in SERIES)]) + "\n")
            except Exception:  # not up yet, or gone
                continue

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def train_log(work: Path) -> str:
    p = work / "out" / "train.log"
    return p.read_text(errors="replace") if p.exists() else ""


def dump_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1))
