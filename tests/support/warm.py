"""Launch ``python -m MODULE`` for a trainer test, forked from a warm parent that has imported torch already.

Every launch of the trainer's launcher used to import torch and what torchtitan imports from it (Inductor, FSDP,
the datasets library, ...): about 4 CPU seconds of each launch, ~25 launches in the trainer tests and one per pod of
every e2e gang start. One warm parent per test process (``tests/support/zygote.py``) imports them once; each
:func:`popen` is a fork of it that runs the module with the given arguments, environment, working directory, log,
session and (e2e pods) mount and UTS namespace, as the command line would, and returns a handle with the
``subprocess.Popen`` methods the tests use (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
``returncode``).

What the tests still exercise: the launcher's whole ``main`` (torchrun's agent, its own warm-up and forks of the
workers, signals, exit codes) and the workers. What they share with the warm parent: torch's import, the trainer's
(torchtitan, kubetitan_trainer, the spec model) and tyro's first parse of a job config (``zygote._warm_trainer``).
What they do not exercise: a cold interpreter's imports. That is covered by the tests that start the launcher otherwise
(``kubetitan run`` in tests/trainer/test_local_run.py, tests/monitoring/test_live_prometheus.py, test_units' bad
config launches, the e2e pods that run as another user), and by ``KUBETITAN_TEST_COLD_LAUNCH=1``, which makes
:func:`popen` start every launch cold. A launch whose environment differs in what is read at import
(:data:`IMPORT_TIME_ENV`: ``OMP_*``, ``TORCH*``, ``PYTHON*``, ``HF_*``, ...) is forked from a warm parent of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from support import forkrun
from support.paths import REPO

ZYGOTE = Path(__file__).with_name("zygote.py")
FORKRUN = Path(__file__).with_name("forkrun.py")
IMPORT_TIME_ENV, RUNTIME_ENV = forkrun.IMPORT_TIME_ENV, forkrun.RUNTIME_ENV
"""Variables read when torch (or a library it loads) is imported (or the interpreter starts), and the exceptions
read only when used: a launch is forked from a warm parent started with the same values (``forkrun`` says which)."""
ENV_COLD = "KUBETITAN_TEST_COLD_LAUNCH"


class WarmProcess:
    """A child of the warm parent: the ``subprocess.Popen`` methods the trainer tests use."""

    def __init__(self, zygote: "_Zygote", pid: int) -> None:
        self._z, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._z.cond:
            while self.returncode is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"warm launch {self.pid}", timeout)
                self._z.cond.wait(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        argv = [sys.executable, str(ZYGOTE)]
        if os.environ.get(forkrun.ENV):  # make test: a fork of the warm Python for this environment, where one serves it
            argv = [sys.executable, "-S", str(FORKRUN), str(ZYGOTE)]
            env = {**env, **{k: os.environ[k] for k in (forkrun.ENV, forkrun.ENV_LOG) if k in os.environ}}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO)
        self.cond = threading.Condition()
        self.ids = itertools.count()
        self.started: dict[int, WarmProcess] = {}
        self.forked: dict[int, WarmProcess] = {}  # request id -> its child
        self.ready = False
        threading.Thread(target=self._read, name="warm-launch-reader", daemon=True).start()
        with self.cond:
            if not self.cond.wait_for(lambda: self.ready or self.proc.poll() is not None, 600) or not self.ready:
                raise RuntimeError(f"the warm parent {ZYGOTE} did not start (exit {self.proc.poll()})")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if msg.get("ready"):
                    self.ready = True
                elif "id" in msg:
                    self.forked[msg["id"]] = self.started[msg["pid"]] = WarmProcess(self, msg["pid"])
                else:
                    p = self.started.pop(msg["pid"], None)
                    if p is not None:
                        p.returncode = msg["returncode"]
                self.cond.notify_all()
        with self.cond:  # the warm parent is gone: its children were reparented, nobody will report them
            self.ready = False
            self.cond.notify_all()

    def start(self, module: str, args: list[str], env: dict[str, str], cwd: Path, log: Path,
              new_session: bool, namespaces: tuple[Path, str] | None) -> WarmProcess:
        rid = next(self.ids)
        req = {"id": rid, "module": module, "args": list(args), "env": env, "cwd": str(cwd), "log": str(log),
               "new_session": new_session, "namespaces": [str(namespaces[0]), namespaces[1]] if namespaces else None}
        with self.cond:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: rid in self.forked or not self.ready, 60) or rid not in self.forked:
                raise RuntimeError(f"the warm parent did not fork the launch (exit {self.proc.poll()})")
            return self.forked.pop(rid)


def wait_all(procs: list[WarmProcess | subprocess.Popen], timeout: float, ok: tuple[int, ...] = (0,)) -> list[int]:
    """Wait for every process of a gang started by :func:`popen`: their exit codes, in order. The first one to end
    with a code not in ``ok`` ends the others (SIGKILL): a rank whose peer failed would otherwise wait in a
    collective until its own time-out. ``subprocess.TimeoutExpired`` (after killing them all) when they outlive
    ``timeout``."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        left = deadline - time.monotonic()
        parents = {p._z for p in pending if isinstance(p, WarmProcess)}
        one = next(iter(parents)) if len(parents) == 1 and all(isinstance(p, WarmProcess) for p in pending) else None
        if one is not None:  # woken by the warm parent's report of any of its children's end
            with one.cond:
                one.cond.wait_for(lambda: any(p.returncode is not None for p in pending), max(left, 0))
        else:  # cold launches, or children of several warm parents: look again at least every half second
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: the checks below decide
                pending[0].wait(min(max(left, 0), 0.5))
        ended = [p for p in pending if p.poll() is not None]
        if any(p.returncode not in ok for p in ended) or (not ended and time.monotonic() >= deadline):
            for p in procs:
                p.kill()
            for p in procs:
                p.wait(30)
            if not ended:
                raise subprocess.TimeoutExpired(f"gang of {len(procs)} launches", timeout)
            break
        pending = [p for p in pending if p.poll() is None]
    return [p.returncode for p in procs]


def run_code(code: str, where: Path, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str]:
    """A probe script that would be ``python -c code``: forked from the warm parent instead of a cold interpreter (no
    second import of torch), written to and logged in ``where``. Its exit code and its output (stdout and stderr,
    interleaved)."""
    fd, script = tempfile.mkstemp(prefix="probe-", suffix=".py", dir=where)
    with os.fdopen(fd, "w") as f:
        f.write(code)
    log = Path(script).with_suffix(".log")
    proc = popen("tests.support.run_code", [script], dict(os.environ if env is None else env), log)
    returncode = wait_all([proc], timeout)[0]
    return returncode, log.read_text(errors="replace")


def last_json(output: str) -> Any:
    """The last line of ``output`` that is a JSON value (what a probe prints last; warnings may follow it)."""
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    raise AssertionError("no JSON line in the probe's output:\n" + output[-3000:])


_zygotes: dict[frozenset, _Zygote] = {}
_lock = threading.Lock()


@atexit.register
def _stop_zygotes() -> None:
    """End the warm parents with the test process and wait for them (their children's CPU time is then counted in
    this process's, as a cold launch's is)."""
    for z in list(_zygotes.values()):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # gone already, or stuck: the test run ends
            if z.proc.stdin is not None:
                z.proc.stdin.close()
            z.proc.wait(10)


def _at_import(env: dict[str, str]) -> frozenset:
    """The part of ``env`` that torch (or a library it loads) reads when it is imported."""
    return frozenset(forkrun.at_import(env).items())


def popen(module: str, args: list[str], env: dict[str, str], log: Path, cwd: Path = REPO, new_session: bool = False,
          namespaces: tuple[Path, str] | None = None) -> WarmProcess | subprocess.Popen:
    """``python -m module *args`` with ``env`` in ``cwd``, its output appended to ``log``: forked from the warm
    parent for ``env``'s import-time variables (one per distinct set, started at its first launch), or started
    cold with ``KUBETITAN_TEST_COLD_LAUNCH=1``. ``namespaces=(hosts, hostname)``: in a mount and UTS namespace of
    its own, ``hosts`` bound over /etc/hosts and the hostname set (what ``unshare --mount --uts`` and the e2e
    kubelet's script do)."""
    if os.environ.get(ENV_COLD) == "1":
        argv = [sys.executable, "-m", module, *args]
        if namespaces is not None:
            script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
            argv = ["unshare", "--mount", "--uts", "--", "sh", "-c", script, "kubelet", str(namespaces[0]),
                    namespaces[1], *argv]
        with open(log, "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=cwd, start_new_session=new_session)
    key = _at_import(env)
    with _lock:
        z = _zygotes.get(key)
        if z is None or z.proc.poll() is not None:
            z = _zygotes[key] = _Zygote(dict(key | {("PATH", os.environ.get("PATH", ""))}))
    return z.start(module, args, env, cwd, log, new_session, namespaces)
