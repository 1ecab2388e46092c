#!/bin/bash
# the recovery path's knobs against the baseline on ONE machine, in one call (the device
# is given back 30 s after a call, so two calls may land on two machines). Each half is bench/device/recovery_anatomy.sh with
# PRECOMPILE=0 and no probes, given half of the seconds:
#   1. knobs: spec.runtime stagingWrite: pwrite, restoreTierRead: pread, restoreTierLoadThreads: 16,
#      deferOptimizerLoad: true (docs/reliability.md "The recovery path's knobs");
#   2. baseline: none of them (the defaults then; the knobs are the defaults now, so this half sets the
#      old values: map writes and reads, no deferral).
# Each half plans 3 kills of workers that had saved and a cold one, and stops early when its time runs short.
# $OUT gets knobs_recovery.txt, baseline_recovery.txt (each half's printed events and anatomy table) and halves.tgz
# (both halves' $OUT folders: events, start-up records with compile_parts, steps, launcher logs).
# Usage (device tool, carry [".whl"], timeout_s 600; needs_h200 for the H200 recipe): bash bench/device/recovery_knobs_vs_baseline.sh [540]
set -u
bash bench/device/two_halves.sh "${1:-540}" knobs_vs_baseline knobs \
  "RUNTIME=stagingWrite=pwrite,restoreTierRead=pread,restoreTierLoadThreads=16,deferOptimizerLoad=true" \
  baseline "RUNTIME=stagingWrite=map,restoreTierRead=map,deferOptimizerLoad=false"
