"""A warm Python for the suite's own processes: `make test`'s xdist workers and the trainer tests' warm parents
(tests/support/zygote.py) are forks of one process that has imported torch, torchtitan, the operator and the
other libraries that every one of them imports (run as a script by tests/conftest.py, never imported).

Each xdist worker used to import them at collection (~6 of its ~10 CPU s of start-up: torch, torchao.float8,
torchtitan, hypothesis, the operator's kopf and kubernetes client), and each warm parent imported torch's again
(~4 CPU s): with five workers, ten interpreters importing the same modules at the start of the run on two cores.

tests/support/forkrun.py stands in for ``python ARGS``: it connects to this server's abstract
Unix socket (``KUBETITAN_FORKSERVER``), sends its standard streams (their file descriptors), arguments,
environment and working directory, and waits for the fork's exit status, which it exits with (a signal that ends
the fork ends it the same way; SIGTERM, SIGINT, SIGHUP and SIGQUIT it receives are passed on, and a wrapper that
ends first, killed, takes the fork with it). The fork becomes what ``python ARGS`` would be: ``-c CODE``, ``-m
MODULE`` or ``SCRIPT``, ``-u`` and ``-B`` honoured, a ``__main__`` of its own.
Each server serves one set of the variables read at import (``forkrun.IMPORT_TIME_ENV``, which
``support.warm`` uses too): tests/conftest.py starts one with pytest's environment (the workers) and one
with the trainer launches' ``OMP_NUM_THREADS=1`` (the warm parents); a request whose variables differ finds no
server, or is answered ``cold``, and the wrapper runs the real interpreter.

Protocol over the socket: in, one JSON line ``{"argv", "env", "cwd"}`` with fds 0, 1, 2 attached; out
``{"pid"}`` (or ``{"cold": true}``), then ``{"returncode"}`` when the fork ends (negative: the signal).
The server ends at EOF on its stdin (the pytest process that started it ended).
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import os
import select
import signal
import socket
import sys
import time
import types

from forkrun import (ENV_LOG, at_import, exit_as_python, log_fork_cpu,  # this script's folder is still sys.path[0]
                     server_name)

HERE = os.path.dirname(os.path.abspath(__file__))

PRELOAD = (
    # the trainer's launcher (tests/support/zygote.py's PRELOAD)
    "torch", "torch.distributed", "torch.distributed.run", "torch.distributed.checkpoint",
    "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.nn.attention.flex_attention", "torch._dynamo", "torch._inductor.compile_fx", "functorch.compile",
    "torch.utils.tensorboard", "datasets", "tyro", "numpy",
    # what the test modules import at collection (python -X importtime -m pytest -s --collect-only tests)
    "torchao.float8", "torchtitan.components.loss", "torchtitan.models.llama3.model.args", "hypothesis", "celpy",
    "kubetitan.runner", "kubetitan.cli", "kubetitan.apidoc", "kubetitan.monitoring.alerts",
    "kubetitan.monitoring.dashboards", "kubetitan_trainer.train_spec", "kubetitan_trainer.trainer",
    "kubetitan_trainer.launch.launcher", "kubetitan_trainer.storage", "kubetitan_trainer.data.prepare",
    "kubetitan_trainer.local", "pydantic", "psutil", "requests", "cryptography.x509", "yaml", "pytest",
)
"""Libraries only: nothing under tests/ (pytest rewrites the asserts of test modules and conftest files as it imports
them) and no pytest plugin (pytest marks them for rewriting too)."""

TRAINER_PRELOAD = PRELOAD[:15]
"""What the server for the trainer launches' environment (``OMP_NUM_THREADS=1``) imports: only the warm parents are
forked from it."""


def _streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr anew on fds 0, 1, 2, as the interpreter makes them at start-up."""
    enc = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=enc)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            stream = io.TextIOWrapper(raw, encoding=enc, errors="backslashreplace" if fd == 2 else "strict",
                                      write_through=True)
        else:
            stream = io.TextIOWrapper(io.BufferedWriter(raw), encoding=enc,
                                      errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=fd == 2 or raw.isatty())
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


@contextlib.contextmanager
def _quiet():
    """fds 1 and 2 on /dev/null meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _child(req: dict, fds: list[int], closing: list[int]) -> None:
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
    for fd in closing:
        os.close(fd)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = list(req["argv"])
    unbuffered = False
    while argv and argv[0].startswith("-") and argv[0] not in ("-c", "-m"):
        opt = argv.pop(0)
        if opt == "-u":
            unbuffered = True
        elif opt == "-B":
            sys.dont_write_bytecode = True
    _streams(unbuffered)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main

    def run() -> None:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - what `python -c` does
        elif argv[0] == "-m":  # what `python -m` does: the module runs as __main__ only, the working directory first
            import runpy

            if not hasattr(sys.modules.get(argv[1]), "__path__"):  # a package runs its __main__: nothing to drop
                sys.modules.pop(argv[1], None)  # imported here already: a later import makes a copy, as it would
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            import runpy

            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            sys.modules["__main__"] = main
            runpy.run_path(argv[0], run_name="__main__")

    exit_as_python(run)


def _send(conn: socket.socket, msg: dict) -> None:
    with contextlib.suppress(OSError):  # the wrapper is gone (killed): nobody to tell
        conn.sendall((json.dumps(msg) + "\n").encode())


def _listen(name: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    return listener


def main() -> None:
    """``forkserver.py PREFIX all|trainer|none``: serve forks for this environment's import-time variables; prints
    ``ready`` once its imports are done (``none``: no imports, for tests/test_layout.py's checks of the protocol)."""
    prefix, preload = sys.argv[1], {"all": PRELOAD, "trainer": TRAINER_PRELOAD, "none": ()}[sys.argv[2]]
    sys.argv = ["-c"]  # what torchtitan binds as ConfigManager.parse_args' default at import: an xdist worker's
    sys.path[0] = ""  # as `python -c` (not this script's folder: tests/support would shadow top-level names)
    before = dict(os.environ)
    # bound before the imports: a wrapper that connects meanwhile waits, not runs cold
    listeners = [_listen(server_name(prefix, before))]  # one: a list for select
    gc.disable()
    for mod in preload:
        importlib.import_module(mod)
    if preload is TRAINER_PRELOAD:  # the warm parent's own warm-up (the trainer, tyro's first parse), once
        spec = importlib.util.spec_from_file_location("_kubetitan_zygote", os.path.join(HERE, "zygote.py"))
        zygote = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(zygote)
        with _quiet():  # torchtitan's warning about the example's tokenizer path: nobody's business here
            zygote._warm_trainer()
    gc.enable()
    gc.freeze()
    # what the imports set (forkrun.SET_BY_IMPORTS): a fork gets it as a cold start's imports would set it, and a
    # request that has it already is served where the value is the same
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    after = at_import(dict(os.environ))
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    started: dict[int, tuple[float, list[str], str]] = {}  # pid -> (start, argv, the test that asked): ENV_LOG's
    orphans: set[int] = set()  # children whose wrapper ended
    print("ready", flush=True)
    sys.stderr.flush()
    while True:
        watched = {conn: pid for pid, conn in children.items() if pid not in orphans}
        ready, _, _ = select.select([0, wakeup[0], *listeners, *watched], [], [])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)
        for conn in set(ready) & set(watched):  # the wrapper sends nothing more: readable means it ended
            orphans.add(watched[conn])  # (killed, say by a test's time-out: SIGKILL is not passed on): end it too
            with contextlib.suppress(ProcessLookupError):
                os.kill(watched[conn], signal.SIGKILL)
        if 0 in ready and not os.read(0, 4096):  # the pytest process ended
            return
        for listener in set(ready) & set(listeners):
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            while not msg.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    break
                msg += more
            req = json.loads(msg)
            env = {**set_by_imports, **req["env"]}
            if len(fds) != 3 or at_import(env) != after:
                if os.environ.get(ENV_LOG):  # a file: which variables sent it to a cold start
                    with open(os.environ[ENV_LOG], "a") as log:
                        print(f"forkserver: cold {req['argv'][:2]}: {sorted(set(at_import(env).items()) ^ set(after.items()))}",
                              file=log)
                _send(conn, {"cold": True})
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                _child({**req, "env": env}, fds, [*(x.fileno() for x in listeners), conn.fileno(), *wakeup,
                                                   *(c.fileno() for c in children.values())])
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            started[pid] = (time.monotonic(), req["argv"], req["env"].get("PYTEST_CURRENT_TEST", ""))
            _send(conn, {"pid": pid})
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            log_fork_cpu(usage, *started.pop(pid, (time.monotonic(), [], "")), parent="server")
            conn = children.pop(pid, None)
            orphans.discard(pid)
            if conn is not None:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()


if __name__ == "__main__":
    main()
