#!/bin/bash
# kubetitan's 3B H200 recipe (FP8 tensorwise, compile, batch 4) through the
# kubetitan path with its own checkpoint setting, async_with_pinned_mem, every 100 steps: the stall of the
# first save (pinning) and of a steady one (step 200) measured on kubetitan's path (launch_overhead_1b_and_pinned_stall.sh measured them on
# plain torchtitan), and the trainer's newest-complete-checkpoint gauge scraped every 2 s: it must move to
# 100 only when step 100's background write has finished (~83 s of disk), not at the end of staging.
# The final full save after step 201 (another ~83 s write, synchronous) is cut by the case timeout.
source bench/device/setup.sh
ckpt_cleaner
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 560 --case-timeout 450 --cases \
3B:fp8tw:4:path=kubetitan:steps=201:warmup=4:ckpt=pinned:ckint=100:scrape=1
kill %1
finish
