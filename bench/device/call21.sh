#!/bin/bash
# Device call 21 (issue 29): the recovery path's knobs against the baseline on ONE machine, in one call (the device
# is given back 30 s after a call, so two calls may land on two machines). Each half is bench/device/call20.sh with
# PRECOMPILE=0 and no probes, given half of the seconds:
#   1. knobs: KUBETITAN_STAGING_WRITE=pwrite KUBETITAN_TIER_READ=pread KUBETITAN_TIER_LOAD_THREADS=16
#      KUBETITAN_TIER_DEFER_OPTIMIZER=1 (docs/reliability.md "The recovery path's knobs");
#   2. baseline: none of them (the defaults).
# Each half plans 3 kills of workers that had saved and a cold one, and stops early when its time runs short.
# $OUT gets knobs_recovery.txt, baseline_recovery.txt (each half's printed events and anatomy table) and c21.tgz
# (both halves' $OUT folders: events, start-up records with compile_parts, steps, launcher logs).
# Usage (device tool, carry [".whl"], timeout_s 600; needs_h200 for the H200 recipe): bash bench/device/call21.sh [540]
set -u
END=${1:-540}
FINAL=$OUT
HALF=$(((END - 20) / 2))
rm -rf /tmp/c21 && mkdir -p /tmp/c21/knobs /tmp/c21/baseline
echo "=== knobs half, ${HALF} s, $(date -u +%T)"
OUT=/tmp/c21/knobs PRECOMPILE=0 PROBE_S=0 PROBES=0 KUBETITAN_STAGING_WRITE=pwrite KUBETITAN_TIER_READ=pread \
  KUBETITAN_TIER_LOAD_THREADS=16 KUBETITAN_TIER_DEFER_OPTIMIZER=1 bash bench/device/call20.sh "$HALF" 2>&1 \
  | grep -v "^{\"t\"" | tail -30
cp /tmp/c21/knobs/recovery.txt "$FINAL/knobs_recovery.txt" 2>/dev/null
LEFT=$((END - SECONDS - 10))
echo "=== baseline half, ${LEFT} s, $(date -u +%T)"
OUT=/tmp/c21/baseline PRECOMPILE=0 PROBE_S=0 PROBES=0 bash bench/device/call20.sh "$LEFT" 2>&1 \
  | grep -v "^{\"t\"" | tail -30
cp /tmp/c21/baseline/recovery.txt "$FINAL/baseline_recovery.txt" 2>/dev/null
tar -C /tmp/c21 -czf "$FINAL/c21.tgz" knobs baseline
echo "=== end $(date -u +%T), $SECONDS s"
