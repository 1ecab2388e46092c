#!/bin/bash
# Two halves of bench/device/recovery_anatomy.sh (no probes, no caching precompile) on ONE machine in one call: the device is
# given back 30 s after a call, so two calls may land on two machines and their timings would not compare. Each half
# gets the variables given for it and half of the seconds (the second what is left); its $OUT folder is
# /tmp/TAG/NAME, its printed events and anatomy table are copied to $OUT/NAME_recovery.txt, and both folders go into
# $OUT/halves.tgz (events, start-up records, launcher logs); TAG names the work folder /tmp/TAG.
# Usage (from a device script): bash bench/device/two_halves.sh SECONDS TAG NAME1 "VAR=VALUE ..." NAME2 "VAR=VALUE ..."
set -u
END=$1 TAG=$2
FINAL=$OUT
rm -rf "/tmp/$TAG" && mkdir -p "/tmp/$TAG/$3" "/tmp/$TAG/$5"
half() {  # NAME "VARS" SECONDS
  echo "=== $1 half, $3 s, $(date -u +%T)"
  # shellcheck disable=SC2086 - VARS is a list of VAR=VALUE words
  env OUT="/tmp/$TAG/$1" PRECOMPILE=0 PROBE_S=0 PROBES=0 $2 bash bench/device/recovery_anatomy.sh "$3" 2>&1 \
    | grep -v "^{\"t\"" | tail -30
  cp "/tmp/$TAG/$1/recovery.txt" "$FINAL/$1_recovery.txt" 2>/dev/null
}
half "$3" "$4" $(((END - 20) / 2))
half "$5" "$6" $((END - SECONDS - 10))
tar -C "/tmp/$TAG" -czf "$FINAL/halves.tgz" "$3" "$5"
echo "=== end $(date -u +%T), $SECONDS s"
