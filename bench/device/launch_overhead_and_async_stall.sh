#!/bin/bash
# After the synthetic source was vectorised (~0.1-0.5 ms a sample instead of ~4.5 ms):
# kubetitan launch path vs plain torchtitan for 3B FP8 tensorwise and compile (bf16), alternating in one
# run; then the async checkpoint stall for 3B (one full save at step 12, async_mode = "async").
source bench/device/setup.sh
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 330 --case-timeout 150 --cases \
3B:fp8tw:2:path=alt,3B:fp8tw:2:steps=20:warmup=4:ckpt=async:ckint=12,3B:compile:2:path=alt
finish
