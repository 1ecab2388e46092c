#!/bin/bash
# kubetitan launch path vs plain torchtitan (3B FP8 tensorwise, alternating in one run);
# the fast TrainSpec variant (real RoPE + fused chunked loss) at batch 2 and 4; the first trainer run on the
# device (1B compile + FP8 tensorwise, 50 steps through `kubetitan run`, /metrics scraped, checkpoint saved,
# then resumed to step 60); plain batch 4 for attribution.
source bench/device/setup.sh
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 525 --case-timeout 250 --cases \
3B:fp8tw:2:path=alt,3B:fp8tw:4:spec=fast:path=plain,3B:fp8tw:2:spec=fast:path=plain,\
1B:fp8tw:4:steps=50:ckpt=sync:ckint=50:resume=60:scrape=1:path=kubetitan,3B:fp8tw:4:path=plain
finish
