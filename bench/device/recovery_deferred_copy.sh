#!/bin/bash
# after recovery_knobs_vs_baseline.sh (the recovery path's knobs: kill -> first step end p50 6.7 s against 9.2 s,
# but the first step's warm compile 3.4-3.9 s against 2.0-2.2 s while the optimizer's moments were copied in the
# background on 16 threads of 8 MiB chunks). Two halves on ONE machine, each bench/device/recovery_anatomy.sh with no probes and
# all four knobs (spec.runtime stagingWrite: pwrite, restoreTierRead: pread, restoreTierLoadThreads: 16,
# deferOptimizerLoad: true), the deferred copy on deferThreads: 4 threads (the default):
#   1. defer4:            as above, PRECOMPILE=0;
#   2. defer4_precompile: as above with TORCH_CACHING_PRECOMPILE=1 (recovery_anatomy.sh reruns without it if gen 0 fails).
# $OUT gets defer4_recovery.txt, defer4_precompile_recovery.txt and halves.tgz (both halves' $OUT folders).
# Usage (device tool, carry [".whl"], timeout_s 600): bash bench/device/recovery_deferred_copy.sh [540]
set -u
END=${1:-540}
FINAL=$OUT
HALF=$(((END - 20) / 2))
KNOBS="RUNTIME=stagingWrite=pwrite,restoreTierRead=pread,restoreTierLoadThreads=16,deferOptimizerLoad=true,deferThreads=4"
rm -rf /tmp/deferred_copy && mkdir -p /tmp/deferred_copy/defer4 /tmp/deferred_copy/defer4_precompile
echo "=== defer4 half, ${HALF} s, $(date -u +%T)"
env OUT=/tmp/deferred_copy/defer4 PRECOMPILE=0 PROBE_S=0 PROBES=0 $KNOBS bash bench/device/recovery_anatomy.sh "$HALF" 2>&1 \
  | grep -v "^{\"t\"" | tail -30
cp /tmp/deferred_copy/defer4/recovery.txt "$FINAL/defer4_recovery.txt" 2>/dev/null
LEFT=$((END - SECONDS - 10))
echo "=== defer4_precompile half, ${LEFT} s, $(date -u +%T)"
env OUT=/tmp/deferred_copy/defer4_precompile PRECOMPILE=1 PROBE_S=0 PROBES=0 $KNOBS bash bench/device/recovery_anatomy.sh "$LEFT" 2>&1 \
  | grep -v "^{\"t\"" | tail -30
cp /tmp/deferred_copy/defer4_precompile/recovery.txt "$FINAL/defer4_precompile_recovery.txt" 2>/dev/null
tar -C /tmp/deferred_copy -czf "$FINAL/halves.tgz" defer4 defer4_precompile
echo "=== end $(date -u +%T), $SECONDS s"
