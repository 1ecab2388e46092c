#!/bin/bash
# pinned saves through kubetitan's path with kubetitan_trainer/recovery/staging.py
# (the reusable DCP stager). launch_overhead_1b_and_pinned_stall.sh (plain torchtitan) and
# recipe_pinned_checkpoint_stall.sh (kubetitan) showed that on torch 2.11.0
# every async_with_pinned_mem save after the first fails in the background (KeyError: <class 'type'>;
# pytorch issue 183413) and the run dies at the save after it. Written for a short device budget, this is the
# 1B model (compile + FP8 tensorwise, batch 4; ~18 GB full
# checkpoints), pinned saves at steps 60 and 120 (~32 s of training apart) and the final full save after
# step 121. It must exit 0; step 121's time gives the stall of a second pinned save that really completes,
# and the scraped newest-checkpoint gauge must reach 120 only once that save's write has ended.
source bench/device/setup.sh
ckpt_cleaner
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 260 --case-timeout 260 --cases \
1B:fp8tw:4:path=kubetitan:steps=121:warmup=4:ckpt=pinned:ckint=60:scrape=1
kill %1
finish
