"""Running the real trainer launcher (``python -m kubetitan_trainer.launch``) on one node from a test: the config
the operator renders for a spec, with the sample ledger on, and one launch whose output is kept in a log file
(forked from a warm parent that imported torch once: :mod:`support.warm`); rank 0's step log read while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


WORKERS = r"""
import gc, importlib, json, os, sys, traceback
gc.disable()  # as kubetitan_trainer.main.imports_without_gc: no collection while importing, the imports frozen
for name in ("torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._inductor.compile_fx",
             "datasets", "numpy"):  # what a worker imports from torch and the datasets library (not torchtitan)
    importlib.import_module(name)
gc.enable()
gc.freeze()
codes = []
for case in json.loads(sys.argv[1]):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        log = os.open(case["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(case["env"])
        sys.argv = ["kubetitan_trainer.main", "--job.config_file", case["config"]]  # as torchrun starts a worker
        try:
            exec(case["prelude"], {})
            from kubetitan_trainer import main
            code = main.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def workers_in_one_process(cases: list[tuple[Path, str]], env: dict[str, str], prelude: str = "",
                           timeout: float = 300) -> list[tuple[int, str]]:
    """Run one single-rank worker (``kubetitan_trainer.main``, what torchrun starts) per ``(config, MASTER_PORT)``
    of ``cases``, one after the other, each forked from one Python process that imported torch and the datasets
    library once (torchtitan binds ``sys.argv`` when imported: each worker imports it), with ``env`` (RANK, WORLD_SIZE, HF_ENDPOINT, ...: the same for all,
    as the libraries read some of it at import) and ``prelude`` run in each before it: (exit code, output) each."""
    payload = [{"config": str(cfg), "log": str(cfg.with_suffix(".worker.log")), "prelude": prelude,
                "env": {"MASTER_PORT": str(port)}} for cfg, port in cases]
    r = subprocess.run([sys.executable, "-c", WORKERS, json.dumps(payload)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    codes = json.loads(r.stdout.splitlines()[-1])
    return [(code, Path(p["log"]).read_text(errors="replace")) for code, p in zip(codes, payload)]
