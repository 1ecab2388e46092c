"""torchtitan 0.2.2's own Llama 3 TrainSpec, plus 1B/3B flavours and synthetic tokens, for the GPU bench.

Loaded by plain ``python -m torchtitan.train`` through ``--experimental.custom_import gpu_plain_spec``
(``bench/`` on ``PYTHONPATH``). It depends on torchtitan only (not on kubetitan), so that "plain
torchtitan" in ``bench/gpu_bench.py`` means torchtitan's own model, parallelize, loss, optimizer and
train loop; only what 0.2.2 lacks is added here:

- ``1B`` / ``3B`` flavours: Llama 3.2 dims (``operator/core/kubetitan_core/catalog.py`` FLAVOURS; a CPU test checks
  they agree) with rope scaling factor 32 as in kubetitan's TrainSpec. torchtitan's Transformer
  unties embedding and output: 1.50 B / 3.61 B parameters.
- ``gpubench_synthetic``: synthetic tokens that cost ~nothing to make and that a model can learn
  (so "loss first -> last" means something): each sample is a concatenation of phrases of
  ``PHRASE_LEN`` tokens drawn from a fixed table of ``N_PHRASES`` random phrases (seeded). The
  loss can fall from ln(vocab) ~ 11.8 towards ~ ln(N_PHRASES) / PHRASE_LEN ~ 0.5.

Registered TrainSpecs:
- ``llama3_gpubench``: torchtitan's llama3 TrainSpec with the above (the "plain torchtitan" runs).
- ``llama3_gpubench_fast``: the same with ``fast_components`` (bench/fast_components.py) (real-valued RoPE,
  fused chunked linear + cross-entropy), registered only when that package imports.
- ``llama3_gpubench_rope``: the real-valued RoPE alone (torchtitan's output projection and loss).
- ``llama3_gpubench_ktdata``: ``llama3_gpubench`` fed kubetitan's ``synthetic`` source
  (``kubetitan_trainer.data``) instead of the phrases above: torchtitan's model, loss, optimizer and
  loop on the very tokens a kubetitan run with the same seed sees (the loss-parity runs).
"""

from __future__ import annotations

import atexit
import dataclasses
import os

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.protocols import train_spec as ts

SPEC_NAME = "llama3_gpubench"
FAST_SPEC_NAME = "llama3_gpubench_fast"
ROPE_SPEC_NAME = "llama3_gpubench_rope"
KTDATA_SPEC_NAME = "llama3_gpubench_ktdata"
N_PHRASES = 4096
PHRASE_LEN = 16

# name -> (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, rope_theta)
LLAMA32_DIMS = {
    "1B": (2048, 16, 32, 8, 1.5, 256, 500000.0),
    "3B": (3072, 28, 24, 8, 1.0, 256, 500000.0),
}


def llama32_args(name: str) -> TransformerModelArgs:
    dim, n_layers, n_heads, n_kv_heads, ffn, multiple_of, theta = LLAMA32_DIMS[name]
    return TransformerModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim_multiplier=ffn,
        multiple_of=multiple_of, rope_theta=theta, vocab_size=128256,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0),
    )


def model_args() -> dict[str, TransformerModelArgs]:
    args = dict(llama3_args)
    args.update({name: llama32_args(name) for name in LLAMA32_DIMS})
    return args


class PhraseTokens(IterableDataset):
    """Sample i = N_PHRASES-phrase table rows drawn by a generator seeded with (seed, rank, i)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, dp_rank: int = 0) -> None:
        self.seq_len, self.seed, self.dp_rank = seq_len, seed, dp_rank
        rng = np.random.default_rng([seed, 0xB5])
        self.table = rng.integers(0, vocab_size, size=(N_PHRASES, PHRASE_LEN), dtype=np.int64)
        self.idx = 0

    def sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.dp_rank, i])
        n = (self.seq_len + 1 + PHRASE_LEN - 1) // PHRASE_LEN
        return self.table[rng.integers(0, N_PHRASES, size=n)].reshape(-1)[: self.seq_len + 1]

    def __iter__(self):
        while True:
            x = torch.from_numpy(self.sample(self.idx))
            self.idx += 1
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self):
        return {"idx": self.idx}

    def load_state_dict(self, sd):
        self.idx = int(sd["idx"])


def build_synthetic_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    from torchtitan.protocols.train_spec import get_train_spec

    vocab = get_train_spec(job_config.model.name).model_args[job_config.model.flavor].vocab_size
    seed = job_config.debug.seed or 0
    ds = PhraseTokens(vocab, job_config.training.seq_len, seed=seed, dp_rank=dp_rank)
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=job_config.training.local_batch_size)


def _print_peak_memory() -> None:
    # torchtitan prints max *reserved* per step; the bench also wants the allocator's max *allocated*.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        print(f"GPUBENCH peak_allocated_gib={torch.cuda.max_memory_allocated() / 2**30:.2f} "
              f"peak_reserved_gib={torch.cuda.max_memory_reserved() / 2**30:.2f}", flush=True)


class ProfilingMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor; with ``GPUBENCH_PROFILE_AFTER=N`` it profiles steps N+1..N+2.

    The profile is printed as a table of the CUDA kernels by total time (no trace file), so that
    one bench run both times the steps and shows where a step's time goes. Steps after N are
    slowed by the profiler and the bench excludes them from the timings.
    """

    _prof = None

    def log(self, step, *args, **kwargs):
        super().log(step, *args, **kwargs)
        after = int(os.environ.get("GPUBENCH_PROFILE_AFTER", "0") or 0)
        if not after:
            return
        if step == after:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
        elif step == after + 2 and self._prof is not None:
            torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            table = self._prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90)
            print("GPUBENCH_PROFILE_BEGIN (2 steps)\n" + table + "\nGPUBENCH_PROFILE_END", flush=True)
            self._prof = None


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    if torch.cuda.is_available():
        return ProfilingMetricsProcessor(job_config, parallel_dims, tag)
    # CPU (the bench's own CPU tests only): kubetitan's CPU bridge for torchtitan's memory monitor.
    import torchtitan.components.metrics as metrics_mod
    from kubetitan_trainer.cpu_bridge import CpuMemoryMonitor

    orig, metrics_mod.build_device_memory_monitor = metrics_mod.build_device_memory_monitor, CpuMemoryMonitor
    try:
        return ProfilingMetricsProcessor(job_config, parallel_dims, tag)
    finally:
        metrics_mod.build_device_memory_monitor = orig


def build_spec(base=None):
    base = base or llama3_train_spec()
    return dataclasses.replace(
        base, model_args=model_args(), build_dataloader_fn=build_synthetic_dataloader,
        build_tokenizer_fn=None, build_validator_fn=None, build_metrics_processor_fn=build_metrics_processor,
    )


def register() -> None:
    if not torch.cuda.is_available():  # the bench's CPU tests: torchtitan assumes CUDA (DESIGN.md)
        from kubetitan_trainer import cpu_bridge

        cpu_bridge.apply()
    if SPEC_NAME not in ts._extra_train_specs:
        ts.register_train_spec(SPEC_NAME, build_spec())
        atexit.register(_print_peak_memory)
    if KTDATA_SPEC_NAME not in ts._extra_train_specs:
        from kubetitan_trainer.data.loaders import build_dataloader as kubetitan_dataloader

        ts.register_train_spec(KTDATA_SPEC_NAME, dataclasses.replace(build_spec(), build_dataloader_fn=kubetitan_dataloader))
    if FAST_SPEC_NAME not in ts._extra_train_specs and os.environ.get("GPUBENCH_NO_FAST") != "1":
        try:
            from fast_components import fast_train_spec  # bench/fast_components.py
        except ImportError:
            return
        ts.register_train_spec(FAST_SPEC_NAME, fast_train_spec(build_spec()))
        ts.register_train_spec(ROPE_SPEC_NAME, fast_train_spec(build_spec(), fused_loss=False))


register()
