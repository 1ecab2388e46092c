#!/bin/bash
# plain torchtitan 0.2.2 reproduction of the reference numbers (docs/benchmarks.md) + bf16 matmul ceiling
# + a 2-step CUDA kernel profile of 3B compile+FP8 tensorwise (steps 29-30, after the timed steps).
source bench/device/setup.sh
python3 bench/gpu_bench.py matmul --out "$OUT/r"
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 520 --case-timeout 200 --cases \
3B:fp8tw:2:steps=31:profile=28,3B:compile:2,3B:eager:1,3B:fp8rw:2,1B:fp8tw:4,1B:compile:4,1B:eager:2,3B:fp8tw:3
finish
