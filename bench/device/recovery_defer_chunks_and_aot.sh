#!/bin/bash
# on ONE machine, in one call, two halves of bench/device/recovery_anatomy.sh (no
# probes, no caching precompile), each planning 3 kills of workers that had saved and a cold one:
#   1. the defaults of that time: the deferred copy's 64 MiB chunks (restore_tier.DEFER_BOUNCE_BUDGET) and the CUDA
#      context made on a side thread (spec.runtime.earlyCudaContext: true, kubetitan_trainer.recovery.cuda_context);
#   2. the same with spec.runtime.aotCompile: true (kubetitan_trainer.compile.aot_precompile): generation 0 makes the blocks'
#      ahead-of-time artefact after its first step; each restarted worker loads it on a side thread instead of
#      tracing and compiling the blocks. The start-up lines ("Start-up of ...", in launcher_grep.txt of each half)
#      say "AOT blocks: loaded in X s, N calls served, M compiled as usual".
# Against recovery_knobs_vs_baseline.sh and recovery_deferred_copy.sh (H100: p50 6.7 s kill -> first step end; warm compile 2.0-2.8 s).
# $OUT: defaults_recovery.txt, aot_recovery.txt (each half's events and anatomy table), halves.tgz (both halves' $OUT:
# events, start-up records, launcher logs).
# Usage (device tool, carry [".whl"], timeout_s 600; needs_h200 for the H200 recipe): bash bench/device/recovery_defer_chunks_and_aot.sh [560]
set -u
bash bench/device/two_halves.sh "${1:-560}" defer_chunks_and_aot defaults "RUNTIME=earlyCudaContext=true" \
  aot "RUNTIME=earlyCudaContext=true,aotCompile=true"
grep -ah "AOT" /tmp/r/launcher_grep.txt 2>/dev/null | cut -c1-400 | tail -12
