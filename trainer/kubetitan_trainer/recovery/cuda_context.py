"""Create the worker's CUDA context on a side thread as the worker starts (part of a recovery in under 5 s).

A worker's first CUDA allocation creates its context: ~0.4 s on the H200 machine (bench/teardown_probe.py), inside
the start-up anatomy's ``model_init``, on the training thread, after the config check, the process group and the
model's build on the meta device, none of which need the GPU. :func:`start` retains the device's primary context
(the one the CUDA runtime, and so torch, uses) through the driver API from a thread of its own, as ``main()``
begins: ``ctypes`` lets go of the GIL during each driver call, so the training thread's Python work runs meanwhile,
and torch's own initialisation later finds the context made (the driver serialises the two if they meet).

The device is ``LOCAL_RANK``'s, the one torchtitan's trainer selects (``cuda:<LOCAL_RANK>`` within
``CUDA_VISIBLE_DEVICES``). Nothing happens unless ``[kubetitan.runtime] early_cuda_context`` is on
(``spec.runtime.earlyCudaContext``; opt-in: no gain measured yet), without the driver library (CPU nodes, CI), or when the driver answers an error (logged; torch then meets
the same error its own way). The seconds the side thread took go into the start-up record
(:mod:`kubetitan_trainer.recovery.anatomy`, ``cuda_context``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubetitan_trainer import runtime

log = logging.getLogger(__name__)

SETTING = "spec.runtime.earlyCudaContext"
"""Where the switch is (``[kubetitan.runtime] early_cuda_context``): on, retain the CUDA context on a side thread at
the worker's start; off (the default), torch creates it on its first CUDA call. Opt-in: on an H100 the side thread
took 0.16-0.39 s, but the model init was 1.0-1.3 s with it and 0.8-1.2 s without, kill -> first step end no shorter
(docs/reliability.md)."""

DRIVER = "libcuda.so.1"
NO_DEVICE = 100
"""``CUDA_ERROR_NO_DEVICE``: the driver is installed but no GPU is visible (a CPU run): not worth a warning."""


def _driver() -> Any:
    return ctypes.CDLL(DRIVER)


class Early:
    """One side thread's retain of a device's primary context: :attr:`result` once it ended."""

    def __init__(self, driver: Any, ordinal: int) -> None:
        self.ordinal = ordinal
        self.result: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._retain, args=(driver,), daemon=True,
                                        name="kubetitan-cuda-context")
        self._thread.start()

    def _retain(self, driver: Any) -> None:
        begin = time.perf_counter()
        step, rc = "cuInit", driver.cuInit(0)
        if rc == 0:
            device = ctypes.c_int()
            step, rc = "cuDeviceGet", driver.cuDeviceGet(ctypes.byref(device), self.ordinal)
        if rc == 0:
            context = ctypes.c_void_p()  # retained for the life of the process, as torch's own use retains it
            step, rc = "cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
        self.result = {"seconds": round(time.perf_counter() - begin, 4), "device": self.ordinal, "rc": rc,
                       "failed_call": step if rc else None}

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the thread (``timeout`` seconds at most); its :attr:`result` (None while it still runs)."""
        self._thread.join(timeout)
        return self.result


def start(env: Mapping[str, str] | None = None, driver: Callable[[], Any] = _driver,
          on: bool | None = None) -> Early | None:
    """Retain ``LOCAL_RANK``'s primary context on a side thread; None when off (``on``, by default this process's
    ``early_cuda_context`` setting) or there is no driver library."""
    env = os.environ if env is None else env
    if not (runtime.settings().early_cuda_context if on is None else on):
        return None
    try:
        ordinal = int(env.get("LOCAL_RANK", "0") or 0)
    except ValueError:
        return None
    try:
        lib = driver()
    except OSError:  # no NVIDIA driver here: a CPU node
        return None
    return Early(lib, ordinal)


EARLY: Early | None = None
"""This process's early context (:func:`begin`)."""


def begin(env: Mapping[str, str] | None = None) -> Early | None:
    """:func:`start` once a process (an in-place restart keeps its context)."""
    global EARLY
    if EARLY is None:
        EARLY = start(env)
    return EARLY


def settled(timeout: float = 0.0) -> dict[str, Any] | None:
    """This process's early context's result, waiting ``timeout`` seconds at most for it (None when none was
    started, or it still runs); a driver error is logged once."""
    result = EARLY.wait(timeout) if EARLY is not None else None
    if result and result["rc"] not in (0, NO_DEVICE) and not result.get("logged"):
        result["logged"] = True
        log.warning("Creating the CUDA context early failed: %s returned CUDA error %s for device %s; torch creates "
                    "it on its first CUDA call instead (%s: false skips the early try)", result["failed_call"],
                    result["rc"], result["device"], SETTING)
    return result
