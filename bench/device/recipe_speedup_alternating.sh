#!/bin/bash
# the >= 1.10x table in one call, alternating plain and kubetitan runs.
# Predictions, written before the run: bench/results/RECORDS.md ("predictions written before"). One H200:
#   P2 = plain torchtitan FP8 tensorwise batch 2 (its best reference mode), twice (rounds 1 and 2)
#   K1 = candidate recipe through `kubetitan run`: batch 4, FP8 output projection (filterFqns: []) whose
#        final norm + projection kubetitan's TrainSpec compiles (compile_fp8_head), and the CUDA caching
#        allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF through spec.resources.env)
#   P4 = plain at the recipe's batch 4;  K0 = the current recipe (bf16 head) through `kubetitan run`
#   E1 = plain 3B bf16 eager at batch 1 (its only fitting batch, 93.8 GiB), for P3
# Then the better of K1/K0 again with pinned checkpoints every 50 steps, killed after step 104: the first
# save (pins ~43 GB of host memory) and a steady save (reused buffers). Logs stay in /tmp/r (outside $OUT:
# only 8 files come back) and are tarred into $OUT/logs.tgz after every phase.
export R=/tmp/r
source bench/device/setup.sh
ckpt_cleaner
S=steps=18:warmup=5
K1=3B:fp8tw:4:fp8out=1:alloc=exp
bench() {  # bench END CASES: run CASES, starting none after END seconds of this script
  python3 bench/gpu_bench.py run --out "$R" --deadline $(($1 - SECONDS)) --case-timeout "${CT:-120}" --cases "$2" 2>&1 \
    | tee -a "$R/console.txt"; snap
}
bench 400 "3B:fp8tw:2:path=plain:$S,$K1:path=kubetitan:$S,3B:fp8tw:4:path=plain:$S,3B:fp8tw:4:path=kubetitan:$S,3B:eager:1:path=plain:$S,3B:fp8tw:2:path=plain:$S:round=2"
KB=$(python3 - "$R/results.jsonl" "$K1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
k1 = [x for x in rows if x["path"] == "kubetitan" and "fp8out=1" in x["case"] and "tps_median" in x]
k0 = [x for x in rows if x["path"] == "kubetitan" and "fp8out=1" not in x["case"] and "tps_median" in x]
print(sys.argv[2] if k1 and (not k0 or k1[0]["tps_median"] > k0[0]["tps_median"]) else "3B:fp8tw:4")
PY
)
echo "stall run uses: $KB" | tee -a "$R/env.txt" "$R/console.txt"
CT=$((588 - SECONDS)) bench 588 "$KB:path=kubetitan:steps=200:warmup=5:ckpt=pinned:ckint=50:kill=104:round=2"
kill %1
finish | tee -a "$R/console.txt"; snap
