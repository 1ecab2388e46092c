"""One rank of tests/trainer/test_aot_precompile.py's multi-rank case, run as ``python -m tests.trainer.aot_rank OUT``
(forked from the tests' warm parent, :func:`support.warm.popen`, with torchrun's rank variables: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and ``TORCHINDUCTOR_CACHE_DIR``.

As torchtitan's ``parallelize_llama`` does, each transformer-like block is compiled (``fullgraph``) and then sharded
by FSDP2 over the gloo group of the ranks, with bf16 parameters for compute; then kubetitan's
:func:`kubetitan_trainer.compile.aot_precompile.install`, one training step (forward, backward), the trainer's
``after_first_step`` and two ``step_ended`` calls. Writes ``OUT/rank<r>.json``: the start-up summary, the Dynamo
graphs traced during the step, the step's output and gradients (to compare two launches).
"""

import json
import os
import sys

import torch
import torch._inductor.cpu_vec_isa as cpu_vec_isa
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kubetitan_core.contract.trainer_toml import KubetitanRuntime
from kubetitan_trainer import compat, runtime
from kubetitan_trainer.compile import aot_precompile


class Block(torch.nn.Module):
    """A transformer block's signature (a default argument too) and a few of its parts (also the single-process
    probe's, tests/trainer/test_aot_precompile.py)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(16)
        self.wq = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        if positions is not None:
            x = x + positions
        return x + torch.nn.functional.silu(self.wq(self.norm(x))) * freqs_cis


def main() -> None:
    out = sys.argv[1]
    runtime.use(KubetitanRuntime(aot_compile=True))  # [kubetitan.runtime] aot_compile = true
    cpu_vec_isa.valid_vec_isa_list = list  # scalar C++ kernels: no per-process gcc probes of the CPU (~9 s each)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): Block() for i in range(2)})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, block in list(model.layers.named_children()):  # torchtitan: apply_compile, then apply_fsdp
        block = torch.compile(block, fullgraph=True)
        fully_shard(block, mp_policy=mp, reshard_after_forward=True)
        model.layers.register_module(name, block)
    fully_shard(model, mp_policy=mp)
    p = aot_precompile.install(model)

    freqs = torch.rand(8, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1 + rank)).bfloat16().requires_grad_()
    before = compat.compile_counts().get("stats.unique_graphs", 0)
    h = x
    for block in model.layers.values():
        h = block(h, freqs, None)
    h.float().square().mean().backward()
    traced = compat.compile_counts().get("stats.unique_graphs", 0) - before
    grad = model.layers["0"].wq.weight.grad.full_tensor()  # reduced over the ranks (a DTensor's shards gathered)
    summary = aot_precompile.after_first_step()
    aot_precompile.step_ended()
    aot_precompile.step_ended()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"summary": summary, "traced": traced, "device": p[0].device if p else None,
                   "out": h.detach().float().flatten().tolist(), "x_grad": x.grad.float().flatten().tolist(),
                   "w_grad": grad.float().flatten().tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
