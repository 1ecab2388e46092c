"""What FSDP2 really all-gathers with torchao's FP8 all-gather on and off (CPU, 2 gloo ranks).

Each rank builds the real trainer (``KubetitanTrainer``: torchtitan's model, kubetitan's TrainSpec, torchao's
float8 converter in emulation mode, torchtitan's ``parallelize_llama`` with FSDP2), then runs one forward pass
while FSDP2's own all-gather path is observed at two points inside torch (2.11):

- ``_get_param_all_gather_inputs``: the per-parameter tensors FSDP2 puts into the all-gather (for a sharded
  parameter whose local tensor has ``fsdp_pre_all_gather``, what that hook returned);
- ``AllGather.__call__`` / ``dist.all_gather_into_tensor``: the flat buffer that really goes over the wire
  (``uint8`` when the inputs' dtypes are mixed: FSDP2 views each input as bytes).

On: every ``Float8Linear`` weight's local shard is torchao's ``WeightWithDynamicFloat8CastTensor`` and it is
all-gathered as ``float8_e4m3fn`` (1 byte per element, the norms and embeddings stay bf16), so the wire buffer is
bytes. Off: the same weights are plain tensors all-gathered as bf16. This all runs on CPU: torchao's cast to
float8 and FSDP2's byte-view all-gather work there; only the FP8 matmul is emulated (``emulate = true``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kmockx.harness import free_port

from support.specs import tiny_lpt as lpt, write_config

PY = sys.executable

RANK = r"""
import json, os, sys
import torch
cfg, out = sys.argv[1], sys.argv[2]
sys.argv = ["kubetitan_trainer.main", "--job.config_file", cfg]
from kubetitan_trainer import cpu_bridge
cpu_bridge.apply()
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_collectives as C
from kubetitan_trainer.main import load_config
from kubetitan_trainer.trainer import KubetitanTrainer

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
json.dump({"local": local, "inputs": inputs, "wire": wire, "float8_linears": linears},
          open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w"))
dist.destroy_process_group()
from kubetitan_trainer.main import exit_now
exit_now(0)  # as a trainer process ends: the interpreter's teardown sometimes aborted here (exit -6, make test s13)
"""


def _observe(tmp_path: Path, all_gather: bool) -> dict:
    obj = lpt({"training": {"steps": 1, "seqLen": 16, "localBatchSize": 1},
               "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "bfloat16",
                             "float8": {"enabled": True, "recipe": "tensorwise", "emulate": True,
                                        "fsdpFloat8AllGather": all_gather}},
               "data": {"source": "synthetic"}, "checkpoint": {"enabled": False}})
    cfg = write_config(tmp_path / "t.toml", obj, tmp_path / "dump", {"kubetitan": {"metrics_port": 0}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([PY, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--no-python",
                        PY, "-c", RANK, str(cfg), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    fatal = out.find("Fatal Python error")  # a C++ abort: its first lines name the thread and the frame
    assert r.returncode == 0, (out[fatal:fatal + 3000] + "\n...\n" if fatal >= 0 else "") + out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0] == ranks[1]  # both ranks gather the same things
    return ranks[0]


@pytest.mark.parametrize("all_gather", [True, False], ids=["fp8-all-gather-on", "fp8-all-gather-off"])
def test_fsdp_all_gathers_float8_weights_only_when_fp8_all_gather_is_on(tmp_path, all_gather):
    seen = _observe(tmp_path, all_gather)
    linears = seen["float8_linears"]
    assert len(linears) >= 7  # wq wk wv wo w1 w2 w3 of each block (the output projection is filtered out)
    for name in linears:
        want_type, want_dtype = (("WeightWithDynamicFloat8CastTensor", "torch.float8_e4m3fn") if all_gather
                                 else ("Tensor", "torch.bfloat16"))
        assert seen["local"][name] == want_type, name
        assert seen["inputs"][name] == [want_dtype], name
    others = [n for n in seen["inputs"] if n not in linears]
    assert others and all(seen["inputs"][n] == ["torch.bfloat16"] for n in others)  # norms, embeddings, output
    # What goes over the wire: one all-gather per FSDP group (the embeddings, each transformer block, the final
    # norm with the output projection). On: a block's float8 weights next to its bf16 norms make FSDP2 send bytes
    # (uint8), one buffer per block; the groups without float8 weights stay bf16. Off: bf16 throughout.
    blocks = {n.split(".")[1] for n in linears}
    wire = seen["wire"]
    assert len(wire) > len(blocks) and wire.count("torch.uint8") == (len(blocks) if all_gather else 0), wire
    assert set(wire) - {"torch.uint8"} == {"torch.bfloat16"}, wire
