#!/bin/bash
# failure -> next first trained step of the 3B recipe
# (examples/llama3-3b-h200.yaml) through kubetitan's pod entry point (kubetitan_trainer.launch, --max-restarts)
# with checkpoints every 10 steps and the restore tier, on one H200 (bench/recovery_bench.py):
#   generation 0: cold start (empty compile cache, no checkpoint), saves step 10 (DCP + tier), SIGKILLed at step 12
#   generation 1: warm compile cache + restore tier        (the fast path; target <= 20 s kill -> first step end)
#   generation 2: warm compile cache + DCP load            (the tier moved away first: the "before")
#   generation 3: cold compile cache + restore tier        (the compile cache moved away first)
# Also the NCCL net-check (python -m kubetitan_trainer.netcheck) first. Everything printed goes to
# files in $OUT as it happens (a call cut by its limit keeps them): recovery.txt, events.jsonl, launcher.log,
# netcheck.txt; at the end results.json, startup.jsonl, steps.jsonl and logs.tgz (env.txt).
# Usage (device tool, carry [".whl"]): [SKIP_NETCHECK=1] bash bench/device/recovery.sh [SECONDS=400] [PLAN]
export R=/tmp/r
source bench/device/setup.sh
END=${1:-400}
PLAN=${2:-warm_tier,warm_dcp,cold_tier}   # a second argument: fewer planned restarts (e.g. warm_tier)
{ echo "--- /dev/shm and memory"; df -h /dev/shm; free -g; } >> "$R/env.txt" 2>&1
if [ -z "${SKIP_NETCHECK:-}" ]; then
  echo "=== netcheck $(date -u +%T)"
  timeout 90 python3 -m kubetitan_trainer.netcheck > "$OUT/netcheck.txt" 2>&1
  echo "exit code $?" >> "$OUT/netcheck.txt"
  cat "$OUT/netcheck.txt" | grep -v "^\s*$" | tail -15
fi
# The tier holds the whole training state (~43 GB for the 3B model + AdamW): /dev/shm when it has the room,
# else a tmpfs of our own (root on the device), else none (the bench then measures DCP loads only).
TIER=/dev/shm/kt-recovery-tier
AVAIL=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ "${AVAIL:-0}" -lt 50 ]; then
  mkdir -p /mnt/kt-tier && mount -t tmpfs -o size=60g tmpfs /mnt/kt-tier && TIER=/mnt/kt-tier/tier \
    || echo "no room for the restore tier: /dev/shm has ${AVAIL} GiB and no tmpfs could be mounted"
fi
echo "=== recovery bench $(date -u +%T): tier $TIER (/dev/shm avail ${AVAIL} GiB), $((END - SECONDS)) s"
python3 bench/recovery_bench.py --out "$OUT" --work /tmp/recovery-bench --tier "$TIER" \
  --deadline $((END - SECONDS)) --plan "$PLAN" 2>&1 | tee "$OUT/recovery.txt"
echo "=== end $(date -u +%T), $SECONDS s"; free -g | head -2
grep -E "Restore tier|restore tier|Loaded step|Finished loading|Resuming|Start-up of" "$OUT/launcher.log" | tail -20
tar -C "$R" -czf "$OUT/logs.tgz" . 2>/dev/null
