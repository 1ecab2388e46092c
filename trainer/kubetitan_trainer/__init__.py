"""kubetitan's training runtime: torchtitan 0.2.2's own Trainer, extended through its extension points.

- ``job_config``: the ``[kubetitan]`` table (torch-free), merged via ``job.custom_config_module``
- ``train_spec``: the ``kubetitan_llama3`` TrainSpec (flavours, data, tokenizer, metrics); ``flavours``: its
  model args, which ``checks``, ``data`` and ``tokenizer`` read without the TrainSpec
- ``trainer``: a thin Trainer subclass (stop/non-finite checks at step boundaries, goodput state)
- ``main``: the worker entry point; ``launch``: the pod entry point (torchrun in-process)
- ``local``: ``kubetitan run``; ``data.prepare``: ``kubetitan prepare-data``
- ``cpu_bridge``: the four places torchtitan assumes CUDA, bridged only without a GPU
- subpackages by concern: ``launch`` (the pod's launcher), ``recovery`` (restore tier, staging, in-process restart,
  heartbeats, start-up anatomy), ``compile`` (compile cache, AOT), ``data`` (sources, loaders, shards, preparation)
"""

from pathlib import Path

BUILTIN_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer"
"""The shipped tokenizer's folder (``spec.tokenizer.source: builtin``), read by ``tokenizer``, ``checks`` and
``prepare`` (which does not import torch)."""

ALREADY_COMPLETE = "The run is already complete at step"
"""How the trainer's log says that it resumed at ``training.steps`` (nothing to train); ``local`` shows that line."""


def already_complete(step: int, steps: int) -> str:
    """What a run with nothing left to train says: the trainer's log, and ``kubetitan run`` before it starts one."""
    return (f"{ALREADY_COMPLETE} {step} (training.steps is {steps}): nothing to train. To train further, raise "
            "spec.training.steps (or --steps); to train again from scratch, use a new run name or output directory")

ENV_STOP_FILE = "KUBETITAN_STOP_FILE"
"""Set by the launcher for its workers: the file whose existence asks them to checkpoint and stop."""
