"""The worker's environment read the same way everywhere: a whole number (``LOCAL_WORLD_SIZE``); a bad value is
warned about (naming the variable, the value and what happens instead) and the default is used. Also the CPUs a
process may run on, which several defaults are sized by. Tuning is not read from the environment: it is
``[kubetitan.runtime]`` (:mod:`kubetitan_trainer.runtime`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping


def whole_number(name: str, default: int, instead: str, log: logging.Logger,
                 env: Mapping[str, str] | None = None, minimum: int = 1) -> int:
    """``env[name]`` as a whole number (at least ``minimum``); unset: ``default``; not a number: ``default``, with a
    warning that says ``instead``."""
    raw = (os.environ if env is None else env).get(name, "")
    try:
        return max(minimum, int(raw)) if raw else default
    except ValueError:
        log.warning("%s=%r is not a whole number; %s", name, raw, instead)
        return default


def affinity_cpus() -> int:
    """CPUs this process may run on (``sched_getaffinity``; ``os.cpu_count`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
