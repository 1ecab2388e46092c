"""The ``kubetitan_llama3`` TrainSpec: torchtitan's Llama 3 plus kubetitan's flavours, data and metrics.

One change to the training core: with compile on and the output projection in FP8
(``precision.float8.filterFqns`` without ``output``), the final norm and the output projection are
compiled too (:func:`compile_fp8_head`). torchtitan 0.2.2 compiles only the transformer blocks, so an
FP8 head runs torchao's casts eagerly, through float32 temporaries of the logits' size (out of
memory at 3B, batch 4, on an H200; docs/benchmarks.md).

Registered at import through ``torchtitan.protocols.train_spec.register_train_spec``. The worker
entry point imports this module; plain torchtitan runs load it with
``--experimental.custom_import kubetitan_trainer.train_spec``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from torchtitan.config import JobConfig
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec
from torchtitan.tools.logging import logger

from kubetitan_core.render import TRAIN_SPEC_NAME

from kubetitan_trainer import compat, cpu_bridge, runtime
from kubetitan_trainer.data.loaders import build_dataloader
from kubetitan_trainer.data.tokenizer import build_tokenizer
from kubetitan_trainer.doc_mask import DocumentMaskedTransformer
from kubetitan_trainer.evaluation import build_validator
from kubetitan_trainer.flavours import model_args
from kubetitan_trainer.metrics import build_metrics_processor
from kubetitan_trainer.source_loss import build_loss


def compile_fp8_head(model: torch.nn.Module, job_config: JobConfig) -> bool:
    """Compile the final norm and the output projection when the projection is an FP8 linear.

    Only their ``forward`` is compiled (hooks such as FSDP's stay eager) and the modules stay in
    place, so parameter names and checkpoints do not change. Inductor then fuses torchao's amax,
    scale and cast of the logits' gradient into two kernels with FP8 outputs, instead of the eager
    ``abs``/``float()``/``clamp`` passes over a float32 copy of the logits. Returns whether it did.
    """
    c = job_config.compile
    if not (c.enable and "model" in c.components):
        return False
    from torchao.float8.float8_linear import Float8Linear

    head = getattr(model, "output", None)
    if not isinstance(head, Float8Linear):
        return False
    for module in (getattr(model, "norm", None), head):
        if module is not None:
            module.forward = torch.compile(module.forward, backend=c.backend, fullgraph=True)
    logger.info("Compiling the final norm and the FP8 output projection with torch.compile")
    return True


def wrap_parallelize(parallelize_fn: Callable) -> Callable:
    """torchtitan's parallelize (with the CPU bridge), then :func:`compile_fp8_head`. With compile on and
    ``[kubetitan.runtime] aot_compile`` (``spec.runtime.aotCompile``; off by default), the AOTAutograd cache is made
    to serve the recipe's graphs first (:mod:`kubetitan_trainer.compile.aot_cache`: it marks functions in torch's
    ``unsafe_marked_cacheable_functions``, where a wrong key would be a silently wrong graph), reductions keep the
    block size they were compiled with (:func:`kubetitan_trainer.compat.fix_reduction_blocks`: the recipe's block
    reductions are no longer benchmarked again in every restarted worker) and the compiled blocks get their
    ahead-of-time artefact (:mod:`kubetitan_trainer.compile.aot_precompile`); off, neither module is even
    imported."""
    parallelize_fn = cpu_bridge.wrap_parallelize(parallelize_fn)

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config, *args, **kwargs):
        aot = job_config.compile.enable and runtime.settings().aot_compile
        if aot:
            from kubetitan_trainer.compile import aot_cache

            aot_cache.enable()  # before anything is compiled: restarts then load the joint graphs from the cache
            compat.fix_reduction_blocks()  # reductions keep their compiled block: not benchmarked again per process
        model = parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)
        compile_fp8_head(model, job_config)
        if aot and "model" in job_config.compile.components and parallel_dims.pp_enabled:
            # torchtitan parallelises each pipeline stage's model part on its own: the blocks of one rank are not
            # one model's, and every rank must vote with all of its blocks (aot_precompile.after_first_step)
            logger.info("AOT precompile: not with pipeline parallelism; the blocks compile as usual")
        elif aot and "model" in job_config.compile.components:
            from kubetitan_trainer.compile import aot_precompile

            aot_precompile.install(model)
        return model

    return parallelize


def build_train_spec() -> TrainSpec:
    base = llama3_train_spec()
    return dataclasses.replace(
        base,
        model_cls=DocumentMaskedTransformer,
        model_args=model_args(),
        build_loss_fn=build_loss,
        parallelize_fn=wrap_parallelize(base.parallelize_fn),
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_metrics_processor_fn=build_metrics_processor,
        build_validator_fn=build_validator,
    )


def register() -> None:
    """Register the TrainSpec once (torchtitan rejects duplicates)."""
    if not compat.train_spec_registered(TRAIN_SPEC_NAME):
        register_train_spec(TRAIN_SPEC_NAME, build_train_spec())


register()
