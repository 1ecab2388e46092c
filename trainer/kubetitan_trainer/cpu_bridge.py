"""The four places torchtitan 0.2.2 assumes CUDA, bridged for CPU-only machines (gloo).

Applied only when ``torch.cuda.is_available()`` is False (``apply()`` is a no-op otherwise), from
the worker entry point before any training component is built. Where torchtitan offers an
extension point the bridge uses it; the two monkeypatches left are marked and explained.

1. **Device detection.** ``torchtitan.tools.utils`` evaluates
   ``torch._utils._get_available_device_type() or "cuda"`` at import time, and four modules copy
   the result with ``from torchtitan.tools.utils import device_type, device_module``. Without a GPU
   that is ``"cuda"``, so ``Trainer.__init__`` would call ``torch.cuda.set_device``. There is no
   hook for this: ``apply()`` rebinds the copies to ``"cpu"`` / ``torch.cpu`` (monkeypatch 1,
   ``compat.rebind_device_to_cpu``).
2. **Device memory monitor.** ``DeviceMemoryMonitor`` calls ``get_device_name``,
   ``get_device_properties`` and ``memory_stats`` that ``torch.cpu`` lacks. Extension point: the
   TrainSpec's ``build_metrics_processor_fn`` builds kubetitan's processor, which uses
   :class:`CpuMemoryMonitor` (peak resident set size from ``getrusage``) instead.
3. **``set_pg_timeouts``** (called by ``Trainer.train`` after step 1) runs
   ``barrier(device_ids=[...])``, which gloo rejects, then ``device_module.synchronize()``. No hook
   reaches inside ``Trainer.train``: ``apply()`` swaps ``torchtitan.distributed.utils.set_pg_timeouts``
   for a version with a plain barrier (monkeypatch 2, ``compat.replace_set_pg_timeouts``; ``train.py`` looks
   it up at call time).
4. **FSDP reduce-scatter.** torchtitan sets FSDP's ``gradient_divide_factor=1.0``, so FSDP
   reduce-scatters with NCCL's pre-multiplied sum, which gloo does not implement. Extension point:
   the TrainSpec's ``parallelize_fn`` is wrapped (:func:`wrap_parallelize`) to call
   ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (plain sum; torchtitan divides
   by the global token count itself, so the numbers are unchanged).
"""

from __future__ import annotations

import functools
import resource
import sys
from collections.abc import Callable
from datetime import timedelta

import torch

from kubetitan_trainer import compat

_applied = False


def needed() -> bool:
    """True on a machine without a usable CUDA device."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Apply bridges 1 and 3 when no GPU is present. Idempotent; returns whether it applied them."""
    global _applied
    if not needed():
        return False
    if _applied:
        return True
    # Monkeypatch 1: torchtitan resolved its device at import time to "cuda" (no hook exists).
    compat.rebind_device_to_cpu()
    # Monkeypatch 2: Trainer.train calls this by module attribute after step 1; gloo has no device_ids.
    compat.replace_set_pg_timeouts(_set_pg_timeouts_cpu)
    _applied = True
    return True


def _set_pg_timeouts_cpu(timeout: timedelta, parallel_dims) -> None:
    """``torchtitan.distributed.utils.set_pg_timeouts`` without CUDA: same barrier, then same timeouts."""
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        compat.set_pg_timeout(timeout, group)


def wrap_parallelize(parallelize_fn: Callable) -> Callable:
    """Bridge 4: after torchtitan's parallelize, make FSDP reduce with a plain sum on gloo."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config, *args, **kwargs):
        model = parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)
        if needed():
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


class CpuMemoryMonitor:
    """Bridge 2: the slice of ``DeviceMemoryMonitor`` that torchtitan uses, for host memory.

    ``max_reserved`` is the process's peak resident set size (``getrusage``); ``max_active`` is
    the same figure (the CPU allocator keeps no separate active/reserved statistics).
    """

    device_name = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.device_capacity = _host_memory_bytes()
        self.device_capacity_gib = self.device_capacity / 2**30

    def peak_bytes(self) -> int:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak = self.peak_bytes()
        gib, pct = peak / 2**30, 100 * peak / max(self.device_capacity, 1)
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """Peak RSS cannot be reset; it is the process's lifetime peak."""


def _host_memory_bytes() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
