#!/bin/bash
# recipe_speedup_table.sh's recipe runs
# never reached step 1: with Inductor's coordinate-descent tuning the first compile took > 130 s (both
# at batch 4 and 3, cut by the 150 s case limit). This script drops that knob and measures, in one device call:
#   B2 = plain torchtitan FP8 tensorwise batch 2 (best reference mode), R = kubetitan's recipe (batch 4,
#   FP8 output projection compiled by kubetitan's TrainSpec), B4 = plain at batch 4, E = 3B bf16 eager
#   batch 1 (P3), then a second R if the deadline allows. Predictions, written before the run: bench/results/RECORDS.md.
source bench/device/setup.sh
S=steps=18:warmup=5
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $((240 - SECONDS)) --case-timeout 120 --cases \
3B:fp8tw:2:path=plain:$S,3B:fp8tw:4:fp8out=1:path=kubetitan:$S,3B:fp8tw:4:path=plain:$S,3B:eager:1:path=plain:$S,3B:fp8tw:4:fp8out=1:path=kubetitan:$S:round=2
finish
