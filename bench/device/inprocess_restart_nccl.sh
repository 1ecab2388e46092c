#!/bin/bash
# in-process restart (kubetitan_trainer.recovery.inprocess) on NCCL, fault -> end of the
# next trained step, per phase (caught, process group torn down, ranks agreed, new process group, state reloaded from
# the restore tier, first step). NOT RUN YET: written without a device at hand.
#
# What it runs: bench/inprocess_bench.py on 2 GPUs of one host (kind nvidia-h200-x2), the gang of
# tests/support/gang.py (rank r on cuda:r, gradients all-reduced over NCCL, the restore tier every 2 steps):
#   a) dim 64 (a toy state: the mechanism's own cost): raise, non-finite loss, 5 runs each;
#   b) dim 16384 (268 M parameters per rank, 3.2 GB of fp32 weights + Adam state in the tier: the tier reload at a
#      size that matters), raise and non-finite loss, 3 runs each;
#   c) a hang (rank 1 sleeps in its step; rank 0's host waits on the all-reduce's kernel): detected by the
#      monitor's progress timeout (3 s), which aborts the NCCL communicators, 3 runs.
#   d) the 3B recipe (examples/llama3-3b-h200.yaml, bench/recovery_bench.py's build_lpt: 40 steps, checkpoint and
#      restore tier every 10) on GPU 0 through kubetitan_trainer.launch with [kubetitan] inprocess_restarts = 3 and an
#      exception injected at steps 15, 25 and 35: three in-process restarts, each from the tier's step 10/20/30, with
#      the compiled model kept. The lines that time them (fault, restart agreed, state loaded, first step) are
#      grepped into d_3b.txt; fault -> "step: N" is the number (target <= 2 s).
# NCCL's own watchdog must not end the process first (nvidia-resiliency-ext requires the same): async error
# handling off; the collective timeout (--timeout) stays above the progress timeout.
# Usage (device tool, kind nvidia-h200-x2, carry [".whl"]): bash bench/device/inprocess_restart_nccl.sh
export R=/tmp/r
source bench/device/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD/tests TORCH_NCCL_ASYNC_ERROR_HANDLING=0
nvidia-smi -L | tee "$R/gpus.txt"
B="python3 bench/inprocess_bench.py --backend nccl --world 2"
$B --repeats 5 --kinds raise,nan --dim 64 --timeout 30 --out "$R/a" 2>&1 | tee "$OUT/a_small.txt"; snap
$B --repeats 3 --kinds raise,nan --dim 16384 --timeout 30 --out "$R/b" 2>&1 | tee "$OUT/b_large.txt"; snap
$B --repeats 3 --kinds hang --dim 64 --timeout 30 --progress-timeout 3 --out "$R/c" 2>&1 | tee "$OUT/c_hang.txt"
snap
mkdir -p /tmp/inprocess-3b && rm -rf /tmp/inprocess-3b/* /dev/shm/kt-inprocess-3b-tier
python3 - <<'PY'
import sys, tomllib, tomli_w
from pathlib import Path
sys.path[:0] = ["bench"]
from recovery_bench import build_lpt
from kubetitan_trainer.local import free_port, write_config
lpt = build_lpt(Path("examples/llama3-3b-h200.yaml"), steps=40, interval=10, cpu=False)
config = write_config(lpt, Path("/tmp/inprocess-3b"), None, 0)
cfg = tomllib.loads(config.read_text())
cfg["kubetitan"]["inprocess_restarts"] = 3
config.write_text(tomli_w.dumps(cfg))
print(config)
PY
CUDA_VISIBLE_DEVICES=0 KUBETITAN_TEST_FAULT=0:15:raise,0:25:raise,0:35:raise timeout 540 python3 -m kubetitan_trainer.launch \
  --config=/tmp/inprocess-3b/trainer.toml --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=29517 \
  --rdzv-id=c17 --max-restarts=1 --restore-tier=/dev/shm/kt-c17-tier > "$R/d_3b.log" 2>&1
echo "exit $?" | tee -a "$R/d_3b.log"
grep -E "Injected fault|faulted in iteration|In-process restart|Loaded step|Finished loading|Restore tier|step: +(1|10|14|15|16|24|25|26|34|35|36|40) |Exiting|Traceback|Error" \
  "$R/d_3b.log" | cut -c1-220 | tee "$OUT/d_3b.txt"
snap
