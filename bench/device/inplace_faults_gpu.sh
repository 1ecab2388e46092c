#!/bin/bash
# Non-fatal faults recovered in place on one GPU (kubetitan_trainer.recovery.inprocess): the card's own recipe
# (examples/llama3-3b-h100.yaml, or the H200's with RECIPE=), seq 8192, STEPS steps with a checkpoint and the restore
# tier every INTERVAL, `runPolicy.inProcessRestarts: 3` and `inProcessHangSeconds: PROGRESS_S`, through the
# pod entry point (kubetitan_trainer.launch, in-place mode). Three faults injected (KUBETITAN_TEST_FAULT, tests only):
# an exception at step F1, a non-finite loss at step F2, a hang (the rank sleeps in its step, as a rank whose
# collective never returns) at step F3. Each must restart in the same process with the compiled model kept; the
# number is fault -> the end of the next trained step (target <= 2 s for the exception and the NaN; the hang adds
# its detection, the progress timeout). The lines that time them -> faults.txt, the whole log -> logs.tgz; one row
# per fault (bench/inprocess_bench.py's anatomy of the log) -> table.txt.
# Usage (device tool, kind nvidia-h100-x1, carry [".whl"], timeout_s 600): bash bench/device/inplace_faults_gpu.sh
# CPU dry run (the debug model, 30 steps, eager): DRY=1 OUT=/tmp/ipf bash bench/device/inplace_faults_gpu.sh
export R=${R:-/tmp/r_inplace}
DRY=${DRY:-0}
rm -rf "$R"
mkdir -p "$OUT"
source bench/device/setup.sh
RECIPE=${RECIPE:-examples/llama3-3b-h100.yaml}
if [ "$DRY" = 1 ]; then
  STEPS=${STEPS:-30} INTERVAL=${INTERVAL:-5} F1=${F1:-8} F2=${F2:-14} F3=${F3:-22} PROGRESS_S=${PROGRESS_S:-10} CPU=1
else
  STEPS=${STEPS:-40} INTERVAL=${INTERVAL:-10} F1=${F1:-13} F2=${F2:-16} F3=${F3:-19} PROGRESS_S=${PROGRESS_S:-10} CPU=0
fi
W=/tmp/inplace_faults
rm -rf "$W" /dev/shm/kt-inplace-tier
mkdir -p "$W"
cp "$R/env.txt" "$OUT/" 2>/dev/null
python3 - "$RECIPE" "$W" "$STEPS" "$INTERVAL" "$PROGRESS_S" "$CPU" <<'PY'
import sys, tomllib, tomli_w
from pathlib import Path
sys.path[:0] = ["bench"]
from recovery_bench import build_lpt
from kubetitan_trainer.local import write_config
recipe, w, steps, interval, progress, cpu = sys.argv[1:]
lpt = build_lpt(Path(recipe), steps=int(steps), interval=int(interval), cpu=cpu == "1")
# the spec's fields, rendered as a pod's trainer.toml is: [kubetitan] inprocess_restarts, *_progress_timeout_seconds
lpt.spec.run_policy.in_process_restarts, lpt.spec.run_policy.in_process_hang_seconds = 3, int(progress)
config = write_config(lpt, Path(w), None, 0)
kt = tomllib.loads(config.read_text())["kubetitan"]
assert (kt["inprocess_restarts"], kt["inprocess_progress_timeout_seconds"]) == (3, int(progress)), kt
print(config, "runPolicy.inProcessRestarts 3, inProcessHangSeconds", progress)
PY
echo "$(date -u +%T) faults: raise at $F1, nan at $F2, hang at $F3; progress timeout $PROGRESS_S s" | tee "$OUT/faults.txt"
# a 3B checkpoint is 44 GiB and the disk 64 GiB: each complete one (it has .metadata) is deleted, as the recovery
# benches do (ckpt_cleaner); the in-place restarts load from the restore tier
( while sleep 2; do for d in "$W"/checkpoint/step-*; do
    [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted complete checkpoint $d"; done; done ) \
  > "$R/cleaner.txt" 2>&1 &
cleaner=$!
t0=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=0 KUBETITAN_TEST_FAULT=0:$F1:raise,0:$F2:nan,0:$F3:hang timeout 540 python3 -m kubetitan_trainer.launch \
  --config=$W/trainer.toml --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=29517 \
  --rdzv-id=inplace --max-restarts=1 --restore-tier=/dev/shm/kt-inplace-tier > "$R/run.log" 2>&1
rc=$?
kill $cleaner 2>/dev/null
echo "exit $rc after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s" | tee -a "$OUT/faults.txt" "$R/run.log"
grep -aE "Injected fault|faulted in iteration|In-process restart|made no progress|Loaded step|Restore tier|step: +([0-9]+) |Exiting|Traceback|Error" \
  "$R/run.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220 >> "$OUT/faults.txt"
python3 bench/inplace_faults_table.py "$R/run.log" 2>&1 | tee "$OUT/table.txt"
snap
