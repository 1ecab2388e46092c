#!/bin/bash
# Device call 17 (issue 29, item 4): in-process restart (kubetitan_trainer.inprocess) on NCCL, fault -> end of the
# next trained step, per phase (caught, process group torn down, ranks agreed, new process group, state reloaded from
# the restore tier, first step). NOT RUN YET: written in a session without a device.
#
# What it runs: bench/inprocess_bench.py on 2 GPUs of one host (kind nvidia-h200-x2), the gang of
# tests/support/gang.py (rank r on cuda:r, gradients all-reduced over NCCL, the restore tier every 2 steps):
#   a) dim 64 (a toy state: the mechanism's own cost): raise, non-finite loss, 5 runs each;
#   b) dim 16384 (268 M parameters per rank, 3.2 GB of fp32 weights + Adam state in the tier: the tier reload at a
#      size that matters), raise and non-finite loss, 3 runs each;
#   c) a hang (rank 1 sleeps in its step; rank 0's host waits on the all-reduce's kernel): detected by the
#      monitor's progress timeout (3 s), which aborts the NCCL communicators, 3 runs.
# The 3B recipe itself (examples/llama3-3b-h200.yaml through kubetitan_trainer.launch) is not measured here: the
# torchtitan trainer does not run its loop under kubetitan_trainer.inprocess yet (docs/reliability.md, "In-process
# restart"). When it does, add a fourth part that runs the recipe with KUBETITAN_TEST_FAULT=1:12:raise.
# NCCL's own watchdog must not end the process first (nvidia-resiliency-ext requires the same): async error
# handling off; the collective timeout (--timeout) stays above the progress timeout.
# Usage (device tool, kind nvidia-h200-x2, carry [".whl"]): bash bench/device/call17.sh
export R=/tmp/r
source bench/device/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD/tests TORCH_NCCL_ASYNC_ERROR_HANDLING=0
nvidia-smi -L | tee "$R/gpus.txt"
B="python3 bench/inprocess_bench.py --backend nccl --world 2"
$B --repeats 5 --kinds raise,nan --dim 64 --timeout 30 --out "$R/a" 2>&1 | tee "$OUT/a_small.txt"; snap
$B --repeats 3 --kinds raise,nan --dim 16384 --timeout 30 --out "$R/b" 2>&1 | tee "$OUT/b_large.txt"; snap
$B --repeats 3 --kinds hang --dim 64 --timeout 30 --progress-timeout 3 --out "$R/c" 2>&1 | tee "$OUT/c_hang.txt"
snap
