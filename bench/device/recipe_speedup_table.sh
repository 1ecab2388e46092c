#!/bin/bash
# the >= 1.10x table in one call. Predictions, written before the
# run, are in bench/results/RECORDS.md ("predictions written before"). Alternating rounds on one H200:
#   B2 = plain torchtitan, FP8 tensorwise, batch 2 (its best reference mode)
#   B4 = plain torchtitan, FP8 tensorwise, batch 4 (the recipe's batch)
#   R  = kubetitan's recipe through `kubetitan run`: batch 4, FP8 output projection (filterFqns: []) that
#        kubetitan's TrainSpec compiles (compile_fp8_head), Inductor coordinate-descent tuning (spec env)
#   E  = plain torchtitan 3B bf16 eager at batch 1 (its only fitting batch: 93.8 GiB), for P3
# Round 1: B2, R, B4, E. If R fails (e.g. out of memory) the
# rest uses batch 3 for R and plain. Round 2: B2, B4, then R with pinned checkpoints every 40 steps, killed
# after step 84 (the first save pins ~43 GB: its stall; the second reuses the buffers: the steady stall).
source bench/device/setup.sh
ckpt_cleaner
S=steps=18:warmup=5
B2=3B:fp8tw:2:path=plain:$S
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $((575 - SECONDS)) --case-timeout 150 --cases \
$B2,3B:fp8tw:4:fp8out=1:cdt=1:path=kubetitan:$S
RB=$(python3 - "$OUT/r/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
r = [x for x in rows if x["path"] == "kubetitan"]
print(4 if r and "tps_median" in r[-1] else 3)
PY
)
echo "recipe batch: $RB" | tee -a "$OUT/r/env.txt"
[ "$RB" = 3 ] && python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $((575 - SECONDS)) --case-timeout 150 --cases \
3B:fp8tw:3:fp8out=1:cdt=1:path=kubetitan:$S
BR=3B:fp8tw:$RB:path=plain:$S
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $((575 - SECONDS)) --case-timeout 150 --cases \
$BR,3B:eager:1:path=plain:$S,$B2:round=2,$BR:round=2
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $((578 - SECONDS)) --case-timeout $((575 - SECONDS)) --cases \
3B:fp8tw:$RB:fp8out=1:cdt=1:path=kubetitan:steps=200:warmup=5:ckpt=pinned:ckint=40:kill=84:round=2
kill %1
finish
