#!/bin/bash
# The recovery must-show on the card at hand, in one call, with the card's own recipe at seq 8192:
# examples/llama3-3b-h200.yaml on an H200 (116 GiB: needs_h200), examples/llama3-3b-h100.yaml on an H100 (CARD_RECIPE=1
# of bench/device/recovery_anatomy.sh), bench/device/recovery_anatomy.sh's whole budget for the recovery bench
# (no probes, no caching precompile), the plan: 3 kills of workers that had saved, then a cold one, with
#   aotCompile: true                generation 0 makes the blocks' artefact (its local rank's, for its GPU); each
#                                   restarted worker loads it (H100 at seq 2048: warm compile 0.55-0.80 s instead
#                                   of 2.2-3.0 s)
#   deferThreads: 16                the optimizer's deferred copy on 16 threads: with the artefact there is no trace
#                                   for them to contend with (H100: on 4 threads the first step waited
#                                   1.4-1.8 s for the copy; on 16, recovery_knobs_vs_baseline.sh's copy took 1.9-2.3 s)
# The DCP row of the table is the bench's cold row plus recovery.sh's warm_dcp (--tier-only refuses it).
# $OUT: recovery.txt (events and the anatomy table), events.jsonl, results.json, launcher.log, logs.tgz.
# On an H100, before the launcher became a child subreaper, the second saved generation stopped with StorageFull (the
# killed worker's DCP writer went on writing; disk.txt and cleaner.txt in logs.tgz); since, the whole plan runs
# (bench/results/recovery/h100_card_recipe_saved3/, docs/reliability.md).
# NAMES=1: the workers log Inductor's autotuner (TORCH_LOGS=+torch._inductor.runtime.triton_heuristics) and
# bench/autotune_names.py names the kernels each generation benchmarked and whether their .best_config was on disk
# -> $OUT/autotune_names.txt and autotune_names.jsonl (the bench's work folder is kept for it, then removed).
# Usage (device tool, carry [".whl"], timeout_s 600; needs_h200 for the H200 row): [NAMES=1] bash bench/device/recovery_card_recipe.sh [560]
set -u
[ "${NAMES:-0}" = 1 ] && export TORCH_LOGS=+torch._inductor.runtime.triton_heuristics KEEP=1  # the cache, read after
CARD_RECIPE=1 PLAN=${PLAN:-saved:warm_tier,saved:warm_tier,saved:warm_tier,saved:cold_tier} PROBES=0 PROBE_S=0 PRECOMPILE=0 \
  RUNTIME=aotCompile=true,deferThreads=16 bash bench/device/recovery_anatomy.sh "${1:-560}"
rc=$?
grep -ah "AOT\|Start-up of" "$OUT/launcher.log" 2>/dev/null | cut -c1-400 | tail -12
ls -la /tmp/recovery-bench/out/compile-cache/*/aot 2>/dev/null || find /tmp/recovery-bench -name '*.aot' -ls 2>/dev/null | head
# Triton re-benchmarks kernels at every warm restart (benchmark_all_configs in startup.jsonl's compile_parts): are
# Inductor's saved best configurations there to be read back?
echo "=== .best_config files in the compile cache: $(find /tmp/recovery-bench -name '*.best_config' 2>/dev/null | wc -l)"
find /tmp/recovery-bench -name '*.best_config' -printf '%TT %s %p\n' 2>/dev/null | sort | head -20
if [ "${NAMES:-0}" = 1 ]; then
  python3 bench/autotune_names.py "$OUT/launcher.log.gz" /tmp/recovery-bench --json "$OUT/autotune_names.jsonl" \
    > "$OUT/autotune_names.txt" 2>&1
  tail -25 "$OUT/autotune_names.txt"
  rm -rf /tmp/recovery-bench /dev/shm/kt-recovery-tier  # kept for the names only: free the disk and the memory
fi
exit $rc
