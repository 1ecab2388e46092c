#!/bin/bash
# Device call 9 (session 4): call 8 again with kubetitan_trainer/staging.py (the reusable DCP stager).
# Calls 7 (plain torchtitan) and 8 (kubetitan) showed that on torch 2.11.0 every async_with_pinned_mem
# save after the first fails in the background (KeyError: <class 'type'>; pytorch issue 183413) and the
# run dies at the save after it. Here: 3B recipe through kubetitan's path, pinned saves every 80 steps
# (~93 s of training, longer than one background write) at steps 80 and 160, the final full save after
# step 161. It must exit 0, and step 161's time gives the steady stall of a pinned save that really
# completes; the scraped newest-checkpoint gauge must reach 160 once that write ends.
source bench/device/setup.sh
( while sleep 2; do for d in /tmp/gpubench/*/out/checkpoint/step-*; do
    [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted complete checkpoint $d"; done; done ) \
  > "$OUT/r/cleaner.txt" 2>&1 &
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 540 --case-timeout 530 --cases \
3B:fp8tw:4:path=kubetitan:steps=161:warmup=4:ckpt=pinned:ckint=80:scrape=1
kill %1
finish
