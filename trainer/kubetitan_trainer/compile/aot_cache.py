"""Let torch's AOTAutograd cache serve the recipe's compiled graphs (a warm start without
compilation).

With a warm compile cache, a new worker process still traces every compiled region with Dynamo, then asks the
AOTAutograd cache for the joint forward/backward graph. torch 2.11 refuses to cache a graph that calls any
function outside its allow-list, and the recipe's blocks call several, so the cache is bypassed and every
restart traces and partitions the joint graph again (on this project's CPU probe, 1.5-2 s of a debug block's
warm start; on the GPU the compile-time parts in the start-up record, :mod:`kubetitan_trainer.recovery.anatomy`, show it):

- torch's own SDPA backend selection, which torchtitan's attention enters around every call
  (``sdpa_kernel(..., set_priority=True)``): ``torch.nn.attention._sdpa_kernel`` and ``_backend_from_string``;
- torchao's float8 config tuples and dataclasses, built in the graph (:data:`TORCHAO_PURE`);
- torchao's float8 ``autograd.Function`` s, allowed in the graph: Dynamo calls each through a fresh closure,
  which can be neither allow-listed nor pickled into a key (:func:`kubetitan_trainer.compat.name_autograd_trampolines`
  gives each a stable, importable name in this module).

:func:`enable` marks them all cacheable, each keyed by the versions of the package that defines it (so an
upgrade of torch or torchao makes new keys; the compile cache's folder is keyed by both too,
:mod:`kubetitan_trainer.compile.compile_cache`); a Function's key also holds a hash of its class's source, so an edited
Function (an editable or development install under the same version) makes a new key. All of them are traced
into the cached joint graph (AOTAutograd runs them while it traces: the SDPA backend chosen, the configs' values,
the Functions' forward and backward), which is why their versions, and a Function's source, are in the key; the
arguments they are called with are part of the traced graph that the key hashes. Torchao's float8 Functions get their stand-ins when
:func:`enable` runs (when torchao's float8 modules are loaded), so the cache keys do not depend on the order in
which regions compile; another allowed-in-graph Function gets one when Dynamo first meets it. Called by kubetitan's
TrainSpec before it compiles anything (:func:`kubetitan_trainer.train_spec.wrap_parallelize`), and only with
``[kubetitan.runtime] aot_compile`` on (``spec.runtime.aotCompile``, off by default): a key that missed a change would
serve a silently wrong graph, so this stays opt-in until shown safe; off, this module is never imported.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from importlib import metadata

from kubetitan_trainer import compat

TORCH_PURE = ("torch.nn.attention._backend_from_string", "torch.nn.attention._sdpa_kernel")
"""torch functions in the recipe's graphs that the AOTAutograd cache does not allow-list."""

TORCHAO_PURE = (
    "torchao.float8.float8_training_tensor.ScaledMMConfig",
    "torchao.float8.float8_training_tensor.LinearMMConfig",
    "torchao.float8.config.CastConfig",
    "torchao.float8.config.Float8GemmConfig",
    "torchao.float8.config.Float8LinearConfig",
)
"""torchao's float8 configuration classes, constructed inside the recipe's graphs."""


TORCHAO_FUNCTION_MODULES = (
    "torchao.float8.float8_training_tensor",
    "torchao.float8.float8_scaling_utils",
    "torchao.float8.float8_linear",
)
"""Modules whose allowed-in-graph ``autograd.Function`` s get their stand-ins up front (when already imported)."""


def _version(dist: str) -> str:
    try:
        return f"{dist} {metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return f"{dist} none"


def cacheable_names() -> dict[str, str]:
    """Every name :func:`enable` marks up front -> the version string in its cache key."""
    torch_v, torchao_v = _version("torch"), f"{_version('torch')}, {_version('torchao')}"
    return {**{n: torch_v for n in TORCH_PURE}, **{n: torchao_v for n in TORCHAO_PURE}}


def function_key(fn_cls: type) -> str:
    """The key part of an ``autograd.Function`` 's stand-in: torch's version, its package's (the distribution named
    as its top-level module: "none" where they differ; ``packages_distributions`` would cost ~0.3 s of every worker's
    start), its source's hash."""
    top = fn_cls.__module__.split(".")[0]
    try:
        source = hashlib.sha256(inspect.getsource(fn_cls).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        source = "unknown"
    return ", ".join([_version("torch"), _version(top), f"source {source}"])


def _trampoline_named(name: str, fn_cls: type) -> None:
    compat.mark_cacheable({f"{__name__}.{name}": function_key(fn_cls)})


def enable() -> None:
    """Make the recipe's compiled graphs cacheable by the AOTAutograd cache (idempotent)."""
    import torch

    compat.mark_cacheable(cacheable_names())
    produce = compat.name_autograd_trampolines(sys.modules[__name__], _trampoline_named)
    for mod in TORCHAO_FUNCTION_MODULES:
        module = sys.modules.get(mod)
        for obj in vars(module).values() if module is not None else ():
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function) and obj.__module__ == mod:
                produce(obj)
