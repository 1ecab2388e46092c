#!/bin/bash
# two measurements in one call, ~7 min.
#   1. bench/teardown_probe.py: where a killed worker's seconds go (CUDA context, 100 GiB of GPU memory, 40 GiB of
#      pinned host memory from the caching host allocator = today's DCP staging, 40 GiB of a /dev/shm file
#      registered in place): SIGKILL -> robust mutex handed over -> reaped -> GPU memory free; and the load side:
#      /dev/shm -> GPU unregistered, registered (1 and 4 streams), register cost, pipelined register+copy.
#   2. bench/device/launcher_warm_workers.sh's checks: the static launcher's warm fork with CUDA workers, exit_now, SIGTERM resume.
# Usage (device tool, carry [".whl"]): bash bench/device/teardown_and_launcher_checks.sh
export R=/tmp/r
source bench/device/setup.sh
echo "=== 1. teardown probe $(date -u +%T)"
{ df -h /dev/shm; free -g; } | tee "$R/probe_env.txt"
timeout 280 python3 bench/teardown_probe.py --host-gib 40 --gpu-gib 100 --repeats 2 --out "$R/probe" 2>&1 \
  | tee "$OUT/probe.txt"
snap
echo "=== 2. static launcher checks $(date -u +%T)"
timeout 150 bash bench/device/launcher_warm_workers.sh > "$R/c16.txt" 2>&1   # writes summary.txt and grep.txt into $OUT
tail -5 "$R/c16.txt"
snap
echo "=== end $(date -u +%T)"
