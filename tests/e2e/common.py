"""Readers for the end-to-end scenarios and bench/goodput_bench.py (the spec builders are in tests/support/specs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kmockx.harness import free_port  # noqa: F401 - the tests' one port allocator, re-exported for the scenarios
from support.specs import CLAIM, NS, e2e_spec, lpt  # noqa: F401 - re-exported for scenarios written before tests/support


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
