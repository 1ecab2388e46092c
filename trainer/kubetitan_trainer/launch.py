"""Pod entry point: ``python -m kubetitan_trainer.launch --config=... --nnodes=N ...``.

1. Waits (bounded, logging) until ``--master-addr`` resolves: pods of a headless Service get
   their DNS records a moment after they start, and rank 0's record is what everyone dials.
2. Checks that the config file exists. The config itself is checked by each worker
   (``kubetitan_trainer.main.check_config``) before any process group exists: a bad one ends every
   rank with exit 2 (the field and the fix in the log), which this launcher passes on. The launcher
   does not parse it itself: that would import torchtitan a second time on every gang start
   (~5 s of the time to recover from a failure on a 2-core machine).
3. Runs torchrun **in-process** through ``torch.distributed.run``'s own argument parser and
   ``elastic_launch``: static rendezvous at ``master-addr:master-port``, ``max_restarts=0``
   (the operator restarts whole gangs), worker ``kubetitan_trainer.main --job.config_file``.
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
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import time

from kubetitan.contract import EXIT_SIGTERM, ExitCode

from kubetitan_trainer import ENV_STOP_FILE

log = logging.getLogger("kubetitan.launch")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kubetitan_trainer.launch", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="trainer.toml rendered by the operator")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--rdzv-id", default="kubetitan")
    p.add_argument("--dns-timeout", type=float, default=600.0, help="seconds to wait for --master-addr to resolve")
    return p.parse_args(argv)


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


def exit_code_of(failures: dict) -> int:
    """The failing worker's own exit code: earliest failure; self-exits beat killed workers on ties."""
    if not failures:
        return ExitCode.FAILED
    _, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
    code = first.exitcode
    return 128 - code if code < 0 else code  # -15 (signal) -> 143, as a shell reports it


def torchrun_argv(a: argparse.Namespace) -> list[str]:
    return [
        f"--nnodes={a.nnodes}", f"--nproc-per-node={a.nproc_per_node}", f"--node-rank={a.node_rank}",
        "--rdzv-backend=static", f"--master-addr={a.master_addr}", f"--master-port={a.master_port}",
        f"--rdzv-id={a.rdzv_id}", "--max-restarts=0", "--monitor-interval=0.5",
        "-m", "kubetitan_trainer.main", "--job.config_file", a.config,
    ]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[kubetitan] %(asctime)s %(levelname)s %(message)s")
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if not wait_for_dns(a.master_addr, a.master_port, a.dns_timeout):
        return ExitCode.FAILED
    if not os.path.isfile(a.config):
        log.error("Config error: --config %s does not exist. Fix: mount the ConfigMap or render one with `kubetitan render`", a.config)
        return ExitCode.CONFIG_ERROR

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args
    from torch.distributed.run import parse_args as torchrun_parse

    stop_dir = tempfile.mkdtemp(prefix="kubetitan-")
    stop_file = os.path.join(stop_dir, "stop")
    os.environ[ENV_STOP_FILE] = stop_file
    stopped = {"at": 0.0}

    def on_sigterm(signum, frame):
        if not stopped["at"]:
            stopped["at"] = time.time()
            log.warning("Received SIGTERM: asking the workers to save a checkpoint at the next step and stop")
            open(stop_file, "w").close()

    signal.signal(signal.SIGTERM, on_sigterm)
    config, cmd, cmd_args = config_from_args(torchrun_parse(torchrun_argv(a)))
    # SIGTERM stays ours (see the module docstring); torchrun still handles the others.
    config.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    log.info("Starting %d worker(s) on node %d of %d, master %s:%d", a.nproc_per_node, a.node_rank, a.nnodes, a.master_addr, a.master_port)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        code = ExitCode.OK
    except ChildFailedError as e:
        code = exit_code_of(e.failures)
        rank, failure = min(e.failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
        log.error("Worker rank %d failed first with exit code %d: %s", rank, failure.exitcode, failure.message)
    if stopped["at"] and code not in (ExitCode.TERMINATED_CHECKPOINTED, ExitCode.OK):
        log.error("Stopped by SIGTERM without a complete checkpoint (worker exit %d)", code)
        code = EXIT_SIGTERM
    elif stopped["at"] and code == ExitCode.OK:
        code = ExitCode.OK  # training reached its last step (and saved) before the stop took effect
    log.info("Exiting with code %d", code)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
