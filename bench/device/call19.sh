#!/bin/bash
# Device call 19 (session 15, issue 29): three measurements in one call, ~8 min.
#   1. bench/teardown_probe.py: where a killed worker's seconds go (CUDA context, 100 GiB of GPU memory, 40 GiB of
#      pinned host memory from the caching host allocator = today's DCP staging, 40 GiB of a /dev/shm file
#      registered in place): SIGKILL -> robust mutex handed over -> reaped -> GPU memory free; and the load side:
#      /dev/shm -> GPU unregistered, registered (1 and 4 streams), register cost, pipelined register+copy.
#   2. bench/device/call16.sh's checks: the static launcher's warm fork with CUDA workers, exit_now, SIGTERM resume.
#   3. call17.sh's part d: the 3B recipe on one GPU with [kubetitan] inprocess_restarts = 3 and an exception
#      injected at steps 15, 25, 35: fault -> next trained step with the compiled model kept (target <= 2 s).
# Usage (device tool, carry [".whl"]): bash bench/device/call19.sh
export R=/tmp/r
source bench/device/setup.sh
echo "=== 1. teardown probe $(date -u +%T)"
{ df -h /dev/shm; free -g; } | tee "$R/probe_env.txt"
timeout 200 python3 bench/teardown_probe.py --host-gib 40 --gpu-gib 100 --repeats 2 --out "$R/probe" 2>&1 \
  | tee "$OUT/probe.txt"
snap
echo "=== 2. static launcher checks $(date -u +%T)"
timeout 150 bash bench/device/call16.sh > "$R/c16.txt" 2>&1   # writes summary.txt and grep.txt into $OUT
tail -5 "$R/c16.txt"
snap
echo "=== 3. in-process restarts of the 3B recipe $(date -u +%T)"
mkdir -p /tmp/c17 && rm -rf /tmp/c17/* /dev/shm/kt-c17-tier
python3 - <<'PY'
import sys, tomllib, tomli_w
from pathlib import Path
sys.path[:0] = ["bench"]
from recovery_bench import build_lpt
from kubetitan_trainer.local import write_config
lpt = build_lpt(Path("examples/llama3-3b-h200.yaml"), steps=40, interval=10, cpu=False)
config = write_config(lpt, Path("/tmp/c17"), None, 0)
cfg = tomllib.loads(config.read_text())
cfg["kubetitan"]["inprocess_restarts"] = 3
config.write_text(tomli_w.dumps(cfg))
print(config)
PY
# the local disk holds one 40 GiB DCP checkpoint: delete each complete one (the in-process restarts load the tier)
( while sleep 2; do for d in $(find /tmp/c17 -maxdepth 3 -type d -name 'step-*'); do
    [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted $d"; done; done ) > "$R/c17_cleaner.txt" 2>&1 &
CLEANER=$!
CUDA_VISIBLE_DEVICES=0 KUBETITAN_TEST_FAULT=0:15:raise,0:25:raise,0:35:raise timeout 270 python3 -m kubetitan_trainer.launch \
  --config=/tmp/c17/trainer.toml --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=29517 \
  --rdzv-id=c17 --max-restarts=1 --restore-tier=/dev/shm/kt-c17-tier > "$R/d_3b.log" 2>&1
echo "exit $?" | tee -a "$R/d_3b.log"
kill $CLEANER
grep -E "Injected fault|faulted in iteration|In-process restart|Loaded step|Finished loading|Restore tier|step: +(1|10|14|15|16|24|25|26|34|35|36|40) |Exiting|Traceback|Error" \
  "$R/d_3b.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240 | tee "$OUT/inprocess_3b.txt"
snap
echo "=== end $(date -u +%T)"
