"""Does a new process benchmark Triton's kernel configurations again when an earlier process with the same cache
folders chose them already? One process per call: a block of a transformer's shape (RMSNorm, a projection, SiLU,
a product) in bf16 on the GPU, compiled either by ``torch.compile`` alone (``fx``: Inductor's FX graph cache on the
second run) or through kubetitan's AOT blocks (``aot``: the first run makes the artefact after its first step, later
runs are served from it), one forward and backward; every ``CachingAutotuner.benchmark_all_configs`` call is counted
with its kernel and seconds, during the step and during the artefact's making. Prints one JSON line.

    TORCHINDUCTOR_CACHE_DIR=C/inductor TRITON_CACHE_DIR=C/triton python bench/autotune_reuse.py fx|aot RUN

bench/device/autotune_reuse.sh runs each mode three times on one cache folder and counts the ``.best_config``
files Inductor leaves there (where it keeps the configurations it chose).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch
from torch._inductor.runtime import triton_heuristics

CALLS: list[dict] = []
_orig = triton_heuristics.CachingAutotuner.benchmark_all_configs


def _counted(self, *args, **kwargs):
    begin = time.perf_counter()
    try:
        return _orig(self, *args, **kwargs)
    finally:
        CALLS.append({"kernel": getattr(getattr(self, "fn", None), "__name__", "?"),
                      "file": os.path.basename(getattr(self, "filename", None) or ""),
                      "configs": len(getattr(self, "compile_results", []) or getattr(self, "launchers", [])),
                      "s": round(time.perf_counter() - begin, 4)})


triton_heuristics.CachingAutotuner.benchmark_all_configs = _counted


class Block(torch.nn.Module):
    def __init__(self, dim: int = 2048):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        return x + torch.nn.functional.silu(self.wq(self.norm(x))) * freqs_cis


def main(mode: str, run: str) -> None:
    from kubetitan_core.contract.trainer_toml import KubetitanRuntime
    from kubetitan_trainer import runtime
    from kubetitan_trainer.compile import aot_precompile

    torch.manual_seed(0)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleDict({str(i): Block() for i in range(2)}).cuda()
    for name, b in list(m.layers.named_children()):
        m.layers.register_module(name, torch.compile(b, fullgraph=True))
    summary = None
    if mode == "aot":
        runtime.use(KubetitanRuntime(aot_compile=True))
        aot_precompile.install(m, rank=0)
    x = torch.randn(2, 4096, 2048, device="cuda", requires_grad=True)
    freqs = torch.rand(4096, 2048, device="cuda")
    begin = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x
        for b in m.layers.values():
            h = b(h, freqs, None)
        h.float().square().mean().backward()
    torch.cuda.synchronize()
    step_s, in_step = time.perf_counter() - begin, len(CALLS)
    if mode == "aot":
        summary = aot_precompile.after_first_step()
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print(json.dumps({"mode": mode, "run": int(run), "step_s": round(step_s, 3), "benchmarked_in_step": CALLS[:in_step],
                      "benchmarked_after": CALLS[in_step:],
                      "best_config_files": len(glob.glob(f"{cache}/**/*.best_config", recursive=True)),
                      "aot": summary}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
