#!/bin/bash
# The 3B recipe for one H100 (examples/llama3-3b-h100.yaml) against plain torchtitan 0.2.2 on the same card, seq 8192,
# in one call, plain and kubetitan runs alternating (bench/gpu_bench.py; 16 steps, median over steps 6-16 of each run).
#   explore: every layout once, to see what fits 80 GB and which is fastest on each side:
#     plain torchtitan (FP8 tensorwise, bf16 output projection, its allocator defaults): batch 1 without activation
#       checkpointing; batch 1 with gradient accumulation to 4; batch 2 with torchtitan's memory_budget AC (0.8) and
#       with per-op selective AC (batch 2 without AC needs ~83 GiB: 83.7 GiB reserved on an H200);
#     kubetitan (`kubetitan run`; FP8 output projection compiled with the final norm, expandable segments): batch 2
#       without AC; batch 1 accumulated to 4; batch 2 with every 7th block checkpointed; batch 1 (the FP8 head alone).
#   final: the recipe (RECIPE: batch 2, every 7th block checkpointed, as explore found) ROUNDS times, alternating with
#     the plain layouts that fit at batch 2 (PLAINS, each once, the first again if time is left): per-op selective AC
#     (explore's best plain), every 7th and every 5th block checkpointed, and memory_budget 0.6 (0.8 ran out of memory
#     in explore); then the recipe with pinned checkpoint saves every 30 steps, killed after step 32: the first save
#     pins ~43 GB of host memory while the model's ~75 GiB stay on the card.
#   chunks: the chunked loss (`precision.lossChunks`, kubetitan_trainer/chunked_loss.py: no logits of the whole batch)
#     at batch 2 WITHOUT activation checkpointing (out of memory by 376 MiB without it), 4 chunks three times and 8
#     chunks once, alternating with plain's best layout (every 7th block checkpointed) twice and the recipe once, in
#     that order of importance (a short SECONDS runs the first few).
#   saves: the recipe's pinned-save run alone, then plain with every 7th block checkpointed (final's best plain, as the
#     same machine's baseline), and both sides with every 10th block (3 blocks) checkpointed: does less recompute fit?
# Prints the comparison table last (`gpu_bench.py compare`: tok/s per round, median, MFU, reserved memory, ratio to the
# best plain layout that ran). $OUT: table.txt, results.jsonl, ooms.txt, logs.tgz (every run's log and env.txt).
# Usage (device tool, kind nvidia-h100-x1, carry [".whl"], timeout_s 600):
#   bash bench/device/h100_recipe_vs_torchtitan.sh explore|final|chunks|saves [SECONDS=560]
export R=/tmp/r
source bench/device/setup.sh
END=${2:-560}
S=steps=16:warmup=5
KT=fp8out=1:alloc=exp:gpu=H100:path=kubetitan
PLAINS=${PLAINS:-3B:fp8tw:2:ac=selective:sac=op,3B:fp8tw:2:ac=selective:sac=7,3B:fp8tw:2:ac=selective:sac=5,\
3B:fp8tw:2:ac=memory_budget:budget=0.6}
RECIPE=${RECIPE:-3B:fp8tw:2:ac=selective:sac=7:$KT}
ROUNDS=${ROUNDS:-3}
CKPT=$RECIPE:steps=200:warmup=5:ckpt=pinned:ckint=30:kill=32:round=9  # round 9: the pinned-save run
IFS=, read -ra P <<< "$PLAINS"
ckpt_cleaner
bench() {  # bench END CASES: run CASES, starting none after END seconds of this script
  python3 bench/gpu_bench.py run --out "$R" --deadline $(($1 - SECONDS)) --case-timeout "${CT:-150}" --cases "$2" 2>&1 \
    | tee -a "$R/progress.txt"; snap
}
case "${1:-}" in
  explore)
    bench "$END" "3B:fp8tw:1:path=plain:$S,3B:fp8tw:2:$KT:$S,3B:fp8tw:1:gb=4:path=plain:$S,3B:fp8tw:1:gb=4:$KT:$S,\
3B:fp8tw:2:ac=memory_budget:budget=0.8:path=plain:$S,3B:fp8tw:2:ac=selective:sac=7:$KT:$S,\
3B:fp8tw:2:ac=selective:sac=op:path=plain:$S,3B:fp8tw:1:$KT:$S" ;;
  final)
    cases=""
    for i in $(seq 1 "$ROUNDS"); do
      cases="$cases,${P[$((i - 1))]:-}${P[$((i - 1))]:+:path=plain:$S,}$RECIPE:$S:round=$i"
    done
    for p in "${P[@]:$ROUNDS}"; do cases="$cases,$p:path=plain:$S"; done
    bench $((END - ${CKPT_S:-100})) "${cases#,},${P[0]}:path=plain:$S:round=2"
    CT=$((END - SECONDS - 5)) bench "$END" "$CKPT" ;;
  chunks)
    CH=3B:fp8tw:2:ac=none:alloc=exp:gpu=H100:path=kubetitan:$S
    bench "$END" "${P[1]}:path=plain:$S,$CH:chunks=4:round=1,$RECIPE:$S,$CH:chunks=8,$CH:chunks=4:round=2,\
${P[1]}:path=plain:$S:round=2,$CH:chunks=4:round=3" ;;
  saves)
    CT=150 bench "$END" "$CKPT"
    A10=3B:fp8tw:2:ac=selective:sac=10
    bench "$END" "${P[1]}:path=plain:$S,$A10:$KT:$S,$A10:path=plain:$S" ;;
  *) echo "usage: $0 explore|final|chunks|saves [SECONDS]"; exit 2 ;;
esac
kill %1 2>/dev/null
grep -l "OutOfMemoryError\|CUDA out of memory" "$R"/*.log 2>/dev/null | xargs -r -n1 basename > "$OUT/ooms.txt"
grep -h "staging\|Finished saving\|Received\|Completed checkpoint" "$R"/*round_9*.log 2>/dev/null | cut -c1-220 \
  | tee "$OUT/ckpt.txt"
echo "=== runs out of memory:"; cat "$OUT/ooms.txt"
python3 bench/gpu_bench.py compare "$R" | tee "$OUT/table.txt"
snap
