#!/bin/bash
# checkpoint stall for the 3B-class model (compile + FP8 tensorwise, batch 2), one full
# save (43 GB: fp32 weights + AdamW states + data/train state) at step 12, sync vs async (DCP async_save).
# The save after step 12 lands in step 13's logged time; the last step saves model-only (not timed).
source bench/device/setup.sh
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 200 --case-timeout 120 --cases \
3B:fp8tw:2:steps=20:warmup=4:ckpt=sync:ckint=12,3B:fp8tw:2:steps=20:warmup=4:ckpt=async:ckint=12
df -h / >> "$OUT/r/env.txt"
finish
