"""Hold a trainer test's run after chosen steps until the test lets it go: a mid-run action lands at a known step,
synchronised on an event instead of on a window of extra steps that the action must land in.

A launch of :func:`support.warm.popen` whose environment has :data:`ENV` (``<folder>:<step>,<step>...``, from
:func:`env`) gets :func:`install` run in its (forked, warm) launcher before the launcher's module runs, so every
worker it forks has it: after each of those steps (once its metrics, step record and heartbeat are out) each rank
writes ``held-<step>-<pid>`` in ``folder`` (its content: the path of the launcher's stop file, which SIGTERM creates:
:func:`stop_file`) and waits until ``go-<step>`` exists there (:func:`go`). A held rank's
``/metrics`` still answers and its launcher still handles signals; a step whose ``go`` file exists already (a
restarted generation training it again) is not held. Cold launches (``KUBETITAN_TEST_COLD_LAUNCH=1``) ignore it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

ENV = "KUBETITAN_TEST_HOLD"


def env(folder: Path, *steps: int) -> dict[str, str]:
    """The environment entry that holds a launch's workers after each of ``steps``."""
    folder.mkdir(parents=True, exist_ok=True)
    return {ENV: f"{folder}:{','.join(str(s) for s in steps)}"}


def wait_held(folder: Path, step: int, ranks: int, alive: Callable[[], bool], timeout: float = 400) -> None:
    """Wait until ``ranks`` workers are held after ``step``; AssertionError when ``alive()`` turns False first (the
    launch ended) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob(f"held-{step}-*"))) < ranks:
        assert alive(), f"the run ended before {ranks} ranks were held after step {step}"
        assert time.monotonic() < deadline, f"{ranks} ranks not held after step {step} within {timeout} s"
        time.sleep(0.05)


def stop_file(folder: Path, step: int) -> Path:
    """The stop file of the launcher whose workers are held after ``step`` (it exists once SIGTERM reached it)."""
    return Path(next(folder.glob(f"held-{step}-*")).read_text())


def stop_files(folder: Path, step: int) -> list[Path]:
    """The stop files of every launcher whose workers are held after ``step`` (one per pod of a gang)."""
    return sorted({Path(f.read_text()) for f in folder.glob(f"held-{step}-*")})


def go(folder: Path, step: int) -> None:
    """Let the ranks held after ``step`` go on (and any rank that trains ``step`` later pass it)."""
    (folder / f"go-{step}").touch()


def install() -> None:
    """In the launcher (run by tests/support/zygote.py when :data:`ENV` is set): wrap the trainer's step, now if
    the warm parent imported ``kubetitan_trainer.trainer`` already, else as soon as the launcher imports it."""
    import importlib.abc
    import sys

    folder, _, steps = os.environ[ENV].rpartition(":")
    at = {int(s) for s in steps.split(",") if s}

    def wrap(trainer_cls: type) -> None:
        from kubetitan_trainer import ENV_STOP_FILE

        step_once = trainer_cls.train_step

        def train_step(self, data_iterator):  # noqa: ANN001, ANN202 - torchtitan's signature
            step_once(self, data_iterator)
            gate = Path(folder) / f"go-{self.step}"
            if self.step in at and not gate.exists():
                (Path(folder) / f"held-{self.step}-{os.getpid()}").write_text(os.environ.get(ENV_STOP_FILE, ""))
                while not gate.exists():
                    time.sleep(0.02)

        trainer_cls.train_step = train_step

    class OnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's signature
            if name != "kubetitan_trainer.trainer":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):  # noqa: ANN001, ANN202
                run(module)
                wrap(module.KubetitanTrainer)

            spec.loader.exec_module = exec_module
            return spec

    import importlib.util

    if "kubetitan_trainer.trainer" in sys.modules:  # imported by the warm parent already (support/zygote.py)
        wrap(sys.modules["kubetitan_trainer.trainer"].KubetitanTrainer)
        return
    sys.meta_path.insert(0, OnImport())
