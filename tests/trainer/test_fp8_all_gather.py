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
from pathlib import Path

import pytest

from kmockx.harness import free_port

from support import warm
from support.paths import REPO
from support.specs import tiny_lpt, write_config


def _observe(tmp_path: Path, all_gather: bool) -> dict:
    obj = tiny_lpt({"training": {"steps": 1, "seqLen": 16, "localBatchSize": 1},
               "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "bfloat16",
                             "float8": {"enabled": True, "recipe": "tensorwise", "emulate": True,
                                        "fsdpFloat8AllGather": all_gather}},
               "data": {"source": "synthetic"}, "checkpoint": {"enabled": False}})
    cfg = write_config(tmp_path / "t.toml", obj, tmp_path / "dump", {"kubetitan": {"metrics_port": 0}})
    # the two ranks as torchrun would start them (its rank variables), each forked from the tests' warm parent
    # (tests/support/warm.py: torch imported once per test process) and running tests/trainer/fp8_rank.py
    port, logs = free_port(), [tmp_path / f"rank{i}.log" for i in (0, 1)]
    procs = [warm.popen("tests.trainer.fp8_rank", [str(cfg), str(tmp_path)],
                        {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(i), "LOCAL_RANK": str(i), "GROUP_RANK": "0",
                         "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                        logs[i], cwd=REPO) for i in (0, 1)]
    codes = warm.wait_all(procs, timeout=600)
    for code, log in zip(codes, logs):
        out = log.read_text(errors="replace")
        fatal = out.find("Fatal Python error")  # a C++ abort: its first lines name the thread and the frame
        assert code == 0, (out[fatal:fatal + 3000] + "\n...\n" if fatal >= 0 else "") + out[-4000:]
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
