"""Running the real trainer launcher (``python -m kubetitan_trainer.launch``) on one node from a test: the config
the operator renders for a spec, with the sample ledger on, and one launch whose output is kept in a log file
(forked from a warm parent that imported torch once: :mod:`support.warm`); rank 0's step log read while it runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import tomli_w

from kmockx.harness import free_port
from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain
from support import warm

REPO = Path(__file__).resolve().parents[2]


def ledger_config(obj: LlamaPretrain, dump: Path, config: Path) -> Path:
    """Write to ``config`` the trainer TOML the operator renders for ``obj`` (dump folder ``dump``), with every
    rank's sample ledger on (``[kubetitan.data] ledger``) and no metrics port."""
    cfg = render.trainer_config(obj, dump_folder=str(dump))
    cfg["kubetitan"]["data"]["ledger"] = True
    cfg["kubetitan"]["metrics_port"] = 0
    config.write_text(tomli_w.dumps(cfg))
    return config


def launch(config: Path, nproc: int, rdzv_id: str, env: dict[str, str] | None = None,
           timeout: float = 600) -> tuple[int, str]:
    """Run the launcher for ``config`` with ``nproc`` workers on one node and wait: (exit code, its output), the
    output also kept next to the config (``.log``)."""
    log = config.with_suffix(".log")
    log.write_bytes(b"")
    proc = warm.popen("kubetitan_trainer.launch",
                      [f"--config={config}", "--nnodes=1", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                       f"--master-port={free_port()}", f"--rdzv-id={rdzv_id}",
                       "--max-restarts=0"],  # the static launcher: a failure ends the run
                      {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, log, cwd=REPO)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # as subprocess.run's time-out does
        proc.wait(30)
        raise
    return rc, log.read_text(errors="replace")


def step_records(dump: Path) -> list[dict]:
    """Rank 0's step records so far (``<dump>/kubetitan/steps.jsonl``, read while the run writes it: a line still
    being written is left out)."""
    text = (Path(dump) / "kubetitan" / "steps.jsonl").read_text()
    return [json.loads(line) for line in text.split("\n")[:-1] if line]
