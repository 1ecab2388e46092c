"""Worker entry point: ``python -m kubetitan_trainer.main --job.config_file trainer.toml``.

torchrun (``kubetitan_trainer.launch``) starts one per rank. It applies the CPU bridges when
there is no GPU, registers the TrainSpec, checks the config (before any process group exists, so a
bad config ends every rank at once with exit 2), then runs torchtitan's own
``main(trainer_class)`` with :class:`~kubetitan_trainer.trainer.KubetitanTrainer`, and turns
the outcome into the documented exit code (``kubetitan_core.contract.ExitCode``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Iterator, NoReturn

from kubetitan_core.contract import ExitCode


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Import torch and torchtitan with the cyclic garbage collector off, then freeze what they created.

    Their imports create millions of long-lived objects and next to no garbage, yet each collection of the oldest
    generation walks all of them, during the imports and again at every collection while training; frozen objects
    (``gc.freeze``: the permanent generation) are skipped. A forked worker inherits the frozen state, which also
    keeps the launcher's pages shared. ``bench/process_overhead.py`` measures it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` after what a normal exit does for Python (non-daemon threads joined and the
    executors' exit hooks run, as ``Py_FinalizeEx`` starts; the atexit handlers; logging and the standard streams
    flushed), without the rest of the interpreter's teardown: its collections walked every object torch
    and torchtitan created (seconds of CPU a process, ``bench/process_overhead.py``), and C++ static destructors
    running beside torch's threads sometimes abort (``terminate called without an active exception``, exit -6 instead
    of the real code: seen at the end of test_ledger's DP-3 leg and of test_fp8_all_gather's ranks). A forked worker
    ends the same way (multiprocessing's ``os._exit``)."""
    gc.freeze()
    try:
        join_threads = getattr(threading, "_shutdown", None)  # CPython's own first step of a normal exit
        if join_threads is not None:
            join_threads()
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def load_config(argv: list[str]):
    """Parse ``argv`` with torchtitan's ConfigManager (kubetitan's table merged in)."""
    from torchtitan.config import ConfigManager

    import kubetitan_trainer.train_spec  # noqa: F401 - registers the TrainSpec

    return ConfigManager().parse_args(argv)


def parse_error_message(exc: BaseException) -> str:
    return f"config: cannot parse the trainer config: {exc}. Fix: render it again with `kubetitan render`"


def check_config(argv: list[str], world_size: int) -> int | None:
    """Parse and check the config (logging the field and the fix); an exit code on failure, None when fine."""
    import torch
    from torchtitan.tools.logging import logger

    from kubetitan_trainer.checks import check
    from kubetitan_trainer.errors import ConfigError

    try:
        config = load_config(argv)
    except (Exception, SystemExit) as e:  # tyro exits on bad values
        logger.error(parse_error_message(e))
        return ExitCode.CONFIG_ERROR
    try:
        check(config, world_size, torch.cuda.is_available())
    except ConfigError as e:
        logger.error(f"Config error: {e}")
        return ExitCode.CONFIG_ERROR
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from kubetitan_trainer.recovery import anatomy

    anatomy.begin()  # the start-up anatomy's "main" mark (kubetitan_trainer.recovery.anatomy)
    from kubetitan_trainer import runtime
    from kubetitan_trainer.recovery import cuda_context

    runtime.load(argv)  # [kubetitan.runtime]: read once, before anything it tunes
    cuda_context.begin()  # opt-in (spec.runtime.earlyCudaContext): the GPU's context made on a side thread
    with imports_without_gc():
        return _main(argv)


def _main(argv: list[str]) -> int:
    from kubetitan_trainer import cpu_bridge

    bridged = cpu_bridge.apply()
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    if bridged:
        logger.info("No GPU: applied kubetitan's CPU bridges (gloo, CPU memory monitor, plain-sum FSDP)")

    from kubetitan_trainer.errors import (ConfigError, NetworkNotEfaError, NonFiniteLossError, StorageFullError,
                                         TransientError)
    from kubetitan_trainer.recovery.inprocess import GangGaveUp

    code = check_config(argv, int(os.environ.get("WORLD_SIZE", "1")))
    if code is not None:
        return code

    import torch

    from kubetitan_trainer import compat, netcheck

    if torch.cuda.is_available():  # before NCCL exists: local rank 0 logs NCCL's INIT/NET lines to a file
        netcheck.prepare_env(os.environ, int(os.environ.get("LOCAL_RANK", "0")), tempfile.gettempdir())

    from torchtitan.train import main as torchtitan_main

    from kubetitan_trainer.trainer import KubetitanTrainer

    sys.argv = [sys.argv[0], *argv]  # torchtitan's main parses its parse_args' default, made argv here
    compat.bind_config_args(argv)
    gc.enable()  # the imports are done (imports_without_gc): what they made is frozen, training collects as usual
    gc.freeze()
    try:
        torchtitan_main(KubetitanTrainer)
    except ConfigError as e:
        logger.error(f"Config error: {e}")
        return ExitCode.CONFIG_ERROR
    except NonFiniteLossError as e:
        logger.error(str(e))
        return ExitCode.NON_FINITE_LOSS
    except StorageFullError as e:
        logger.error(str(e))
        return ExitCode.STORAGE_FULL
    except NetworkNotEfaError as e:
        logger.error(str(e))
        return ExitCode.NETWORK_NOT_EFA
    except TransientError as e:
        logger.error(str(e))
        return ExitCode.RETRYABLE
    except GangGaveUp as e:  # in-process restarts ended: the fault's exit code, for the launcher's path
        logger.error(str(e))
        return e.exit_code
    return int(KubetitanTrainer.exit_code)


if __name__ == "__main__":
    exit_now(main())
