#!/bin/bash
# the overhead check for 1B compile and 1B FP8 tensorwise; the steady-state
# checkpoint stall with async_with_pinned_mem (full 3B saves at steps 100 and 200: the first one also
# allocates the pinned staging buffers, the second reuses them; ~58 s of disk write fits in 100 steps);
# kubetitan's 3B H200 recipe (batch 4) through the kubetitan path; FP8 output projection at batch 3
# (predicted +3.8%: the output GEMMs are ~25 ms of a ~281 ms sample; batch 4 ran out of memory in batch4_speedup_and_pinned_stall.sh).
source bench/device/setup.sh
python3 bench/gpu_bench.py run --out "$OUT/r" --path alt --deadline 565 --case-timeout 150 --cases \
1B:compile:4:steps=25:warmup=5,1B:fp8tw:4:steps=25:warmup=5
# two full 3B checkpoints (2 x 43 GB) do not fit the 64 GiB disk: delete each one once it is complete
( while sleep 2; do for d in /tmp/gpubench/*/dump/checkpoint/step-*; do
    [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted complete checkpoint $d"; done; done ) &
left=$((565 - SECONDS))
python3 bench/gpu_bench.py run --out "$OUT/r" --path plain --deadline $left --case-timeout 200 --cases \
3B:fp8tw:2:steps=201:warmup=4:ckpt=pinned:ckint=100
kill %1
left=$((565 - SECONDS))
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline $left --case-timeout 110 --cases \
3B:fp8tw:4:path=kubetitan,3B:fp8tw:3:fp8out=1:path=plain
finish
