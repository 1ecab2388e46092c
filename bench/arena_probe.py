"""Kill -> reaped for a worker that had staged a checkpoint: torch's stager against the staging arena.

One child process per run stages --gib of CPU tensors (8 of them) through kubetitan's ``ReusableStager`` (shared,
pinned when CUDA is there, synchronous), twice, as a worker's saves do, and reports its stage times; the parent
then SIGKILLs it and times kill -> ``waitpid`` returning (what torchrun's agent polls). Variants:

  unsaved   the state only, never staged (what the child's own memory costs at death: on a GPU it is device memory)
  today     no tier folder: torch's StateDictStager, one fresh shared-memory storage per tensor (freed at death)
  arena     the tier folder (--folder, default a new folder in /dev/shm): the staged copy in staging-rank-0/<k>.bin
            files that outlive the child; the next child's first stage finds their pages (the "first stage" column)

    python bench/arena_probe.py --gib 2 --runs 3 --out bench/results/recovery/arena_probe_cpu

Prints one JSON line per run and a table; writes results.jsonl into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time, torch
from torch.distributed.checkpoint.staging import StagingOptions
from kubetitan_trainer.recovery.staging import ReusableStager
gib, folder, stages = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
cuda = torch.cuda.is_available()
n = int(gib * 2**30) // 8 // 4
state = {f"t{i}": torch.full((n,), float(i), device="cuda" if cuda else "cpu") for i in range(8)}
stager = ReusableStager(StagingOptions(cuda, True, False, cuda), arena_folder=folder, rank=0)
times = [0.0, 0.0]
for _ in range(stages):
    begin = time.perf_counter()
    stager.stage(state)
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - begin)
times = times[-2:]
arena = stager.arena
print(f"{times[0]:.4f} {times[1]:.4f} {arena.reused if arena else -1}", flush=True)
sys.stdin.read()
"""


def run_once(gib: float, folder: str, stages: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gib), folder, str(stages)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    first, second, reused = child.stdout.readline().split()
    begin = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    os.waitpid(child.pid, 0)
    reaped = time.perf_counter() - begin
    child.stdout.close()
    child.stdin.close()
    return {"first_stage_s": float(first), "second_stage_s": float(second), "reused_files": int(reused),
            "kill_to_reaped_s": reaped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of state each child stages")
    ap.add_argument("--runs", type=int, default=3, help="children per variant (the arena's are generations)")
    ap.add_argument("--folder", default="", help="the tier folder for the arena (default: a new one in /dev/shm)")
    ap.add_argument("--out", default="", help="folder for results.jsonl")
    a = ap.parse_args()
    folder = a.folder or tempfile.mkdtemp(prefix="arena-probe-", dir="/dev/shm")
    rows = []
    try:
        for variant, where, stages in (("unsaved", "", 0), ("today", "", 2), ("arena", folder, 2)):
            for i in range(a.runs):
                r = {"variant": variant, "run": i, "gib": a.gib, **run_once(a.gib, where, stages)}
                print(json.dumps(r), flush=True)
                rows.append(r)
    finally:
        if not a.folder:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\n| variant | GiB | kill -> reaped (median s) | first stage, 1st child (s) | first stage, later children "
          f"(median s) |\n|---|---|---|---|---|")
    for variant in ("unsaved", "today", "arena"):
        rs = [r for r in rows if r["variant"] == variant]
        later = [r["first_stage_s"] for r in rs[1:]] or [float("nan")]
        print(f"| {variant} | {a.gib:g} | {statistics.median(r['kill_to_reaped_s'] for r in rs):.3f} | "
              f"{rs[0]['first_stage_s']:.3f} | {statistics.median(later):.3f} |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
