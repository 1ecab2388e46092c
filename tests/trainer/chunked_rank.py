"""One rank of tests/trainer/test_chunked_loss.py, run as ``python -m tests.trainer.chunked_rank CONFIG OUT`` (forked
from the tests' warm parent with torchrun's rank variables): builds the real trainer (FSDP2 over the gloo group of the
ranks when there are two) and runs one forward and backward pass of torchtitan's step on a fixed batch, saving the
loss and every parameter's full gradient to ``OUT/rank<r>.pt``."""

import os
import sys

import torch

cfg, out = sys.argv[1], sys.argv[2]
sys.argv = ["kubetitan_trainer.main", "--job.config_file", cfg]  # before torchtitan binds its default argv
from kubetitan_trainer import cpu_bridge  # noqa: E402 - after sys.argv

cpu_bridge.apply()
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from kubetitan_trainer.main import exit_now, load_config  # noqa: E402
from kubetitan_trainer.trainer import KubetitanTrainer  # noqa: E402

trainer = KubetitanTrainer(load_config(sys.argv[1:]))
rank = dist.get_rank() if dist.is_initialized() else 0
g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, the same with and without chunks
vocab = trainer.model_parts[0].output.weight.shape[0]
tokens = torch.randint(0, vocab, (2, 17), generator=g)
labels = tokens[:, 1:].clone()
labels[0, :3] = -100  # ignored positions, as a document boundary leaves them
valid = torch.tensor(float((labels != -100).sum()))
if dist.is_initialized():
    dist.all_reduce(valid)
loss = trainer.forward_backward_step(input_dict={"input": tokens[:, :-1]}, labels=labels, global_valid_tokens=valid)
grads = {}
for name, p in trainer.model_parts[0].named_parameters():
    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    grads[name] = grad.detach().float().clone()
with torch.no_grad():
    out_shape = list(trainer.model_parts[0](tokens[:, :-1]).shape)
torch.save({"loss": float(loss.detach()), "grads": grads, "output_shape": out_shape}, os.path.join(out, f"rank{rank}.pt"))
if dist.is_initialized():
    dist.destroy_process_group()
exit_now(0)
