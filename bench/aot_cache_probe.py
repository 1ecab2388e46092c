"""Warm start of compiled FP8 blocks with and without kubetitan_trainer.compile.aot_cache (does the cache serve a restart?).

Each run is a fresh process (as a restarted worker is): the debug Llama 3 model's blocks in FP8 (torchao,
tensorwise), each compiled with Inductor (fullgraph, as torchtitan does), one forward and backward. Per mode
(``plain``: torch 2.11 as shipped; ``enabled``: ``aot_cache.enable()`` first), every run shares one fresh cache
folder, so run 1 compiles cold and the later runs are warm. Printed per run: the first forward+backward's
seconds, torch's compile-time parts, the AOTAutograd cache's counters (hit / miss / bypass), and a checksum of
the loss and gradients, which must be equal across every run of both modes (a cache hit computes what a compile
computes).

    python bench/aot_cache_probe.py [--runs 3] [--device cpu|cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
import torch
mode, device = sys.argv[1], sys.argv[2]
if mode == "enabled":
    from kubetitan_trainer.compile import aot_cache
    aot_cache.enable()
import torch._dynamo.utils as dutils
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchtitan.models.llama3 import Transformer, llama3_args
torch.manual_seed(0)
with torch.device(device):
    model = Transformer(llama3_args["debugmodel"])
with torch.no_grad():
    model.init_weights()
convert_to_float8_training(model.layers, config=Float8LinearConfig())
for name, block in model.layers.named_children():
    model.layers.register_module(name, torch.compile(block, fullgraph=True))
x = torch.randint(0, model.model_args.vocab_size, (2, 128), device=device)
t0 = time.perf_counter()
loss = model(x).float().pow(2).mean()
loss.backward()
if device == "cuda":
    torch.cuda.synchronize()
first = time.perf_counter() - t0
grads = sum(float(p.grad.double().abs().sum()) for p in model.parameters() if p.grad is not None)
parts = {k: round(v, 3) for k, v in sorted(dutils.calculate_time_spent().items(), key=lambda kv: -kv[1])}
print(json.dumps({"first_fwd_bwd_s": round(first, 3), "loss": float(loss), "grad_abs_sum": grads,
                  "aot_autograd": dict(dutils.counters["aot_autograd"]), "compile_parts": parts}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "trainer"), str(REPO / "operator" / "core"),
                                         env.get("PYTHONPATH", "")])
    rows = []
    for mode in ("plain", "enabled"):
        with tempfile.TemporaryDirectory(prefix=f"aot-probe-{mode}-") as cache:
            env.update(TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton")
            for run in range(1, a.runs + 1):
                p = subprocess.run([sys.executable, "-c", CHILD, mode, a.device], env=env, capture_output=True,
                                   text=True, timeout=900)
                if p.returncode != 0:
                    print(p.stderr[-3000:], file=sys.stderr)
                    return 1
                row = {"mode": mode, "run": run, **json.loads(p.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    same = len({(round(r["loss"], 6), round(r["grad_abs_sum"], 3)) for r in rows}) == 1
    print("\n| mode | run | first fwd+bwd s | AOTAutograd cache | backend_compile s |")
    print("|---|---|---|---|---|")
    for r in rows:
        cache = ", ".join(f"{k} {v}" for k, v in r["aot_autograd"].items() if k.startswith("autograd_cache"))
        print(f"| {r['mode']} | {r['run']} | {r['first_fwd_bwd_s']} | {cache} | "
              f"{r['compile_parts'].get('backend_compile', 0)} |")
    print(f"\nloss and gradients equal in every run: {same}")
    if a.out:
        a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
