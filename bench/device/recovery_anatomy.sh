#!/bin/bash
# recovery anatomy of the 3B recipe for kills of workers that HAD SAVED
# (their pinned DCP staging allocated, as in every worker of a real run): bench/recovery_bench.py --tier-only with
# the plan saved:warm_tier x3 then saved:cold_tier, checkpoints every 20 steps; every load from the restore tier
# (read on spec.runtime.restoreTierLoadThreads threads); TORCH_CACHING_PRECOMPILE=1 (torch 2.11's Dynamo cache) unless
# PRECOMPILE=0; RUNTIME=FIELD=VALUE,... sets spec.runtime fields (recovery_bench.py --runtime, docs/api.md). A
# background cleaner deletes each complete DCP checkpoint (the 64 GB disk holds one).
# If generation 0 fails with the precompile cache on, the bench runs again without it.
# Then, with >= 45 s left (PROBE_S=55 are kept for it), bench/teardown_probe.py times 40 GiB tier reads: pread on
# 1-16 threads into pinned buffers and a fresh mapping through pinned buffers (today's load) -> tier_read.txt;
# with >= 50 s still left, the kill probe of a 40 GiB arena registered (today) or only mapped -> teardown.txt.
# PROBES=0: no probes (bench/device/recovery_knobs_vs_baseline.sh). PLAN=...: another plan (recovery_bench.py --plan).
# Raw output in $OUT: recovery.txt, events.jsonl, results.json, launcher.log (tail), logs.tgz.
# On a card of less than ~127 GiB (an H100: the recipe's 116 GiB at seq 8192, batch 4 does not fit) the bench runs the
# same recipe at seq 2048, batch 2 (~56 GiB; the state, and so the tier and the staging, is the same ~40 GiB):
# /tmp/llama3-3b-80gb.yaml, copied into $R. Its step and compile times are not the H200 recipe's.
# CARD_RECIPE=1: on such a card, examples/llama3-3b-h100.yaml instead (the H100's own recipe at seq 8192).
# KEEP=1: the bench keeps its work folder and the tier (recovery_bench.py --keep), e.g. to read the compile cache after.
# Usage (device tool, carry [".whl"]): [PRECOMPILE=0] bash bench/device/recovery_anatomy.sh [SECONDS=540]
export R=/tmp/r
source bench/device/setup.sh
END=${1:-540}
df -h / /tmp /dev/shm > "$R/disk.txt" 2>&1; grep -E ' (/|/tmp|/dev/shm) ' /proc/mounts >> "$R/disk.txt"
( n=0; while sleep 2; do for d in /tmp/recovery-bench/out/checkpoint/step-*; do
    [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted complete checkpoint $d"; done
    ((n++ % 5 == 0)) && echo "$(date -u +%T) $(df -B1G --output=avail / /dev/shm | tr '\n' ' ') du: $(du -sh /tmp/recovery-bench/out/* /dev/shm/* 2>/dev/null | tr '\n\t' '  ')"
  done ) > "$R/cleaner.txt" 2>&1 &
CLEANER=$!
LPT=examples/llama3-3b-h200.yaml
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if (( ${GPU_MIB:-0} > 0 && GPU_MIB < 130000 )) && [ "${CARD_RECIPE:-0}" = 1 ]; then
  LPT=examples/llama3-3b-h100.yaml  # the card's own recipe: seq 8192, batch 2, every 7th block checkpointed
  echo "=== the card has $GPU_MIB MiB: its own recipe $LPT (CARD_RECIPE=1)"
elif (( ${GPU_MIB:-0} > 0 && GPU_MIB < 130000 )); then
  LPT=/tmp/llama3-3b-80gb.yaml
  python3 - "$LPT" <<'PY'
import sys
import yaml
d = yaml.safe_load(open("examples/llama3-3b-h200.yaml"))
d["metadata"]["name"] = "llama3-3b-80gb"
d["spec"]["training"].update(seqLen=2048, localBatchSize=2)
d["spec"]["resources"]["gpuProduct"] = "H100"
yaml.safe_dump(d, open(sys.argv[1], "w"), sort_keys=False)
PY
  cp "$LPT" "$R/"
  echo "=== the card has $GPU_MIB MiB: the recipe at seq 2048, batch 2 ($LPT)"
fi
PLAN=${PLAN:-saved:warm_tier,saved:warm_tier,saved:warm_tier,saved:cold_tier}
PC=--precompile; [ "${PRECOMPILE:-1}" = 0 ] && PC=
RT=(--runtime "${RUNTIME:-}")  # spec.runtime fields, e.g. RUNTIME=aotCompile=true,deferThreads=16 (docs/api.md)
echo "=== recovery bench $(date -u +%T) plan $PLAN $PC, $((END - SECONDS)) s left"
python3 bench/recovery_bench.py --out "$OUT" --work /tmp/recovery-bench --tier /dev/shm/kt-recovery-tier \
  --lpt "$LPT" --interval 20 --tier-only $PC "${RT[@]}" --deadline $((END - SECONDS - ${PROBE_S:-55})) --plan "$PLAN" \
  ${KEEP:+--keep} 2>&1 | tee "$OUT/recovery.txt"
if [ -n "$PC" ] && ! grep -q '"generation": 0' "$OUT/events.jsonl"; then
  echo "=== generation 0 did not train with the precompile cache: again without it $(date -u +%T)"
  mv "$OUT/launcher.log" "$R/launcher_precompile.log"; mv "$OUT/events.jsonl" "$R/events_precompile.jsonl"
  python3 bench/recovery_bench.py --out "$OUT" --work /tmp/recovery-bench --tier /dev/shm/kt-recovery-tier \
    --lpt "$LPT" --interval 20 --tier-only "${RT[@]}" --deadline $((END - SECONDS - ${PROBE_S:-55})) --plan "$PLAN" 2>&1 | tee "$OUT/recovery.txt"
fi
kill $CLEANER
if [ "${PROBES:-1}" = 1 ] && ((END - SECONDS >= 45)); then  # the tier reads a new worker could make, 40 GiB (bench/teardown_probe.py)
  echo "=== tier read probe $(date -u +%T), $((END - SECONDS)) s left"
  rm -rf /dev/shm/kt-recovery-tier
  timeout $((END - SECONDS - 5)) python3 bench/teardown_probe.py --host-gib 40 --fallocate --out "$R/probe" \
    --load-variants pread_1,pread_4,pread_8,pread_16,fresh 2>&1 | tee "$R/tier_read.txt" | tee -a "$OUT/recovery.txt"
fi
if [ "${PROBES:-1}" = 1 ] && ((END - SECONDS >= 50)); then  # what a dead worker's arena costs: registered (today) vs only mapped and written
  echo "=== teardown probe $(date -u +%T), $((END - SECONDS)) s left"
  timeout $((END - SECONDS - 5)) python3 bench/teardown_probe.py --host-gib 40 --gpu-gib 20 --fallocate --skip-load \
    --variants shm_reg,shm_map --repeats 2 --out "$R/probe_kill" 2>&1 | tee "$R/teardown.txt" | tee -a "$OUT/recovery.txt"
fi
echo "=== end $(date -u +%T), $SECONDS s"; free -g | head -2
grep -aE "Restore tier|Loaded step|Finished loading|Start-up of|precompile|DynamoCache|Traceback|Error" "$OUT/launcher.log" \
  | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240 | tail -40 | tee "$R/launcher_grep.txt"
tar -C "$R" -czf "$OUT/logs.tgz" . 2>/dev/null
gzip -f "$OUT/launcher.log"
