"""The ahead-of-time block artefact end to end on CPU (kubetitan_trainer.compile.aot_precompile): the real launcher,
one worker, compile on (Inductor's C++ kernels), ``spec.runtime.aotCompile: true``, run twice in one dump folder. Run 1
makes the artefact after its first step; run 2 loads it and its blocks run it. Prints each run's start-up line (its
"AOT blocks: ..." part says what was loaded and served) and the files of the artefact folder after each run (no
``.trying-rank0`` or ``.making`` marker may be left by a run that trained past step 2).

    PATH=$PWD/.tools/bin:$PWD/.venv/bin:$PATH python bench/aot_precompile_cpu.py [--work /tmp/aot-cpu] [--steps 4]
        [--precision '{"activationCheckpointing": "full"}']    # spec.precision fields over the default's

CPU timings say nothing of a GPU's: loading builds the artefact's C++ kernels again (seconds here, none on a GPU).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from support import trainer  # noqa: E402 - after the path set-up
from support.specs import tiny_lpt, write_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/aot-cpu"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", type=json.loads, default={}, help="spec.precision fields (JSON) over the default's")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    obj = tiny_lpt({"training": {"steps": args.steps, "seqLen": 32, "localBatchSize": 2},
                    "precision": {"activationCheckpointing": "none", "mixedPrecisionParam": "float32",
                                  "compile": True, **args.precision},
                    "data": {"source": "synthetic"}, "checkpoint": {"enabled": False},
                    "parallelism": {"dataParallelShardDegree": 1},
                    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1},
                    "runtime": {"aotCompile": True}})
    failed = False
    for run in (1, 2):
        cfg = write_config(args.work / f"run{run}.toml", obj, args.work / "dump", {"kubetitan": {"metrics_port": 0}})
        begin = time.time()
        rc, out = trainer.launch(cfg, 1, f"aot{run}", timeout=900)
        print(f"=== run {run}: exit {rc} in {time.time() - begin:.1f} s")
        for line in out.splitlines():
            if "AOT precompile" in line or "Start-up of" in line:
                print("   ", line.split(" - ")[-1] if " - " in line else line)
        files = sorted((args.work / "dump").rglob("aot/*"))
        for f in files:
            print(f"    file: {f.name} ({f.stat().st_size} bytes)")
        served = [int(n) for n in re.findall(r"AOT blocks: loaded in [\d.]+ s, (\d+) calls served", out)]
        problems = [what for what, bad in (
            (f"exit code {rc}", rc != 0),
            ("a marker was left", any(".trying-" in f.name or f.name.endswith((".making", ".crashed")) for f in files)),
            ("no artefact was made", run == 1 and not any(f.suffix == ".aot" for f in files)),
            ("the artefact served no call", run == 2 and not (served and served[0] > 0))) if bad]
        print(f"    {'FAILED: ' + '; '.join(problems) if problems else 'as expected'}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
