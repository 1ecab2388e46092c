#!/bin/bash
# loss parity, 300 steps, kubetitan's recipe numerics vs plain
# torchtitan on the same tokens (kubetitan's synthetic source, seed 42) and the same initial weights:
#   kubetitan: `kubetitan run`, FP8 tensorwise with the output projection in FP8 (compiled head)
#   plain:     torchtitan 0.2.2's TrainSpec, FP8 tensorwise with the output projection in bf16
# 3B model at seq 2048, batch 1 (a 300-step 3B run at the recipe's seq 8192 / batch 4 takes ~350 s each);
# learning-rate warm-up 20 steps. The two run at the same time on the one GPU (2 x ~50 GiB): their
# step times are not measurements; only the losses are used ($OUT/loss_parity.png -> docs/loss_parity.png).
source bench/device/setup.sh
C=steps=300:warmup=4:lrwarm=20
GPUBENCH_SEQ_LEN=2048 GPUBENCH_WORK=/tmp/gpubench/p1 python3 bench/gpu_bench.py run --out "$OUT/r/kt" --case-timeout 400 \
  --cases 3B:fp8tw:1:fp8out=1:path=kubetitan:$C > "$OUT/r/parity_kt.txt" 2>&1 &
GPUBENCH_SEQ_LEN=2048 GPUBENCH_WORK=/tmp/gpubench/p2 python3 bench/gpu_bench.py run --out "$OUT/r/plain" --case-timeout 400 \
  --cases 3B:fp8tw:1:data=kt:path=plain:$C > "$OUT/r/parity_plain.txt" 2>&1 &
wait
cat "$OUT/r"/kt/results.jsonl "$OUT/r"/plain/results.jsonl > "$OUT/r/results.jsonl"
python3 bench/plot_parity.py "$OUT/r/kt/results.jsonl" "$OUT/r/plain/results.jsonl" "$OUT/loss_parity.png" | tee "$OUT/r/parity.txt"
finish
