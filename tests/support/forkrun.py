"""``python forkrun.py ARGS`` is ``python ARGS`` run as a fork of the suite's warm Python (tests/support/forkserver.py,
whose docstring says what the fork shares and the protocol), or the real interpreter where no server answers
(``KUBETITAN_FORKSERVER`` unset, no server for this environment's import-time variables, the server gone) or the
server says ``cold``. Run with ``-S``: no site import, so
this stand-in costs a few milliseconds. Standard library only."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "PYTHON", "LD_", "HOME", "XDG_",
                   "HF_", "TMPDIR", "LANG", "LC_")
"""Variables read when torch (or a library it loads) is imported or the interpreter
starts. A fork is served only by the server started with the same values (:func:`server_name`)."""
RUNTIME_ENV = ("TORCH_NCCL_", "PYTHONUNBUFFERED", "PYTORCH_NVML_BASED_CUDA_CHECK")
"""Exceptions: read when used (a process group's construction; ``torch.cuda.is_available()``, whose NVML check the
trainer's launcher turns on in its own environment, so an in-process test of the launcher leaves it in the test
process's), or applied by the fork itself (``-u``'s streams)."""


def at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(RUNTIME_ENV)}


SET_BY_IMPORTS = ("TORCHINDUCTOR_CACHE_DIR",)
"""Set by the imports themselves where unset (Inductor's cache folder): a process that imported them has it (an
xdist worker, and so the launches it starts), the server has it only once its imports are done. Not in the name;
the server compares the whole environment when it is asked."""


def server_name(prefix: str, env: dict) -> str:
    """The abstract socket of the server for ``env``'s import-time variables."""
    key = sorted((k, v) for k, v in at_import(env).items() if k not in SET_BY_IMPORTS)
    return prefix + "-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


ENV = "KUBETITAN_FORKSERVER"
"""The servers' socket prefix (set by :func:`start_servers` for everything the tests start)."""
ENV_OFF = "KUBETITAN_TEST_NO_FORKSERVER"
"""``1``: no servers; every xdist worker and warm parent starts as its own interpreter, as before."""
ENV_LOG = "KUBETITAN_FORKSERVER_LOG"
"""A file: what started cold, and which variables sent it there; and a line per fork the servers and the warm parents
reap, with its CPU (:func:`log_fork_cpu`, summed by bench/fork_cpu.py)."""
HERE = os.path.dirname(os.path.abspath(__file__))


def log_fork_cpu(usage, started: float, argv: list[str], test: str, parent: str) -> None:
    """Where :data:`ENV_LOG` names a file, append a reaped fork's line: ``wait4``'s CPU (user + system, its reaped
    children's included), its wall time, its first arguments, the test that asked (``PYTEST_CURRENT_TEST``) and who
    forked it (``server``, ``zygote``)."""
    if not os.environ.get(ENV_LOG):
        return
    line = {"cpu": round(usage.ru_utime + usage.ru_stime, 3), "sys": round(usage.ru_stime, 3),
            "wall": round(time.monotonic() - started, 3), "argv": [a[:200] for a in argv[:4]], "test": test[:300],
            "parent": parent}
    data = ("forkserver: cpu " + json.dumps(line) + "\n").encode()
    with contextlib.suppress(OSError):  # a diagnostic: a log that cannot be written never ends the server
        fd = os.open(os.environ[ENV_LOG], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write on an O_APPEND file: whole lines from every process that appends
        finally:
            os.close(fd)


_servers: list = []


def start_servers(tx: list) -> list:
    """The xdist controller's ``--tx`` specs (``-n N``: ``popen`` each) for workers forked from the warm Python.
    Starts tests/support/forkserver.py three times: pytest's environment (the workers), the trainer launches'
    ``OMP_NUM_THREADS=1`` (support.trainer.launch) and the e2e kubelet's pods' (``PYTHONNOUSERSITE=1`` too, from the
    operator's pod template): the warm parents of support.warm. The workers' server is waited for (the workers would
    wait for it anyway); the other two import meanwhile, before the first trainer test. With :data:`ENV_OFF` or a
    server that failed to start, ``tx`` unchanged."""
    import subprocess

    if os.environ.get(ENV_OFF) == "1":
        return tx
    os.environ[ENV] = f"kubetitan-forkserver-{os.getpid()}"
    server = os.path.join(HERE, "forkserver.py")
    for extra, preload in (({}, "all"), ({"OMP_NUM_THREADS": "1"}, "trainer"),
                           ({"OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}, "trainer")):
        _servers.append(subprocess.Popen([sys.executable, server, os.environ[ENV], preload], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env={**os.environ, **extra}))
        if preload == "all" and not _ready(_servers[0], READY_SECONDS):  # failed or stuck: cold workers
            _servers[0].kill()
            return tx
    return [f"popen//python={' '.join(python())}"] * len(tx)


READY_SECONDS = 180.0
"""How long the workers' server may take to import (~6 s on a quiet machine) before the workers start cold."""


def _ready(server, timeout: float) -> bool:
    """Whether ``server`` printed ``ready`` within ``timeout`` seconds."""
    import select

    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(b"\n") and (left := deadline - time.monotonic()) > 0:
        if not select.select([server.stdout], [], [], left)[0]:
            break
        more = os.read(server.stdout.fileno(), 64)
        if not more:  # it ended
            break
        got += more
    return got == b"ready\n"


def stop_servers() -> None:
    """EOF on each server's stdin ends it."""
    while _servers:
        server = _servers.pop()
        server.stdin.close()
        server.wait(30)


def python() -> list[str]:
    """The command a test runs where it would run ``sys.executable``: this wrapper (a fork of the suite's warm
    Python, ``-m MODULE`` included) when the suite's servers are up, else the interpreter itself. For the CLI's
    short runs (``kubetitan validate``, ``prepare-data``): a cold start costs ~0.3 CPU s of interpreter and imports
    each. Not for a process whose memory a test measures (a fork's resident set includes the server's pages)."""
    if os.environ.get(ENV):
        return [sys.executable, "-S", os.path.abspath(__file__)]
    return [sys.executable]


def _cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main() -> None:
    argv = sys.argv[1:]
    prefix = os.environ.get(ENV)
    if not prefix:
        _cold(argv)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + server_name(prefix, dict(os.environ)))
    except OSError:
        if os.environ.get(ENV_LOG):
            with open(os.environ[ENV_LOG], "a") as log:
                print(f"forkrun: no server for {argv[:2]} with {sorted(at_import(dict(os.environ)).items())}",
                      file=log)
        _cold(argv)
    msg = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
    socket.send_fds(s, [msg], [0, 1, 2])
    replies = s.makefile("rb")
    first = json.loads(replies.readline() or b'{"cold": true}')
    if first.get("cold"):
        s.close()
        _cold(argv)
    pid = first["pid"]

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    line = replies.readline()
    code = json.loads(line)["returncode"] if line else 1
    if code < 0:  # ended by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()


def exit_as_python(run: Callable[[], object]) -> None:  # never returns: os._exit
    """Run ``run`` as a program's main code in a forked child, then end the process as the interpreter would: the
    code of a ``SystemExit`` (a non-integer one printed, code 1), an uncaught exception's traceback and code 1; then
    threading's and atexit's shutdown, the streams flushed, and ``os._exit``, so that the child never returns into
    its server's code (the zygote's and the fork servers' children)."""
    import atexit
    import threading
    import traceback

    code = 0
    try:
        run()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what a normal exit does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing left to flush
            stream.flush()
    os._exit(code)
