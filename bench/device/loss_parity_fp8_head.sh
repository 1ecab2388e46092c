#!/bin/bash
# After recipe_speedup_alternating.sh measured the recipe at 1.107x (K1: FP8 output projection
# compiled by kubetitan's TrainSpec + expandable segments, batch 4):
# 1. loss parity, 300 steps, the recipe's numerics (kubetitan run, FP8 head) vs plain torchtitan (bf16 head)
#    on the same tokens (kubetitan's synthetic source, seed 42) and initial weights; 3B at seq 2048, batch 1,
#    both at once on the one GPU (their step times are not measurements) -> $OUT/loss_parity.png
# 2. the recipe with pinned saves every 40 steps, killed after step 82: the first save's stall (pinning
#    ~43 GB) and a steady one (step 81); recipe_speedup_alternating.sh's attempt died at its first save (a CPU all-reduce under
#    NCCL in the trainer's free-space estimate, fixed since).
export R=/tmp/r
source bench/device/setup.sh
ckpt_cleaner
C=steps=300:warmup=4:lrwarm=20
GPUBENCH_SEQ_LEN=2048 GPUBENCH_WORK=/tmp/gpubench/p1 python3 bench/gpu_bench.py run --out "$R/kt" --case-timeout 170 \
  --cases 3B:fp8tw:1:fp8out=1:alloc=exp:path=kubetitan:$C > "$R/parity_kt.txt" 2>&1 &
P1=$!
GPUBENCH_SEQ_LEN=2048 GPUBENCH_WORK=/tmp/gpubench/p2 python3 bench/gpu_bench.py run --out "$R/plain" --case-timeout 170 \
  --cases 3B:fp8tw:1:data=kt:path=plain:$C > "$R/parity_plain.txt" 2>&1 &
P2=$!
wait $P1 $P2
cat "$R/parity_kt.txt" "$R/parity_plain.txt"
python3 bench/plot_parity.py "$R/kt/results.jsonl" "$R/plain/results.jsonl" "$OUT/loss_parity.png" | tee "$R/parity.txt"
snap
python3 bench/gpu_bench.py run --out "$R" --deadline $((345 - SECONDS)) --case-timeout $((345 - SECONDS)) --cases \
  3B:fp8tw:4:fp8out=1:alloc=exp:path=kubetitan:steps=200:warmup=5:ckpt=pinned:ckint=40:kill=82 2>&1 | tee "$R/pinned_saves.txt"
kill %1
grep -h "Finished saving\|Received\|Completed checkpoint\|step: \(39\|40\|41\|42\|79\|80\|81\|82\) " /tmp/gpubench/*/out/train.log 2>/dev/null \
  | sed 's/\x1b\[[0-9;]*m//g' > "$R/stall_lines.txt"; cat "$R/stall_lines.txt"
finish
