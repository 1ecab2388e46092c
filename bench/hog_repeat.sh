#!/usr/bin/env bash
# Reliability under load: run `pytest tests/operator tests/e2e tests/cluster` (the operator against the double, the
# end-to-end faults, and the real control plane's lane) N times in a row while two CPU hogs
# (`yes > /dev/null`, one per core) compete for the machine. Prints pass/fail and wall time per run and a
# summary; exits non-zero if any run failed. The hogs are started and stopped by their PIDs.
#
#   bench/hog_repeat.sh [N] [pytest args...]        (default N=10; e.g. bench/hog_repeat.sh 1 -x)
#
# Run from the repository root with the test environment (PYTHONPATH with operator/ and trainer/, the venv's
# python on PATH), as docs/testing.md shows.
set -u
N="${1:-10}"
shift || true
HOGS=()
stop_hogs() {
  for pid in "${HOGS[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  HOGS=()
}
trap stop_hogs EXIT
trap 'exit 143' INT TERM  # then the EXIT trap stops the hogs
for _ in 1 2; do
  yes > /dev/null &
  HOGS+=("$!")
done
echo "hogs: ${HOGS[*]} (2 x yes > /dev/null); runs: $N; $(nproc) CPUs"
passed=0
for i in $(seq 1 "$N"); do
  start=$(date +%s.%N)
  if python -m pytest -q -p no:cacheprovider tests/operator tests/e2e tests/cluster "$@" > "/tmp/hog_repeat_run_$i.log" 2>&1; then
    result=pass; passed=$((passed + 1))
  else
    result=FAIL
  fi
  end=$(date +%s.%N)
  printf 'run %d/%d: %s in %.1f s (%s; log /tmp/hog_repeat_run_%d.log)\n' "$i" "$N" "$result" \
    "$(echo "$end - $start" | bc)" "$(tail -n 1 "/tmp/hog_repeat_run_$i.log")" "$i"
done
stop_hogs
echo "passed $passed of $N"
[ "$passed" -eq "$N" ]
