"""Pod entry point: ``python -m kubetitan_trainer.launch --config=... --nnodes=N ...``.

The flags are :class:`kubetitan_core.contract.launcher.LauncherArgs` (``--help`` lists them with their defaults):
the operator's pods and ``kubetitan run`` build them from the spec with ``launcher_args``.

1. Waits (bounded, logging) until ``--master-addr`` resolves: pods of a headless Service get
   their DNS records a moment after they start, and rank 0's record is what everyone dials.
2. Checks that the config file exists. The config itself is checked by each worker
   (``kubetitan_trainer.main.check_config``) before any process group exists: a bad one ends every
   rank with exit 2 (the field and the fix in the log), which this launcher passes on.
3. Runs the pod's **pre-flight gate** (:mod:`kubetitan_trainer.launch.gate`, :mod:`kubetitan_trainer.preflight`;
   ``spec.runPolicy.preflight``) before the first workers start: on a GPU pod a process of its own, begun as the
   launcher starts so that it overlaps the waits and imports below; a failed check exits with code 8
   (``PreflightFailed``, the termination message naming the node and the check) and no worker starts.
4. Runs torchrun **in-process** through ``torch.distributed.run``'s own argument parser and
   ``elastic_launch``: static rendezvous at ``master-addr:master-port``, ``max_restarts=0``
   (the operator restarts whole gangs), workers forked from the launcher (see "Warm workers" below).
   With ``--max-restarts=N`` (N > 0) the launcher restarts the workers **in place** instead (see
   "In-place restarts" below).
5. Exits with the **failing worker's own exit code** (the earliest failure; a worker that
   exited by itself wins a tie over one torchrun killed) instead of torchrun's blanket 1.

SIGTERM (pod deletion, suspend, preemption, node drain): torchrun's agent would forward it to
the workers and SIGKILL them 30 s later; that 30 s is hard-coded in torch 2.11
(``PContext.close(timeout=30)``). The knob that does exist is ``LaunchConfig.signals_to_handle``:
the launcher leaves SIGTERM out of it and handles it itself, by creating the stop file whose path
the workers get in ``KUBETITAN_STOP_FILE``. The workers agree to stop at the next step boundary,
save a full checkpoint and exit 75; the launcher then exits 75. The time they get is the pod's
``terminationGracePeriodSeconds`` (``spec.checkpoint.saveTimeoutSeconds``), after which the
kubelet kills everything.

In-place restarts (``--max-restarts=N``, N > 0): the in-place agent (:mod:`kubetitan_trainer.launch.agent`),
whose launchers talk through their rendezvous store (:mod:`kubetitan_trainer.launch.store`); a worker failure's
exit code and cause (:mod:`kubetitan_trainer.launch.failures`).

Warm workers (both modes): the launcher imports torch, torchtitan and the trainer once, **before any
CUDA initialisation** (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` from
initialising CUDA), and the agent *forks* the workers (``start_method="fork"``, a function entry point),
so neither a gang start nor a restart pays an interpreter start and imports per worker (N imports on an
N-process pod were N x ~4 s of CPU at once). Each worker first resets the signal handlers it inherited
from the launcher.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import time

from kubetitan_core import contract
from kubetitan_core.contract import EXIT_SIGTERM, ExitCode
from kubetitan_core.contract.launcher import LauncherArgs

from kubetitan_trainer import ENV_STOP_FILE, compat, preflight
from kubetitan_trainer import main as worker_main
from kubetitan_trainer.launch import gate, orphans
from kubetitan_trainer.launch.failures import report_detected, workers_exit_code, xid_report
from kubetitan_trainer.launch.state import IN_RENDEZVOUS, LauncherState, StoppedInRendezvous
from kubetitan_trainer.recovery import anatomy, heartbeat

log = logging.getLogger("kubetitan.launch")


def parse_args(argv: list[str]) -> LauncherArgs:
    """The launcher's flags: :class:`kubetitan_core.contract.launcher.LauncherArgs` (what the operator's pods and
    ``kubetitan run`` pass), each with its type, default and help defined there once."""
    return LauncherArgs.from_argv(argv)


def wait_for_dns(host: str, port: int, timeout: float, sleep=time.sleep, resolve=socket.getaddrinfo) -> bool:
    """Poll until ``host`` resolves; True when it did within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay, said = 0.5, False
    while True:
        try:
            resolve(host, port)
            if said:
                log.info("Master address %s resolved", host)
            return True
        except OSError as e:
            if time.monotonic() >= deadline:
                log.error("Master address %s did not resolve within %.0f s (%s); is the headless Service there?", host, timeout, e)
                return False
            if not said:
                log.info("Waiting up to %.0f s for master address %s to resolve (%s)", timeout, host, e)
                said = True
            sleep(delay)
            delay = min(delay * 2, 5.0)


class CleanStopLogFilter(logging.Filter):
    """torch's elastic agent logs every worker exit but 0 as an ERROR ``failed (exitcode: N)``; a worker that exits 75
    saved its stop checkpoint and ended as asked (SIGTERM, Ctrl-C): that record becomes an INFO that says so. For a
    forked worker (a function entry point) that *exited* with a code (``ProcessExitedException``: a classified exit,
    whose own error line the worker logged) the agent attaches the traceback of its own ``ProcessContext.join``,
    which says nothing about the worker: the line stays, that traceback goes. A worker that *raised*
    (``ProcessRaisedException``: an unclassified crash, exit 1) keeps it: its message is the worker's traceback,
    which nothing else prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and f"failed (exitcode: {int(ExitCode.TERMINATED_CHECKPOINTED)})" in message:
            record.msg, record.args = "Workers stopped after saving their stop checkpoint (exit code 75)", ()
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.INFO, "INFO", None, None
        elif "failed (exitcode: " in message and record.exc_info and _exited(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


def _exited(exc: BaseException | None) -> bool:
    """Whether ``exc`` is torch's "a worker process exited with a code" (not "a worker raised")."""
    from torch.multiprocessing import ProcessExitedException

    return isinstance(exc, ProcessExitedException)


ENV_LAUNCHER_STATE = anatomy.ENV_LAUNCHER_STATE
"""Path of the launcher's JSON state file (in-place restarts so far, the failures and when they were detected,
the launcher's start and warm-import seconds), read by workers (:mod:`kubetitan_trainer.recovery.anatomy`)."""

WARM_MODULES = ("torchtitan.train", "kubetitan_trainer.train_spec", "kubetitan_trainer.trainer",
                "kubetitan_trainer.main")
"""What a warm launcher imports once so that forked workers start without imports."""


def torchrun_argv(a: LauncherArgs) -> list[str]:
    if a.max_restarts > 0:
        is_host = "true" if a.node_rank == 0 else "false"
        return [
            f"--nnodes={a.nnodes}", f"--nproc-per-node={a.nproc_per_node}", f"--node-rank={a.node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={a.master_addr}:{a.master_port}", f"--rdzv-id={a.rdzv_id}",
            f"--rdzv-conf=is_host={is_host}" + (f",join_timeout={a.rdzv_timeout}" if a.rdzv_timeout else ""),
            f"--max-restarts={a.max_restarts}",
            f"--monitor-interval={a.monitor_interval}", "--start-method=fork",
            "-m", "kubetitan_trainer.main", "--job.config_file", a.config,
        ]
    return [
        f"--nnodes={a.nnodes}", f"--nproc-per-node={a.nproc_per_node}", f"--node-rank={a.node_rank}",
        "--rdzv-backend=static", f"--master-addr={a.master_addr}", f"--master-port={a.master_port}",
        f"--rdzv-id={a.rdzv_id}", "--max-restarts=0", f"--monitor-interval={a.monitor_interval}",
        "--start-method=fork", *([f"--rdzv-conf=timeout={a.rdzv_timeout}"] if a.rdzv_timeout else []),
        "-m", "kubetitan_trainer.main", "--job.config_file", a.config,
    ]


def remove_folders(tier: str, stop_dir: str) -> None:
    """What the launcher made for its workers, when it exits: the restore tier (memory of the pod: never left behind)
    and its temporary folder (the stop file, the state, the step heartbeats, torchrun's logs)."""
    import shutil

    for folder in (tier, stop_dir):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def restore_tier_folder(a: LauncherArgs, env: dict) -> str:
    """The restore tier's folder for this launcher ('' = off); the pod's KUBETITAN_RESTORE_TIER wins."""
    from kubetitan_trainer.recovery.restore_tier import ENV_RESTORE_TIER

    if ENV_RESTORE_TIER in env:
        return env[ENV_RESTORE_TIER]
    if a.restore_tier == "off" or (a.restore_tier == "auto" and a.max_restarts <= 0):
        return ""
    if a.restore_tier == "auto":
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in a.rdzv_id)
        return f"/dev/shm/kubetitan-restore-{safe}-{a.node_rank}" if os.path.isdir("/dev/shm") else ""
    return a.restore_tier


GENERATION_STORE_PREFIX = "kubetitan/generation-{generation}"
"""Prefix of a worker generation's keys in the agents' shared TCPStore (see :func:`generation_scoped_agent_store`)."""


def generation_scoped_agent_store(generation: int) -> None:
    """Give this worker's process group a store prefix of its own generation in the agents' shared TCPStore.

    torchrun's agents share their rendezvous TCPStore (hosted by node rank 0's launcher, up before any worker
    starts) with the workers, without a per-restart prefix (torch 2.11 ``_create_c10d_store``: "we create a new
    TCPStore for every retry"): a restarted generation would find the previous one's keys (seen: gloo's
    ``connectFullMesh`` dialled the dead workers' ports). The store is one per generation, so the keys are: every
    rank has the same generation (one rendezvous round each). The alternative, a fresh store hosted by each
    generation's rank 0 worker, costs the other ranks ~0.5 s whenever they dial before it listens (the TCPStore
    client's reconnect back-off; measured here: a client started 0.05 s before its server connected after 0.54 s)."""
    from torch import distributed as dist

    original = compat.c10d_store_factory()
    if getattr(original, "kubetitan_generation", None) is not None:
        return

    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        store = original(hostname, port, rank, world_size, timeout, use_libuv)
        if compat.uses_agent_store():
            return dist.PrefixStore(GENERATION_STORE_PREFIX.format(generation=generation), store)
        return store

    create.kubetitan_generation = generation
    compat.replace_c10d_store_factory(create)


def run_worker(*argv: str) -> int:
    """A forked worker's entry point: the launcher's signal handlers off, its generation's store prefix, then the
    trainer's main."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    generation_scoped_agent_store(int(os.environ.get(contract.ENV_RESTART_GENERATION, "0") or 0))
    sys.argv = [worker_main.__file__, *argv]  # a fork keeps the launcher's argv; torchtitan parses sys.argv
    code = worker_main.main(list(argv))
    if code:
        sys.exit(int(code))  # the agent reads the process's exit code (a forked process ends with os._exit)
    return 0


def warm_up(worker_argv: list[str]) -> float:
    """Import what every worker needs, without initialising CUDA; the seconds it took.

    torchtitan 0.2.2's ``ConfigManager.parse_args(self, args=sys.argv[1:])`` binds its default (the launcher's
    arguments, here) when the module is imported, and ``torchtitan.train.main`` calls it without arguments: each
    worker binds it to its own (``compat.bind_config_args`` in ``kubetitan_trainer.main``)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    begin = time.perf_counter()
    import importlib

    from kubetitan_trainer import cpu_bridge

    with worker_main.imports_without_gc():  # frozen before the forks: the workers share these pages
        cpu_bridge.apply()  # patches module globals once; forked workers inherit them
        for name in WARM_MODULES:
            importlib.import_module(name)
    memoize_config_parse(worker_argv)
    return time.perf_counter() - begin


def cuda_initialised() -> bool:
    """Whether this process holds a CUDA context (then forked workers could not use CUDA)."""
    import torch

    return torch.cuda.is_initialized()


def _config_key(args: list[str]) -> tuple | None:
    """What a parse of ``args`` depends on: the arguments and the config file's identity and contents' stamp."""
    path = next((args[i + 1] for i, x in enumerate(args[:-1]) if x in ("--job.config_file", "--job.config-file")),
                None)
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (tuple(args), (st.st_ino, st.st_size, st.st_mtime_ns) if st else None)


def memoize_config_parse(worker_argv: list[str]) -> None:
    """Parse the workers' config once in the warm launcher; forked workers get a copy instead of parsing again.

    Every worker parses its config twice (``main.check_config`` and ``torchtitan.train.main``): ~0.12 s each on
    this repository's CPU machine with the imports done, paid again by every worker of every in-place generation.
    torchtitan's ``ConfigManager.parse_args`` is wrapped to return a deep copy of the launcher's result for the
    same arguments and the same file (inode, size, mtime); anything else parses as before. A parse that fails here
    is left to the workers, which report it (exit 2)."""
    import copy

    from torchtitan.config import ConfigManager

    original, default = compat.config_parse()
    if getattr(original, "kubetitan_memo", None) is not None:
        return
    memo: dict = {}

    def parse_args(self, args: list[str] = default):
        key = _config_key(list(args))
        if key is not None and key in memo:
            self.config = copy.deepcopy(memo[key])
            return self.config
        config = original(self, args)
        if key is not None:
            memo[key] = copy.deepcopy(config)
        return config

    parse_args.kubetitan_memo = memo
    compat.replace_config_parse(parse_args)
    try:
        ConfigManager().parse_args(list(worker_argv))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - tyro exits on bad values; the workers say why
        log.info("Config not pre-parsed in the launcher (%s); each worker parses it", e)


def startable(a: LauncherArgs) -> int | None:
    """The exit code when the launcher cannot start (rank 0's address does not resolve, the config is missing);
    None when it can."""
    if not wait_for_dns(a.master_addr, a.master_port, a.dns_timeout):
        return ExitCode.FAILED
    if not os.path.isfile(a.config):
        log.error("Config error: --config %s does not exist. Fix: mount the ConfigMap or render one with `kubetitan render`", a.config)
        return ExitCode.CONFIG_ERROR
    return None


def stop_on_sigterm(stop_file: str) -> dict:
    """Handle SIGTERM ourselves (see the module docstring): create the workers' stop file, and end a rendezvous
    wait at once. Returns the dict whose ``at`` is the time SIGTERM came (0.0 before)."""
    stopped = {"at": 0.0}

    def on_sigterm(signum, frame):
        if not stopped["at"]:
            stopped["at"] = time.time()
            log.warning("Received SIGTERM: asking the workers to save a checkpoint at the next step and stop")
            open(stop_file, "w").close()
        if IN_RENDEZVOUS["now"]:
            raise StoppedInRendezvous()

    signal.signal(signal.SIGTERM, on_sigterm)
    return stopped


def launch_workers(a: LauncherArgs, config, cmd, cmd_args, state: LauncherState, stopped: dict,
                   stop_dir: str, pending_gate: preflight.Pending | None = None) -> int | None:
    """Run this node's workers until they end: in place (``--max-restarts`` > 0), forked from this warm launcher,
    or as new processes when CUDA was initialised here. Raises ChildFailedError when they fail. First the warm imports
    and the pod's pre-flight gate (:mod:`kubetitan_trainer.launch.gate`): its exit code when it failed (no worker
    started), else None."""
    from torch.distributed.launcher.api import elastic_launch

    from kubetitan_trainer.launch.agent import run_in_place

    # Workers share the agents' TCPStore, each generation under its own key prefix (generation_scoped_agent_store,
    # in run_worker); they are forked from this process after it imported torch and torchtitan once.
    seconds = warm_up(["--job.config_file", a.config])
    state.warmed(seconds)
    if (code := gate.finish(pending_gate, state)) is not None:
        return code
    if a.max_restarts > 0:
        log.info("In-place restarts on (up to %d); warm workers: imported torch/torchtitan once in %.1f s",
                 a.max_restarts, seconds)
        rule = heartbeat.Rule(a.hang_timeout_policy, a.hang_timeout_seconds, a.hang_floor_seconds,
                              a.save_timeout_seconds)
        run_in_place(config, run_worker, ["--job.config_file", a.config], state, lambda: bool(stopped["at"]),
                     node_rank=a.node_rank, nnodes=a.nnodes, hang_rule=rule, beat_dir=stop_dir)
    elif cuda_initialised():
        # a fork would give every worker a CUDA context it cannot use ("Cannot re-initialize CUDA in forked
        # subprocess"): when NVML could not answer torch.cuda.is_available(), start fresh interpreters instead
        log.warning("CUDA was initialised in the launcher (NVML unavailable?): starting the workers as new "
                    "processes, each importing torch/torchtitan itself")
        config.start_method = "spawn"
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    else:
        log.info("Warm workers: imported torch/torchtitan once in %.1f s", seconds)
        elastic_launch(config=config, entrypoint=run_worker)("--job.config_file", a.config)
    return None


def stopped_exit_code(code: int) -> int:
    """The exit code after SIGTERM: the workers' 75 (stop checkpoint saved) or 0 (training ended first) stand; any
    other is a stop without a complete checkpoint (143)."""
    if code in (ExitCode.TERMINATED_CHECKPOINTED, ExitCode.OK):
        return code
    log.error("Stopped by SIGTERM without a complete checkpoint (worker exit %d)", code)
    return EXIT_SIGTERM


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[kubetitan] %(asctime)s %(levelname)s %(message)s")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(CleanStopLogFilter())
    a = parse_args(sys.argv[1:] if argv is None else argv)
    pending_gate = gate.start(a)  # a GPU pod's gate process runs beside the waits and imports below
    if (code := startable(a)) is not None:
        if pending_gate is not None:
            pending_gate.cancel()
        return code
    # Forked workers need a launcher that never initialised CUDA. torch.cuda.is_available() without this asks the
    # CUDA runtime (which poisons fork), and torchrun's LaunchConfig calls it (numa defaults) before warm_up runs:
    # seen on the H200 ("Cannot re-initialize CUDA in forked subprocess" in every worker).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    with worker_main.imports_without_gc():
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import config_from_args
        from torch.distributed.run import parse_args as torchrun_parse

    from kubetitan_trainer.compile import compile_cache
    from kubetitan_trainer.recovery.restore_tier import ENV_RESTORE_TIER

    cache = compile_cache.configure(a.config)  # before any worker starts: they inherit the variables
    if cache:
        log.info("Compile cache (Inductor, AOTAutograd, Triton): %s", cache)
    stop_dir = tempfile.mkdtemp(prefix="kubetitan-")
    os.environ[ENV_STOP_FILE] = os.path.join(stop_dir, "stop")
    stopped = stop_on_sigterm(os.environ[ENV_STOP_FILE])
    tier = os.environ[ENV_RESTORE_TIER] = restore_tier_folder(a, os.environ)
    if tier:
        log.info("Restore tier for in-place restarts: %s (removed when the launcher exits)", tier)
    state = LauncherState(os.path.join(stop_dir, "launcher.json"), started=anatomy.process_start_time())
    os.environ[ENV_LAUNCHER_STATE] = state.path
    if a.max_restarts > 0:
        os.environ[heartbeat.ENV_HEARTBEAT_DIR] = stop_dir  # the workers' step heartbeats, for the hang watchdog
    # torchrun's per-attempt logs in that folder too (its default: a new /tmp/torchelastic_* a launch, never removed)
    log_dir = f"--log-dir={os.path.join(stop_dir, 'torchelastic')}"
    config, cmd, cmd_args = config_from_args(torchrun_parse([log_dir, *torchrun_argv(a)]))
    # SIGTERM stays ours (see the module docstring); torchrun still handles the others.
    config.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    log.info("Starting %d worker(s) on node %d of %d, master %s:%d", a.nproc_per_node, a.node_rank, a.nnodes, a.master_addr, a.master_port)
    orphans.become_subreaper()  # what a dead worker leaves running becomes ours to end (launch.orphans)
    try:
        code = launch_workers(a, config, cmd, cmd_args, state, stopped, stop_dir, pending_gate) or ExitCode.OK
    except StoppedInRendezvous:
        log.warning("Stopped by SIGTERM while waiting for the other pods' launchers (no worker was running)")
        code = EXIT_SIGTERM
    except ChildFailedError as e:
        code = workers_exit_code(e.failures)
        if code != ExitCode.TERMINATED_CHECKPOINTED:
            report_detected(e.failures, xid_report(since=state.data["started"]))
    if stopped["at"]:
        code = stopped_exit_code(code)
    orphans.reap()
    remove_folders(tier, stop_dir)
    log.info("Exiting with code %d", code)
    return int(code)


if __name__ == "__main__":
    worker_main.exit_now(main())
