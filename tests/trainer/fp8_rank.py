"""One rank of tests/trainer/test_fp8_all_gather.py, run as ``python -m tests.trainer.fp8_rank CONFIG OUT`` (forked
from the tests' warm parent, :func:`support.warm.popen`, with torchrun's rank variables: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...): builds the real trainer (FSDP2 over the gloo group of the ranks) and runs one forward pass,
recording what FSDP2 puts into its all-gathers and what goes over the wire, into ``OUT/rank<r>.json``."""

import json
import os
import sys

import torch

cfg, out = sys.argv[1], sys.argv[2]
sys.argv = ["kubetitan_trainer.main", "--job.config_file", cfg]  # before torchtitan binds its default argv
from kubetitan_trainer import cpu_bridge  # noqa: E402 - after sys.argv

cpu_bridge.apply()
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp._fully_shard._fsdp_collectives as C  # noqa: E402

from kubetitan_trainer.main import load_config  # noqa: E402
from kubetitan_trainer.trainer import KubetitanTrainer  # noqa: E402

inputs, wire = {}, []
get_inputs = C._get_param_all_gather_inputs


def record_inputs(fsdp_params):
    got = get_inputs(fsdp_params)
    for p, ts in zip(fsdp_params, got):
        inputs[p._param_fqn] = [str(t.dtype) for t in ts]
    return got


C._get_param_all_gather_inputs = record_inputs
gather = dist.all_gather_into_tensor


def record_wire(output_tensor, input_tensor, *a, **k):
    wire.append(str(input_tensor.dtype))
    return gather(output_tensor, input_tensor, *a, **k)


dist.all_gather_into_tensor = record_wire

trainer = KubetitanTrainer(load_config(sys.argv[1:]))
model = trainer.model_parts[0]
local = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
linears = sorted(n + ".weight" for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
with torch.no_grad():
    model(torch.randint(0, 500, (1, 16)))
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"local": local, "inputs": inputs, "wire": wire, "float8_linears": linears}, f)
dist.destroy_process_group()
from kubetitan_trainer.main import exit_now  # noqa: E402

exit_now(0)  # as a trainer process ends: the interpreter's teardown sometimes aborted here (exit -6, make test s13)
