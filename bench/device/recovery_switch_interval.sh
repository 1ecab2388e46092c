#!/bin/bash
# the defaults (pwrite staging, pread tier loads, the optimizer's part
# deferred on 4 threads) with spec.runtime.deferSwitchIntervalMs: 1: Python's switch interval 1 ms while the deferred
# copy runs. Against recovery_deferred_copy.sh's first half (the same without it: warm compile
# 2.2-2.8 s, the copy 4.0-5.4 s, the step waiting 0.8-1.6 s). One bench/device/recovery_anatomy.sh run, no probes, warm kills
# only (the plan's cold item runs if time is left).
# $OUT: recovery.txt, events.jsonl, startup records, logs (recovery_anatomy.sh's).
# Usage (device tool, carry [".whl"]): bash bench/device/recovery_switch_interval.sh [SECONDS]
set -u
PRECOMPILE=0 PROBE_S=0 PROBES=0 RUNTIME=deferSwitchIntervalMs=1 bash bench/device/recovery_anatomy.sh "${1:-240}" 2>&1 \
  | grep -v "^{\"t\"" | tail -30
