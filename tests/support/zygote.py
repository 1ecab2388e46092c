"""The warm parent of the trainer tests' launches (run as a script by :mod:`support.warm`, never imported).

It imports what every launcher process imports from torch (torch, torch.distributed's launcher and checkpointing,
Inductor, FSDP, the datasets library, ...) once, with the collector off and frozen as ``kubetitan_trainer.main.
imports_without_gc`` does, and then forks one child per request read from stdin. Each child becomes what
``python -m MODULE ARGS`` in ``cwd`` with ``env`` and its output in ``log`` would be: its own session when asked,
stdin from /dev/null, stdout and stderr appended to the log, the module run by ``runpy`` as ``__main__``. It also
imports the launcher and the trainer (torchtitan, kubetitan_trainer, the spec model) and parses one trainer config,
so that tyro's first parse is not paid again by every launch (:func:`_warm_trainer`). Single-threaded: requests
and SIGCHLD (through a wakeup pipe) are multiplexed with select.
A request whose environment has ``KUBETITAN_TEST_HOLD`` gets ``tests/support/hold.py``'s step hold installed first.

Protocol, one JSON object a line: in ``{"id", "module", "args", "env", "cwd", "log", "new_session", "namespaces"}``
(``namespaces``: null, or ``[hosts file, hostname]`` for a mount and UTS namespace of its own); out
``{"ready": true}`` once, then ``{"id", "pid"}`` when a child is forked and ``{"pid", "returncode"}`` (negative: the
signal, as ``subprocess.Popen.returncode``) when it ends. EOF on stdin (the test process ended) ends the zygote.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import sys
import time

from forkrun import exit_as_python, log_fork_cpu  # this script's folder is sys.path[0] at its start

PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.run", "torch.distributed.checkpoint",
    "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.nn.attention.flex_attention", "torch._dynamo", "torch._inductor.compile_fx", "functorch.compile",
    "torch.utils.tensorboard", "datasets", "tyro", "numpy",
)
"""torch and the libraries torchtitan imports (about 80% of a launcher's import time:
bench/results/suite/process_overhead_s13_quiet.txt)."""

WARM_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "debug-cpu.yaml")
"""The spec whose trainer config :func:`_warm_trainer` parses once."""


def _warm_trainer() -> None:
    """Import the launcher, the trainer and the spec model, and parse one trainer config with torchtitan's
    ``ConfigManager`` (tyro), so every child starts with them: after torch, a launch spent ~0.4 CPU s building the
    spec model's pydantic classes (``kubetitan_core.contract.launcher`` imports them for its defaults) and ~0.9 s in
    tyro's first parse of the job config (a second parse in the same process takes ~0.1 s). Nothing here reads the
    request's environment. torchtitan binds ``sys.argv`` as ``ConfigManager.parse_args``' default when imported:
    every kubetitan caller passes its arguments."""
    import tempfile
    from pathlib import Path

    import yaml

    import kubetitan_trainer.launch.launcher  # noqa: F401 - the launcher (and kubetitan_core.api through it)
    import kubetitan_trainer.trainer  # noqa: F401
    from kubetitan_core.api import LlamaPretrain
    from kubetitan_trainer.local import write_config
    from kubetitan_trainer.main import load_config

    with open(WARM_CONFIG) as f:
        lpt = LlamaPretrain.model_validate(yaml.safe_load(f))
    with tempfile.TemporaryDirectory(prefix="zygote-") as d:
        load_config(["--job.config_file", str(write_config(lpt, Path(d), None, 0))])  # what `kubetitan run` writes


def _enter_namespaces(hosts: str, hostname: str) -> None:
    """What ``unshare --mount --uts`` and ``mount --bind HOSTS /etc/hosts && hostname NAME`` do (the e2e kubelet)."""
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts, ms_bind, ms_rec, ms_private = 0x00020000, 0x04000000, 4096, 16384, 1 << 18

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(clone_newns | clone_newuts), "unshare")
    check(libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    check(libc.mount(hosts.encode(), b"/etc/hosts", None, ms_bind, None), "mount --bind /etc/hosts")
    socket.sethostname(hostname)


def _child(req: dict, wakeup: tuple[int, int]) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wakeup:
        os.close(fd)
    if req.get("new_session"):
        os.setsid()
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    try:
        if req.get("namespaces"):
            _enter_namespaces(*req["namespaces"])
    except OSError as e:
        print(f"zygote: {e}", file=sys.stderr)
        os._exit(1)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = os.getcwd()  # as ``python -m`` does
    if os.environ.get("PYTHONUNBUFFERED"):  # as ``python -u``: unbuffered binary layer, text written through
        import io

        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    sys.argv = ["-m", *req["args"]]

    def run() -> None:
        if os.environ.get("KUBETITAN_TEST_HOLD"):  # support/hold.py: hold the workers after chosen steps
            spec = importlib.util.spec_from_file_location("support_hold", os.path.join(os.path.dirname(__file__),
                                                                                       "hold.py"))
            hold = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(hold)
            hold.install()
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)

    exit_as_python(run)  # the launcher itself ends through exit_now


def _report(msg: dict) -> None:
    with contextlib.suppress(OSError):  # the test process is gone (a broken pipe): nobody to tell
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


_STARTED: dict[int, tuple[float, list[str], str]] = {}
"""pid -> (start, ``-m MODULE ARGS``, the test that asked), for the CPU line of ``forkrun.ENV_LOG``."""


def _reap() -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log_fork_cpu(usage, *_STARTED.pop(pid, (time.monotonic(), [], "")), parent="zygote")
        _report({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _reap_all(deadline: float) -> None:
    _reap()
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
        _reap()


def _children() -> list[int]:
    try:
        return [int(x) for x in open(f"/proc/self/task/{os.getpid()}/children").read().split()]
    except OSError:
        return []


def main() -> None:
    sys.path[0] = os.getcwd()  # not this script's folder (tests/support would shadow top-level names)
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    _warm_trainer()
    gc.enable()
    gc.freeze()
    wakeup = os.pipe()
    os.set_blocking(wakeup[1], False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _report({"ready": True})
    buf = b""
    while True:
        ready, _, _ = select.select([0, wakeup[0]], [], [])
        if wakeup[0] in ready:
            os.read(wakeup[0], 4096)
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:  # the test process is ending: wait (bounded) for what is left, so its CPU time is counted
                _reap_all(deadline=time.monotonic() + 5)
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, wakeup)
                _STARTED[pid] = (time.monotonic(), ["-m", req["module"], *req["args"]],
                                 req["env"].get("PYTEST_CURRENT_TEST", ""))
                _report({"id": req["id"], "pid": pid})
        _reap()


if __name__ == "__main__":
    main()
