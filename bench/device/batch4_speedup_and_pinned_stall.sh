#!/bin/bash
# the >= 1.10x attempts on 3B FP8 tensorwise at batch 4 (plain path, so that
# only the model/loss differ), then the checkpoint stall with async_with_pinned_mem.
#   plain batch 4                       predicted 27,960 tok/s (+2.3% vs plain batch 3: per-step fixed costs amortised)
#   spec=rope   (real-valued RoPE)      predicted +2% vs plain batch 4 (the ~13 ms/2 samples of unfused complex kernels)
#   spec=rope + fp8out=1                predicted +3.5% vs rope (output projection GEMMs ~51 ms/2 samples -> FP8)
#   spec=fast (rope + fused loss, head gradient accumulated in the GEMM epilogue)  predicted +1% vs rope
#   ckpt=pinned at step 10              predicted stall < 3 s (43 GB at ~20 GB/s, after the pinned buffer exists)
source bench/device/setup.sh
python3 - <<'PY' 2>&1 | tee "$OUT/r/addmm_check.txt"
import torch  # the fused loss accumulates the head gradient with addmm(out_dtype=fp32, out=acc): check it here
a = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
c = torch.randn(512, 256, device="cuda"); ref = c + a.t().float() @ b.float()
torch.addmm(c, a.t(), b, out_dtype=torch.float32, out=c)
print("addmm(out_dtype=fp32, out=acc) relative error vs fp32 reference:", ((c - ref).norm() / ref.norm()).item())
PY
python3 bench/gpu_bench.py run --out "$OUT/r" --deadline 545 --case-timeout 140 --cases \
3B:fp8tw:4,3B:fp8tw:4:spec=rope,3B:fp8tw:4:spec=rope:fp8out=1,3B:fp8tw:2:steps=16:warmup=4:ckpt=pinned:ckint=10,3B:fp8tw:4:spec=fast
finish
