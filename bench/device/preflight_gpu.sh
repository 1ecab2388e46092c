#!/bin/bash
# The pod's pre-flight gate (kubetitan_trainer.preflight, spec.runPolicy.preflight) for real on one H100, in one call:
#   1. the gate as a GPU pod's launcher starts it (`python -m kubetitan_trainer.preflight`, a process of its own) for a
#      pod of gpusPerNode 1 and gpuProduct H100: every row (GPU count and model, NVML's ECC / row-remapping state
#      through nvidia-ml-py (a trainer dependency; carried in .whl), the 8192-cube bf16 product against its exact result and its TF/s against the
#      H100 floor, the one-GPU NCCL all-reduce, EFA: none requested) and its wall time, twice (a cold and a warm
#      process start);
#   2. one failure injected (`--inject matmul_tflops`, tests only): exit code 8, the termination message, and what the
#      operator makes of it (kubetitan.decide.failure.classify_pod: cause PreflightFailed blaming the node; nodes_to_avoid:
#      the next attempt avoids it);
#   3. through the pod entry point (kubetitan_trainer.launch, the debug model on the GPU, 3 steps): the gate process
#      overlapping the launcher's imports, its rows in the log, and the start-up record's `preflight` phase and entry
#      (<dump>/kubetitan/startup.jsonl); then the same launcher with the failure injected: exit code 8, no worker.
# $OUT: preflight.txt (everything printed), pass.json, fail.json, startup.jsonl, launch_pass.log, launch_fail.log,
# env.txt.
# Usage (device tool, kind nvidia-h100-x1, carry [".whl"], timeout_s 420): bash bench/device/preflight_gpu.sh
# (on an H200: GPU_PRODUCT=H200 bash bench/device/preflight_gpu.sh)
export R=/tmp/r
source bench/device/setup.sh
cp "$R/env.txt" "$OUT/" 2>/dev/null
export KUBETITAN_NODE_NAME="${KUBETITAN_NODE_NAME:-$(hostname)}"
GPU_PRODUCT=${GPU_PRODUCT:-H100}  # H200 on an H200 machine
GATE="python3 -m kubetitan_trainer.preflight --gpus 1 --gpu-product $GPU_PRODUCT"
W=/tmp/preflight
mkdir -p "$W"
{
echo "=== $(date -u +%T) nvidia-ml-py: $(python3 -c 'import importlib.metadata as m; print(m.version("nvidia-ml-py"))' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,ecc.mode.current --format=csv
for run in cold warm; do
  echo "=== $(date -u +%T) 1. the gate ($run process start): $GATE"
  t0=$(date +%s.%N)
  $GATE
  rc=$?
  echo "exit code $rc; wall $(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')") s (interpreter, torch import, CUDA context, checks)"
done
$GATE --json > "$OUT/pass.json"

echo "=== $(date -u +%T) 2. one failure injected: $GATE --inject matmul_tflops"
$GATE --inject matmul_tflops --json > "$OUT/fail.json"
echo "exit code $? (8 = ExitCode.PREFLIGHT_FAILED)"
python3 - "$OUT/fail.json" <<'EOF'
import json, sys
from kubetitan.decide.failure import classify_pod, nodes_to_avoid
from kubetitan.observation import PodObs
from kubetitan_core.api import RestartRecord
from kubetitan_trainer.preflight import Result

r = Result.from_dict(json.load(open(sys.argv[1])))
for row in r.rows:
    print("  " + row.line())
msg = r.termination_message()
print("termination message:", msg)
f = classify_pod(PodObs(name="run-a0-0", attempt=0, rank=0, phase="Failed", exit_code=8, node_name=r.node,
                        termination_message=msg))
print(f"operator: cause {f.cause}, node {f.node_name}\n  record message: {f.message}")
print("next attempt avoids:", nodes_to_avoid([RestartRecord(attempt=0, cause=f.cause, time="-", node_name=f.node_name)]))
EOF

echo "=== $(date -u +%T) 3. through the launcher: the debug model on the GPU, 3 steps, gate on"
GPU_PRODUCT=$GPU_PRODUCT python3 - "$W" <<'EOF'
import os
import sys
from pathlib import Path

import tomli_w
import yaml

from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain

w = Path(sys.argv[1])
doc = yaml.safe_load(Path("examples/debug-cpu.yaml").read_text())
s = doc["spec"]
s["training"].update(steps=3, warmupSteps=1)
s["parallelism"] = {"dataParallelShardDegree": -1}
s["precision"] = {"compile": False, "activationCheckpointing": "none"}
s["data"] = {"source": "synthetic"}
s["checkpoint"] = {"enabled": False}
s["runPolicy"] = {"maxRestarts": 0}
s["resources"] = {"nodes": 1, "gpusPerNode": 1, "gpuProduct": os.environ["GPU_PRODUCT"]}
lpt = LlamaPretrain.model_validate(doc)
for case, inject in (("pass", ""), ("fail", "matmul_tflops")):
    cfg = render.trainer_config(lpt, dump_folder=str(w / case))
    cfg["kubetitan"]["metrics_port"] = 0
    if inject:
        cfg["kubetitan"].setdefault("preflight", {})["inject"] = inject  # tests only
    (w / f"{case}.toml").write_text(tomli_w.dumps(cfg))
    print(f"{case}: [kubetitan.preflight] = {cfg['kubetitan'].get('preflight')}")
EOF
LAUNCH="python3 -m kubetitan_trainer.launch --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1 --max-restarts=0 --dns-timeout=5"
t0=$(date +%s.%N)
$LAUNCH --config="$W/pass.toml" > "$OUT/launch_pass.log" 2>&1
echo "launcher exit code $?; wall $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"
grep -a "Pre-flight\|Warm workers\|Start-up of" "$OUT/launch_pass.log" | cut -c1-600
cp "$W/pass/kubetitan/startup.jsonl" "$OUT/" 2>/dev/null && python3 -c "
import json; r = json.loads(open('$OUT/startup.jsonl').readline())
print('start-up record: preflight phase', r['phases']['preflight'], 's; gate', r['preflight']['status'], 'in',
      r['preflight']['seconds'], 's, waited', r['preflight']['waited'], 's')"
echo "=== $(date -u +%T) 3b. the same launcher, matmul_tflops injected failed"
t0=$(date +%s.%N)
$LAUNCH --config="$W/fail.toml" > "$OUT/launch_fail.log" 2>&1
echo "launcher exit code $? (8 expected, no worker started); wall $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"
grep -a "Pre-flight\|PreflightFailed\|Starting\|Exiting" "$OUT/launch_fail.log" | cut -c1-600
echo "=== $(date -u +%T) end, $SECONDS s"
} 2>&1 | tee "$OUT/preflight.txt"
