#!/bin/bash
# two launcher changes checked on the H200 with CUDA in the workers.
#   1. The static mode (--max-restarts 0) now forks warm workers after importing torch/torchtitan once (it spawned
#      fresh interpreters before).
#   2. Trainer processes end through main.exit_now: Python's exit steps, then os._exit.
# The runs, on 1 GPU with the debug model and synthetic data:
#   a) 300 steps in the static mode, to the end: expect exit 0;
#   b) the same with SIGTERM after the step-100 checkpoint: expect exit 75 and a full checkpoint at the stop step;
#   c) b's resume: it starts at stop + 1 and ends with exit 0;
#   d) the in-place mode (--max-restarts 1), to the end: expect exit 0.
# Every run is timed, and grepped for the warm-worker line and for CUDA fork errors.
export R=/tmp/r
source bench/device/setup.sh
mkdir -p /tmp/warm-workers
python3 - <<'PY'
import sys
from pathlib import Path
sys.path[:0] = ["tests"]
from support.specs import tiny_lpt, write_config
obj = tiny_lpt({"training": {"steps": 300, "seqLen": 256, "localBatchSize": 8},
                "parallelism": {"dataParallelShardDegree": 1},
                "resources": {"nodes": 1, "gpusPerNode": 1, "processesPerNode": 1},
                "precision": {"mixedPrecisionParam": "bfloat16"}, "data": {"source": "synthetic"},
                "checkpoint": {"intervalSteps": 100, "asyncMode": "async"}})
for run in ("a", "b", "d"):
    write_config(Path(f"/tmp/warm-workers/{run}.toml"), obj, Path(f"/tmp/warm-workers/{run}"), {"kubetitan": {"metrics_port": 0}})
PY
L="python3 -m kubetitan_trainer.launch --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1"
run() {  # name, config, extra launcher args
  local t0=$(date +%s.%N); $L --config=/tmp/warm-workers/$2.toml "${@:3}" > "$R/$1.log" 2>&1; local rc=$?
  echo "$1: exit $rc in $(echo "$(date +%s.%N) - $t0" | bc) s" | tee -a "$R/summary.txt"
}
run a_static_to_end a --master-port=29511
t0=$(date +%s.%N)
$L --config=/tmp/warm-workers/b.toml --master-port=29512 > "$R/b_static_sigterm.log" 2>&1 &
pid=$!
until [ -f /tmp/warm-workers/b/checkpoint/step-100/.metadata ] || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
kill -TERM $pid; wait $pid; rc=$?
echo "b_static_sigterm: exit $rc in $(echo "$(date +%s.%N) - $t0" | bc) s; checkpoints: $(ls /tmp/warm-workers/b/checkpoint | tr '\n' ' ')" | tee -a "$R/summary.txt"
run c_static_resume b --master-port=29513
run d_inplace_to_end d --master-port=29514 --max-restarts=1
for f in "$R"/*.log; do
  echo "== $(basename "$f")"
  grep -E "Warm workers|In-place restarts on|Training starts at step|step: *(1|100|300) |Saving a full checkpoint|stopped cleanly|Exiting with code|Cannot re-initialize|terminate called|Fatal Python|Traceback" "$f" | cut -c1-220 | head -20
done | tee "$R/grep.txt"
cp "$R/summary.txt" "$R/grep.txt" "$OUT/"
snap
