"""Pod entry point: ``python -m kubetitan_trainer.launch --config=... --nnodes=N ...``.

The flags are :class:`kubetitan_core.contract.launcher.LauncherArgs` (``--help`` lists them with their defaults):
the operator's pods and ``kubetitan run`` build them from the spec with ``launcher_args``.

1. Waits (bounded, logging) until ``--master-addr`` resolves: pods of a headless Service get
   their DNS records a moment after they start, and rank 0's record is what everyone dials.
2. Checks that the config file exists. The config itself is checked by each worker
   (``kubetitan_trainer.main.check_config``) before any process group exists: a bad one ends every
   rank with exit 2 (the field and the fix in the log), which this launcher passes on.
3. Runs torchrun **in-process** through ``torch.distributed.run``'s own argument parser and
   ``elastic_launch``: static rendezvous at ``master-addr:master-port``, ``max_restarts=0``
   (the operator restarts whole gangs), workers forked from the launcher (see "Warm workers" below).
   With ``--max-restarts=N`` (N > 0) the launcher restarts the workers **in place** instead (see
   "In-place restarts" below).
4. Exits with the **failing worker's own exit code** (the earliest failure; a worker that
   exited by itself wins a tie over one torchrun killed) instead of torchrun's blanket 1.

SIGTERM (pod deletion, suspend, preemption, node drain): torchrun's agent would forward it to
the workers and SIGKILL them 30 s later; that 30 s is hard-coded in torch 2.11
(``PContext.close(timeout=30)``). The knob that does exist is ``LaunchConfig.signals_to_handle``:
the launcher leaves SIGTERM out of it and handles it itself, by creating the stop file whose path
the workers get in ``KUBETITAN_STOP_FILE``. The workers agree to stop at the next step boundary,
save a full checkpoint and exit 75; the launcher then exits 75. The time they get is the pod's
``terminationGracePeriodSeconds`` (``spec.checkpoint.saveTimeoutSeconds``), after which the
kubelet kills everything.

In-place restarts (``--max-restarts=N``, N > 0; docs/operator.md "In-place restarts"): the same
torchrun agent, with a **c10d rendezvous** hosted by node rank 0's launcher at
``master-addr:master-port`` instead of the static one. When a worker of any pod dies, that pod's agent
stops its other local workers and re-enters the rendezvous; every other agent sees a node waiting
(``num_nodes_waiting() > 0`` in ``SimpleElasticAgent._invoke_run``) and restarts its own workers too, so
the whole gang restarts together and resumes from the newest complete checkpoint, while the pods, their
volumes and their placement stay. After N such restarts the next failure ends the launcher with the
worker's exit code, and the operator re-creates the gang as before. Failures that a restart in the same pods
cannot cure are never restarted in place: the causes of ``kubetitan_core.causes.CAUSES`` whose row says so (exit
2, 4, 5 and 75, a GPU fault such as NVIDIA Xid 79 in the worker's failure report) and a SIGTERM stop (the pod is
going away). A GPU fault is also written to the pod's termination message, where the operator reads it.

Warm workers (both modes): the launcher imports torch, torchtitan and the trainer once, **before any
CUDA initialisation** (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` from
initialising CUDA), and the agent *forks* the workers (``start_method="fork"``, a function entry point),
so neither a gang start nor a restart pays an interpreter start and imports per worker (N imports on an
N-process pod were N x ~4 s of CPU at once). Each worker first resets the signal handlers it inherited
from the launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from kubetitan_core import causes, contract
from kubetitan_core.contract import EXIT_SIGTERM, ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_core.contract.launcher import LauncherArgs

from kubetitan_trainer import ENV_STOP_FILE, anatomy, compat, heartbeat
from kubetitan_trainer import main as worker_main

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


def failure_summary(message: Any) -> str:
    """A failed worker's message as torch elastic read it from the worker's error file, without the Python call stack
    it records there (``{"message": ..., "extraInfo": {"py_callstack": ...}}``): a classified exit (2, 6, ...) logged
    its own error line, and a crash's traceback is in the agent's ``failed (exitcode: 1)`` record just before
    (:class:`CleanStopLogFilter` keeps it): shown once, not twice."""
    if isinstance(message, dict):
        return str(message.get("message", ""))
    return str(message)


def exit_code_of(failures: dict) -> int:
    """The failing worker's own exit code: earliest failure; self-exits beat killed workers on ties."""
    if not failures:
        return ExitCode.FAILED
    _, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
    code = first.exitcode
    return 128 - code if code < 0 else code  # -15 (signal) -> 143, as a shell reports it


ENV_XID_REPORT = "KUBETITAN_XID_REPORT_FILE"
"""Optional: a file in which something on the node mirrors the NVIDIA driver's Xid lines (``NVRM: Xid (PCI:...):
79, ...``), e.g. a node agent writing the kernel log into a hostPath the pod mounts; set in the trainer image or by
the platform. A worker's exception does not name the Xid behind a GPU that fell off the bus (CUDA reports an
unknown error), the kernel log does. Read only when a worker fails, and only if written after the launcher
started (a stale line from before must not blame this run's GPU)."""
XID_REPORT_TAIL_BYTES = 64 * 1024
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The pod's ``terminationMessagePath`` (Kubernetes' default; plan.py sets ``FallbackToLogsOnError``, so the log's
tail stands in when this file is empty). Written only for a failure cause detected in text (a GPU fault): then
the operator reads it there, whatever the log's last lines are."""


def xid_report(env: dict | None = None, since: float = 0.0) -> str:
    """The tail of the Xid report file (:data:`ENV_XID_REPORT`) if it was written at or after ``since``; else ''."""
    path = (os.environ if env is None else env).get(ENV_XID_REPORT, "")
    try:
        if not path or os.stat(path).st_mtime < since:
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - XID_REPORT_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError as e:
        log.warning("Could not read the Xid report %s: %s", path, e)
        return ""


def failure_cause(failure: Any, report: str = "") -> causes.WorkerCause:
    """The cause of one worker failure (a torch elastic ``ProcessFailure``): its exit code and the text of its
    failure report (the exception torch recorded in the worker's error file) and of the Xid report, looked up in
    ``kubetitan_core.causes`` (:func:`~kubetitan_core.causes.worker_cause`)."""
    code = failure.exitcode
    text = "\n".join(t for t in (failure_summary(getattr(failure, "message", "")), report) if t)
    return causes.worker_cause(128 - code if code < 0 else code, text)


ENV_LAUNCHER_STATE = anatomy.ENV_LAUNCHER_STATE
"""Path of the launcher's JSON state file (in-place restarts so far, the failures and when they were detected,
the launcher's start and warm-import seconds), read by workers (:mod:`kubetitan_trainer.anatomy`)."""

WARM_MODULES = ("torchtitan.train", "kubetitan_trainer.train_spec", "kubetitan_trainer.trainer",
                "kubetitan_trainer.main")
"""What a warm launcher imports once so that forked workers start without imports."""


def restartable(failures: dict, stop_requested: bool, report: str = "") -> bool:
    """May the gang restart in place after ``failures`` (local rank -> ProcessFailure)? Not after a stop, nor when
    any failure's cause (:func:`failure_cause`) is one that the causes table does not restart in place."""
    if stop_requested:
        return False
    return all(failure_cause(f, report).cause.in_place for f in failures.values())


def text_detected(failures: dict, report: str = "") -> tuple[int, causes.Cause, str] | None:
    """The first failure (local rank, cause, what was seen) whose cause was detected in its text rather than by its
    exit code (a GPU fault); None when there is none."""
    for rank, f in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        found = failure_cause(f, report)
        if found.by_text:
            return rank, found.cause, found.seen
    return None


def report_detected(failures: dict, report: str = "", path: str = TERMINATION_MESSAGE_PATH) -> str | None:
    """Log a failure whose cause was found in its text (:func:`text_detected`) and write it as the pod's termination
    message when ``path`` exists (in a pod it does); the line, or None when there is none."""
    found = text_detected(failures, report)
    if found is None:
        return None
    rank, cause, seen = found
    f = failures[rank]
    line = (f"{cause.id}: {seen} (worker local rank {rank}, exit code {exit_code_of({rank: f})}); not restarted in "
            f"place: {failure_summary(f.message)[:1000]}")
    log.error("%s", line)
    if os.path.exists(path):
        try:
            with open(path, "w") as out:
                out.write(line[:4000])  # the kubelet reads at most 4096 bytes
        except OSError as e:
            log.warning("Could not write the termination message %s: %s", path, e)
    return line


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


def restore_tier_folder(a: LauncherArgs, env: dict) -> str:
    """The restore tier's folder for this launcher ('' = off); the pod's KUBETITAN_RESTORE_TIER wins."""
    from kubetitan_trainer.restore_tier import ENV_RESTORE_TIER

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

    torchtitan 0.2.2's ``ConfigManager.parse_args(self, args=sys.argv[1:])`` binds its default when the module
    is imported, and ``torchtitan.train.main`` calls it without arguments: the imports run with the
    workers' argv in ``sys.argv`` so that the default is theirs, not the launcher's."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    begin = time.perf_counter()
    import importlib

    saved, sys.argv = sys.argv, [sys.argv[0], *worker_argv]
    try:
        from kubetitan_trainer import cpu_bridge

        with worker_main.imports_without_gc():  # frozen before the forks: the workers share these pages
            cpu_bridge.apply()  # patches module globals once; forked workers inherit them
            for name in WARM_MODULES:
                importlib.import_module(name)
        memoize_config_parse(worker_argv)
    finally:
        sys.argv = saved
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


class LauncherState:
    """The JSON file a launcher keeps of its in-place restarts (``KUBETITAN_LAUNCHER_STATE``)."""

    def __init__(self, path: str, started: float | None = None) -> None:
        self.path = path
        self.data: dict = {"restarts": 0, "failures": [], "started": started or time.time(), "warm_import_seconds": 0.0}
        self.write()

    def warmed(self, seconds: float) -> None:
        self.data["warm_import_seconds"] = seconds
        self.write()

    def failed(self, failures: dict, restarting: bool, detected: float | None = None, report: str = "") -> None:
        """``detected``: when the agent saw the failure (the origin of the next generation's start-up anatomy;
        ``ProcessFailure.timestamp`` is whole seconds); ``report``: the Xid report's text (:func:`xid_report`)."""
        rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
        code = first.exitcode
        self.data["failures"].append({"time": first.timestamp or time.time(), "detected": detected or time.time(),
                                      "local_rank": rank, "exit_code": 128 - code if code < 0 else code,
                                      "cause": failure_cause(first, report).cause.id, "restarted": restarting})
        self.data["failures"] = self.data["failures"][-20:]
        if restarting:
            self.data["restarts"] += 1
            self._detected = detected or time.time()
        self.write()

    def restart_begins(self, now: float | None = None) -> None:
        """This agent is about to restart its workers (its own failure, or a peer's: a node waiting in the
        rendezvous): the origin of the next generation's start-up anatomy on this pod."""
        detected = getattr(self, "_detected", None)
        self.data["restart_origin"] = detected or now or time.time()
        self.data["restart_origin_kind"] = "failure_detected" if detected else "peer_restart"
        self._detected = None
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


FAILURE_KEY = "kubetitan/failure/{generation}/{node_rank}"
"""Rendezvous-store key under which a launcher posts the worker failure that ended ``generation``."""


def post_failure(store, generation: int, node_rank: int, failures: dict, hang_report: FailureReport | None = None) -> None:
    """Post this pod's first worker failure (exit code, node rank, time) for rank 0's next generation; a hang the
    watchdog stopped (``hang_report``, :meth:`InPlaceAgent` ``_stop_hung``) is posted as that instead. A hang with
    no stopped worker names no node (node rank -1, seen by ``seen_by``): in a gang every rank's step stands still
    together, every watchdog fires within a tick of the others, and which one was first says nothing of where the
    hang is (the operator's "same node twice in a row" escalation must not count it)."""
    if hang_report is not None:
        rec = dataclasses.replace(hang_report, node_rank=node_rank if hang_report.stopped else -1, seen_by=node_rank)
    else:
        rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
        code = first.exitcode
        rec = FailureReport(exit_code=128 - code if code < 0 else code, node_rank=node_rank, local_rank=rank,
                            time=time.time())
    try:
        store.set(FAILURE_KEY.format(generation=generation, node_rank=node_rank), rec.to_json())
    except Exception as e:  # noqa: BLE001 - the restart goes on without the report; the operator says Unknown
        log.warning("Could not post the worker failure to the rendezvous store: %s", e)


def failure_order(f: FailureReport) -> tuple:
    """Sort key of posted failures, the one that began the generation first: a hang whose launcher found its
    worker stopped (state T: it is the hung one; the others' workers only waited for it in a collective, and
    crash when the watchdog kills it: SIGABRT from NCCL, signal 9 or 15), then any code but the generic 1 (a
    peer's collective fails with 1 the moment the first worker dies), then the earliest."""
    stopped_hang = f.exit_code == ExitCode.HANG and f.stopped
    return (not stopped_hang, f.exit_code == ExitCode.FAILED, f.time)


def earliest_failure(store, generation: int, nnodes: int) -> FailureReport | None:
    """The failure that began ``generation``, of those the pods posted (:func:`failure_order`). The others are
    usually its collateral (seen here with 0.1 s monitor intervals: a SIGKILLed worker lost to its peer's 1)."""
    found = []
    for r in range(nnodes):
        key = FAILURE_KEY.format(generation=generation, node_rank=r)
        try:
            if store.check([key]) and (report := FailureReport.from_json(store.get(key))) is not None:
                found.append(report)
        except Exception as e:  # noqa: BLE001 - as above
            log.warning("Could not read %s from the rendezvous store: %s", key, e)
    return min(found, key=failure_order) if found else None


def process_state(pid: int) -> str:
    """The kernel's state letter of ``pid`` (R, S, D, T, Z, ...; '' when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def kill_workers(pids: list[int]) -> None:
    """SIGKILL: a hung or stopped worker may never act on SIGTERM (torch's stop would wait its 30 s for it)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone (or reaped and reused)
            os.kill(pid, signal.SIGKILL)


def poll_seconds(nnodes: int) -> float:
    """How often an agent polls the rendezvous store: 0.01 s per node, within [0.02 s, 1 s] (torch's fixed 1 s
    is most of an in-place restart's rendezvous on a small gang, and a round takes several polls: the exit from
    the old round, the join, the completion; a large gang keeps the store's load at torch's: 1,000 nodes poll
    once a second each). Only agents waiting in a round poll."""
    return min(1.0, max(0.02, 0.01 * nnodes))


def fast_rendezvous_polls(nnodes: int) -> None:
    """torch 2.11's c10d rendezvous sleeps a fixed 1 s between polls of the shared state while it waits for the
    other nodes (``dynamic_rendezvous._DistributedRendezvousOpExecutor.run``, ``_delay(seconds=1)``), and serves
    polls within 1 s of the last read from a cache (``_BackendRendezvousStateHolder(cache_duration=1)``, shortened
    in :func:`run_in_place`); poll every :func:`poll_seconds` instead. Other delays (the first round's random skew)
    are kept."""
    compat.poll_rendezvous_every(poll_seconds(nnodes))


REJOIN_KEY = "kubetitan/rejoin/{generation}"
"""Rendezvous-store counter of the agents that have stopped their workers for ``generation`` (see :func:`rejoin`)."""


def rejoin(store, generation: int, nnodes: int, timeout: float, poll: float = 0.01, clock=time.monotonic,
           sleep=time.sleep) -> None:
    """Wait until every node's agent has stopped its workers for ``generation``, then return (no new round).

    An in-place restart keeps the gang: the same pods, node ranks and world size (min = max nodes), so torch's
    c10d rendezvous round (exit the old round, join the next, complete it: several polls of its shared state,
    measured 0.5-2.8 s on this repository's 2-core machine) only re-establishes what is already known. Instead
    each agent adds 1 to one counter in the agents' store (the first add is also the announcement that the peers'
    :func:`run_in_place` ``num_nodes_waiting`` reports, so their healthy workers restart) and waits for the count
    to reach ``nnodes``, polling every ``poll`` s. The previous rank assignment, store and master address stay.
    Raises TimeoutError after ``timeout`` s (a peer's launcher is gone: its pod fails and the operator re-creates
    the gang)."""
    key = REJOIN_KEY.format(generation=generation)
    count = store.add(key, 1)
    deadline = clock() + timeout
    while count < nnodes:
        if clock() > deadline:
            raise TimeoutError(f"only {count} of {nnodes} nodes rejoined for worker generation {generation} within "
                               f"{timeout:.0f} s (a peer's launcher is gone?)")
        sleep(poll)
        count = store.add(key, 0)


class StoppedInRendezvous(Exception):
    """SIGTERM while the agent waits in a rendezvous round: no worker runs, so nothing is left to save."""


IN_RENDEZVOUS = {"now": False}
"""True while an in-place agent waits in a rendezvous round (its workers are stopped): SIGTERM then ends the
launcher at once instead of waiting out the round (up to its join timeout) while the pod terminates."""


def in_place_rendezvous_handler(config, nnodes: int, agents: list):
    """torch's c10d rendezvous handler for ``config``, whose ``num_nodes_waiting`` also counts a peer's announcement
    of the next generation (:func:`rejoin`), and whose state cache lasts one :func:`poll_seconds`. ``agents``: the
    one agent of this launcher, once it exists."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    handler = rdzv_registry.get_rendezvous_handler(params)

    def counting_rejoins(torch_waiting):
        def num_nodes_waiting() -> int:
            """torch's count, or 1 when a peer announced the next generation (:func:`rejoin`): this agent's healthy
            workers must restart too (``SimpleElasticAgent._invoke_run`` polls this every monitor interval)."""
            agent = agents[0] if agents else None
            store = compat.agent_store(agent) if agent is not None else None
            if store is not None and agent.generation >= 0:
                try:
                    if store.check([REJOIN_KEY.format(generation=agent.generation + 1)]):
                        return 1
                except Exception as e:  # noqa: BLE001 - torch's own count still applies
                    log.debug("Could not read the rejoin key: %s", e)
            return torch_waiting()

        return num_nodes_waiting

    compat.wrap_num_nodes_waiting(handler, counting_rejoins)
    compat.shorten_rendezvous_cache(handler, poll_seconds(nnodes))  # (1 s in torch 2.11: a poll within it re-reads)
    return handler


# long: the agent subclass of torch's LocalElasticAgent (imported here, lazily, as all of torch's elastic code in
# the launcher) closes over this run's state, stop flag, node rank and hang rule; each of its methods is short
def run_in_place(config, entrypoint, args: list, state: LauncherState, stop_requested, node_rank: int = 0,
                 nnodes: int = 1, hang_rule: heartbeat.Rule | None = None, beat_dir: str = "") -> None:
    """``torch.distributed.launcher.api.launch_agent`` with an agent that records failures, refuses restarts that
    cannot help (see :func:`restartable`) and, with ``beat_dir``, stops workers whose step stands still past
    ``hang_rule`` (:mod:`kubetitan_trainer.heartbeat`): every rank's workers then restart in place, cause Hang.
    Raises ChildFailedError when the workers fail."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.agent.server.api import WorkerState

    fast_rendezvous_polls(nnodes)
    join_timeout = float(config.rdzv_configs.get("join_timeout", 600) or 600)

    @compat.overrides(*compat.ELASTIC_AGENT_OVERRIDES)
    class InPlaceAgent(LocalElasticAgent):
        generation = -1
        """Worker generation (contract.ENV_RESTART_GENERATION): one rendezvous round per generation on every
        rank, so every pod counts the same, where torchrun's restart count moves only on the failing pod."""

        hang_report: FailureReport | None = None
        """This generation's hang, once the watchdog stopped the workers for one (posted as its failure)."""

        def _monitor_workers(self, worker_group):
            if len(worker_group.workers) > 1 and self.hang_report is None:
                # A local worker exited while another is stopped: torch's join would SIGTERM the stopped one and
                # wait its 30 s for it. It is the hung one: say so and kill it now.
                states = [process_state(w.id) for w in worker_group.workers if w.id]
                if "Z" in states and any(x in ("T", "t") for x in states):
                    self._stop_frozen(worker_group, "stopped (state T) when a local peer worker exited")
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY and beat_dir and hang_rule and self.hang_report is None \
                    and not stop_requested():
                stall = heartbeat.stalled(heartbeat.read(beat_dir, range(len(worker_group.workers))),
                                          self.generation, time.monotonic(), hang_rule)
                if stall is not None:
                    self._stop_hung(worker_group, stall)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
                detected = time.time()
                if self.hang_report is not None:  # the watchdog's SIGKILL: report the hang, not signal 9
                    for f in result.failures.values():
                        if f.exitcode == -signal.SIGKILL:  # a worker that exited by itself keeps its own code
                            f.exitcode = int(ExitCode.HANG)
                report = xid_report(since=state.data["started"])
                ok = restartable(result.failures, stop_requested(), report) and compat.remaining_restarts(self) > 0
                if not ok:
                    compat.forbid_restarts(self)
                state.failed(result.failures, restarting=ok, detected=detected, report=report)
                if ok:
                    post_failure(worker_group.store, self.generation, node_rank, result.failures, self.hang_report)
                    log.warning("Worker(s) failed (%s); restarting every rank's workers in place (%d left)",
                                {r: f.exitcode for r, f in result.failures.items()}, compat.remaining_restarts(self) - 1)
            return result

        def _stop_hung(self, worker_group, stall: heartbeat.Stall) -> None:
            """Post the hang as this generation's failure (before the rejoin that the rank 0 launcher reads it
            after), then SIGKILL every local worker: the agent sees them fail (or, when a peer's announcement
            comes first, restarts them) and the whole gang restarts in place."""
            pids = [w.id for w in worker_group.workers if w.id]
            stopped = any(process_state(pid) in ("T", "t") for pid in pids)
            self.hang_report = FailureReport(exit_code=int(ExitCode.HANG), node_rank=node_rank, time=time.time(),
                                             local_rank=stall.local_rank, stopped=stopped, message=stall.describe())
            post_failure(worker_group.store, self.generation, node_rank, {}, self.hang_report)
            log.warning("Hang: %s%s; stopping this pod's workers (every rank's workers restart in place)",
                        stall.describe(), " (the worker is stopped, state T)" if stopped else "")
            kill_workers(pids)

        def _stop_frozen(self, worker_group, how: str) -> None:
            """A local worker is stopped (SIGSTOP, state T) while the gang restarts: it would never act on torch's
            SIGTERM; report it as the hang (the record then names this node) and kill it."""
            frozen = [w for w in worker_group.workers if w.id and process_state(w.id) in ("T", "t")]
            if not frozen:
                return
            beats = heartbeat.read(beat_dir, range(len(worker_group.workers))) if beat_dir else {}
            last = max((b for b in beats.values() if b.get("generation") == self.generation),
                       key=lambda b: b["monotonic"], default=None)
            idle = time.monotonic() - last["monotonic"] if last else 0.0
            self._stop_hung(worker_group, heartbeat.Stall(local_rank=frozen[0].local_rank,
                                                          step=int(last["step"]) if last else 0,
                                                          idle_seconds=idle, limit_seconds=0.0, how=how))

        def _restart_workers(self, worker_group):
            # A peer announced the next generation. A worker of ours that is stopped is the hung one.
            if self.hang_report is None:
                self._stop_frozen(worker_group, "stopped (state T) when a peer's launcher restarted the gang")
            state.restart_begins()
            super()._restart_workers(worker_group)

        def _rendezvous(self, worker_group):
            old = worker_group.store if self.generation >= 0 else None
            begin = time.time()
            if stop_requested():
                raise StoppedInRendezvous()
            IN_RENDEZVOUS["now"] = True
            try:
                if old is None:  # the gang forms: torch's c10d rendezvous assigns the node ranks
                    super()._rendezvous(worker_group)
                else:  # the same gang again: same ranks, same store (see rejoin)
                    rejoin(old, self.generation + 1, nnodes, join_timeout)
            finally:
                IN_RENDEZVOUS["now"] = False
            if old is not None:
                log.info("Rendezvous round for worker generation %d took %.2f s", self.generation + 1,
                         time.time() - begin)
            # Every failing launcher posted its failure before it joined this round, so all are readable now.
            failure = earliest_failure(old, self.generation, nnodes) if old is not None else None
            if failure is not None and beat_dir:
                # the last step the ending generation trained (this pod's workers' heartbeats; every rank steps
                # together): the work lost is exact, not what the operator's last scrape happened to see
                steps = [b["step"] for b in heartbeat.read(beat_dir, range(config.nproc_per_node)).values()
                         if b.get("generation") == self.generation]
                if steps:
                    failure = dataclasses.replace(failure, previous_step=max(steps))
            self.generation += 1
            self.hang_report = None
            if beat_dir:
                heartbeat.clear(beat_dir, range(config.nproc_per_node))
            os.environ[contract.ENV_RESTART_GENERATION] = str(self.generation)  # forked workers inherit it
            if failure is not None:
                os.environ[contract.ENV_RESTART_FAILURE] = failure.to_json()
                log.warning("Worker generation %d starts after a failure of node rank %s (exit code %s)",
                            self.generation, failure.node_rank, failure.exit_code)
            else:
                os.environ.pop(contract.ENV_RESTART_FAILURE, None)
            state.data["generation"] = self.generation
            state.write()

    agents: list = []
    handler = in_place_rendezvous_handler(config, nnodes, agents)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler,
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      local_addr=config.local_addr)
    agent = InPlaceAgent(spec=spec, logs_specs=config.logs_specs, start_method="fork",
                         log_line_prefix_template=config.log_line_prefix_template)
    agents.append(agent)
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name="kubetitan_trainer.main", failures=result.failures)
    finally:
        spec.rdzv_handler.shutdown()


def preflight(a: LauncherArgs) -> int | None:
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
                   stop_dir: str) -> None:
    """Run this node's workers until they end: in place (``--max-restarts`` > 0), forked from this warm launcher,
    or as new processes when CUDA was initialised here. Raises ChildFailedError when they fail."""
    from torch.distributed.launcher.api import elastic_launch

    # Workers share the agents' TCPStore, each generation under its own key prefix (generation_scoped_agent_store,
    # in run_worker); they are forked from this process after it imported torch and torchtitan once.
    seconds = warm_up(["--job.config_file", a.config])
    state.warmed(seconds)
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


def workers_exit_code(failures: dict) -> int:
    """The launcher's exit code for the workers' ``failures`` (:func:`exit_code_of`), logged."""
    code = exit_code_of(failures)
    rank, failure = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
    if code == ExitCode.TERMINATED_CHECKPOINTED:  # every rank saved the stop checkpoint: a clean, resumable stop
        log.info("Workers stopped cleanly after saving the stop checkpoint (exit code %d; the run resumes from it)",
                 code)
    else:
        log.error("Worker rank %d failed first with exit code %d: %s", rank, failure.exitcode,
                  failure_summary(failure.message))
    return code


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
    if (code := preflight(a)) is not None:
        return code
    # Forked workers need a launcher that never initialised CUDA. torch.cuda.is_available() without this asks the
    # CUDA runtime (which poisons fork), and torchrun's LaunchConfig calls it (numa defaults) before warm_up runs:
    # seen on the H200 ("Cannot re-initialize CUDA in forked subprocess" in every worker).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    with worker_main.imports_without_gc():
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import config_from_args
        from torch.distributed.run import parse_args as torchrun_parse

    from kubetitan_trainer import compile_cache
    from kubetitan_trainer.restore_tier import ENV_RESTORE_TIER

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
    config, cmd, cmd_args = config_from_args(torchrun_parse(torchrun_argv(a)))
    # SIGTERM stays ours (see the module docstring); torchrun still handles the others.
    config.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    log.info("Starting %d worker(s) on node %d of %d, master %s:%d", a.nproc_per_node, a.node_rank, a.nnodes, a.master_addr, a.master_port)
    try:
        launch_workers(a, config, cmd, cmd_args, state, stopped, stop_dir)
        code = ExitCode.OK
    except StoppedInRendezvous:
        log.warning("Stopped by SIGTERM while waiting for the other pods' launchers (no worker was running)")
        code = EXIT_SIGTERM
    except ChildFailedError as e:
        code = workers_exit_code(e.failures)
        if code != ExitCode.TERMINATED_CHECKPOINTED:
            report_detected(e.failures, xid_report(since=state.data["started"]))
    if stopped["at"]:
        code = stopped_exit_code(code)
    if tier:
        import shutil

        shutil.rmtree(tier, ignore_errors=True)  # memory of the pod: never leave it behind
    log.info("Exiting with code %d", code)
    return int(code)


if __name__ == "__main__":
    worker_main.exit_now(main())
