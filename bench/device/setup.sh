# Sourced by every device script: carried wheels -> /tmp/site, kubetitan packages on PYTHONPATH, environment facts.
# Wheels: .whl/ (ignored via .git/info/exclude), made as /work/.library/device/README.md says; see docs/benchmarks.md.
# DRY=1 (a script's CPU dry run on the development machine, e.g. loss_parity_real_text.sh): no wheels, the project's venv.
set -u
if [ "${DRY:-0}" = 1 ]; then
  export PYTHONPATH=$PWD/bench:$PWD/trainer:$PWD/operator:$PWD/operator/core
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/bench:$PWD/trainer:$PWD/operator:$PWD/operator/core  # kubetitan_core lives in operator/core
fi
export PYTHONUNBUFFERED=1 LOG_RANK=0
export USE_JAX=0 USE_TF=0  # datasets would import JAX (present on the device) in every process: seconds of start-up
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R="${R:-$OUT/r}"  # results folder; scripts with many files keep it outside $OUT (only 8 files come back) and tar it
mkdir -p "$R"
{ date -u; nvidia-smi; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  df -h / /tmp; free -g; nproc
  python3 -c 'import sys,torch,torchtitan,torchao; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print("torchtitan", torchtitan.__version__, "torchao", torchao.__version__)'
} > "$R/env.txt" 2>&1
finish() {  # logs into one archive (the call returns at most 8 files)
  snap; python3 bench/gpu_bench.py table "$R"
}
snap() {  # what has been measured so far, into $OUT (a call cut by its time limit still returns it)
  tar -C "$R" -czf "$OUT/logs.tgz.tmp" . 2>/dev/null && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"
  cp "$R/results.jsonl" "$OUT/" 2>/dev/null
}
ckpt_cleaner() {  # background: delete each complete checkpoint (it has .metadata) of the runs, for disk room
  ( while sleep 2; do for d in /tmp/gpubench/*/out/checkpoint/step-*; do
      [ -f "$d/.metadata" ] && rm -rf "$d" && echo "$(date -u +%T) deleted complete checkpoint $d"; done; done ) \
    > "$R/cleaner.txt" 2>&1 &
}
