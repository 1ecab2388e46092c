#!/bin/bash
# the overhead check (kubetitan launch path / plain torchtitan, alternating,
# back to back) in the modes launch_overhead_and_async_stall.sh did not reach: 3B compile, 3B eager, 3B FP8 rowwise, 1B eager.
source bench/device/setup.sh
python3 bench/gpu_bench.py run --out "$OUT/r" --path alt --deadline 560 --case-timeout 150 --cases \
3B:compile:2:steps=25:warmup=5,3B:eager:1:steps=25:warmup=5,3B:fp8rw:2:steps=25:warmup=5,1B:eager:2:steps=25:warmup=5
finish
