"""In-process restart (``kubetitan_trainer.recovery.inprocess``): fault → next trained step, per phase, on a real gang.

Runs ``tests/support/gang.py`` (a small model, Adam, gradients all-reduced over the iteration's process group, the
restore tier every 2 steps) with an injected fault at step 5, ``--repeats`` times per kind, and prints for each rank
the seconds from the fault (its wall-clock time, recorded by the rank that faulted; for a hang: when the peer's
collective timed out) to: this rank caught it, its process group torn down, every rank agreed (store barrier), the
new process group ready, the state reloaded from the restore tier, and the end of the first trained step.

    python bench/inprocess_bench.py [--repeats 3] [--backend gloo|nccl] [--dim 64] [--out bench/results/inprocess]

CPU (gloo, 2 ranks) by default; ``--backend nccl`` puts rank r on ``cuda:r`` (bench/device/inprocess_restart_nccl.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "trainer"), str(REPO / "operator" / "core"), str(REPO / "operator")]

from support import gang  # noqa: E402

PHASES = ("caught", "torn_down", "agreed", "pg_ready", "state_loaded", "first_step")
KINDS = {"raise": "1:5:raise", "nan": "0:5:nan", "hang": "1:5:hang"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="raise,nan,hang")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--timeout", type=float, default=2.0, help="collective timeout (s): the hang detector")
    p.add_argument("--progress-timeout", type=float, default=0.0,
                   help="seconds a step may stand still before the monitor reports a Hang (0: off; NCCL needs it)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    rows, raw = [], []
    print(f"in-process restart, {a.world} ranks, backend {a.backend}, dim {a.dim}, collective timeout {a.timeout} s, "
          f"progress timeout {a.progress_timeout or 'off'}")
    print(f"{'kind':6} {'run':>3} {'rank':>4} " + " ".join(f"{ph:>12}" for ph in PHASES) + "   (s after the fault)")
    for kind in a.kinds.split(","):
        for run in range(a.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                begin = time.monotonic()
                results = gang.launch(Path(tmp), world=a.world, env={"KUBETITAN_TEST_FAULT": KINDS[kind]},
                                      steps=8, save_every=2, timeout=a.timeout, backend=a.backend, dim=a.dim,
                                      progress_timeout=a.progress_timeout)
                wall = time.monotonic() - begin
            for rank, (pid, code, report) in enumerate(results):
                rec = (report.get("recoveries") or [{}])[0]
                raw.append({"kind": kind, "run": run, "rank": rank, "pid": pid, "exit_code": code,
                            "restarts": report.get("restarts"), "recovery": rec, "launch_seconds": wall,
                            "same_pid": all(it["pid"] == pid for it in report.get("iterations", []))})
                if code != 0 or "fault" not in rec:
                    print(f"{kind:6} {run:>3} {rank:>4} FAILED exit {code}: {report.get('gave_up', '')}")
                    continue
                d = [rec[ph] - rec["fault"] if ph in rec else float("nan") for ph in PHASES]
                rows.append((kind, d[-1]))
                print(f"{kind:6} {run:>3} {rank:>4} " + " ".join(f"{x:12.3f}" for x in d))
    for kind in a.kinds.split(","):
        xs = [x for k, x in rows if k == kind]
        if xs:
            print(f"{kind}: fault → end of the first step after the restart, p50 {statistics.median(xs):.3f} s, "
                  f"max {max(xs):.3f} s over {len(xs)} rank-runs")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.backend}.json").write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
