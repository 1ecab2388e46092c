#!/bin/bash
# Does a new process benchmark Triton configurations again (bench/autotune_reuse.py)? Each mode (fx: torch.compile
# alone; aot: kubetitan's AOT blocks) three times on one cache folder, one GPU; a JSON line a process ->
# autotune_reuse.jsonl, the .best_config files Inductor left -> best_configs.txt.
# Usage (device tool, kind nvidia-h100-x1, carry [".whl"], timeout_s 300): bash bench/device/autotune_reuse.sh
mkdir -p "$OUT"
source bench/device/setup.sh
C=/tmp/autotune_reuse
rm -rf "$C"
for mode in fx aot; do
  for run in 1 2 3; do
    TORCHINDUCTOR_CACHE_DIR=$C/$mode/inductor TRITON_CACHE_DIR=$C/$mode/triton timeout 200 \
      python3 bench/autotune_reuse.py "$mode" "$run" 2> "$R/$mode-$run.err" | tail -1 | tee -a "$OUT/autotune_reuse.jsonl"
  done
done
find "$C" -name "*.best_config" | sed "s|$C/||" | sort > "$OUT/best_configs.txt"
wc -l < "$OUT/best_configs.txt"
snap
