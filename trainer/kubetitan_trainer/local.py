"""``kubetitan run FILE``: the same launcher and trainer the pods run, on this machine.

``kubetitan run`` validates the file and then hands its process over to ``python -m kubetitan_trainer.local
FILE [--output-dir DIR] [--steps N]`` (this module's :func:`main`), so the operator's CLI never imports the trainer.

Renders ``trainer.toml`` into the output folder (default ``./runs/<name>``), starts
``python -m kubetitan_trainer.launch`` with one node, ``processesPerNode`` workers, master
127.0.0.1 and free ports, shows a progress bar fed by the trainer's own ``/metrics`` endpoint
(step, loss, tokens/s) and returns the launcher's exit code. Ctrl-C asks for a checkpoint and a
clean stop (SIGTERM to the launcher, exit 75); a second Ctrl-C kills the launcher and every worker
(:func:`kill_tree`: torchrun's workers run in sessions of their own).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import tomli_w

from kubetitan_core import contract, render
from kubetitan_trainer import ALREADY_COMPLETE, already_complete
from kubetitan_core.api import LlamaPretrain
from kubetitan_core.contract.launcher import LauncherArgs, launcher_args, monitor_interval_seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value of a /metrics page (unlabelled samples only)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def scrape(port: int, timeout: float = 1.0) -> dict[str, float]:
    """Sample name -> value of the trainer's /metrics (unlabelled samples only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def bar_postfix(m: dict[str, float]) -> dict[str, str]:
    """The progress bar's loss and tokens/s, once the trainer has logged a step (before that the trainer
    exports no loss, and its throughput gauge still reads 0)."""
    if contract.M_LOSS not in m:
        return {}
    post = {"loss": f"{m[contract.M_LOSS]:.4f}"}
    if contract.M_EVAL_LOSS in m:
        post["eval"] = f"{m[contract.M_EVAL_LOSS]:.4f}"
    if contract.M_TOKENS_PER_SECOND in m:
        post["tok/s"] = f"{m[contract.M_TOKENS_PER_SECOND]:,.0f}"
    return post


def eval_line(m: dict[str, float]) -> str:
    """The console line of an evaluation, from the trainer's metrics (its eval series exist once one ran)."""
    return (f"step {int(m[contract.M_EVAL_STEP])}: eval loss {m[contract.M_EVAL_LOSS]:.4f}, perplexity "
            f"{m.get(contract.M_EVAL_PERPLEXITY, float('nan')):.2f}")


def kill_tree(root_pid: int, timeout: float = 30.0) -> list[int]:
    """SIGKILL ``root_pid`` and every process it started, in whatever session or process group they run.

    torchrun starts each worker in a session of its own (``start_new_session``), so killing the launcher's
    process group leaves them running. Each process is frozen (SIGSTOP) before its children are listed, so
    none starts another one meanwhile; then every process group they lead or share (not this process's own)
    and every process is killed, and their ends are awaited. Returns the PIDs killed."""
    import psutil

    try:
        frontier = [psutil.Process(root_pid)]
    except psutil.NoSuchProcess:
        return []
    procs: list[psutil.Process] = []
    while frontier:
        p = frontier.pop()
        if any(p.pid == q.pid for q in procs):
            continue
        procs.append(p)
        try:
            p.suspend()
            frontier += p.children()
        except psutil.Error:
            pass
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
    for g in groups - {os.getpgrp()}:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout
    while any(not gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p.pid for p in procs]


def gone(p) -> bool:
    """The ``psutil.Process`` has ended (a zombie counts: it runs no more, whoever reaps it)."""
    import psutil

    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def resume_bar(bar, step: int) -> None:
    """Start the progress bar over at ``step`` (the step a resumed run loaded): its rate and ETA then count only the
    steps this run trains, from now, instead of a jump from 0 to ``step`` in the first second."""
    bar.reset(total=bar.total)
    bar.initial = bar.n = bar.last_print_n = step
    bar.refresh()


def visible_gpus() -> int:
    """CUDA devices this machine shows the trainer (NVML; does not initialise CUDA in this process)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_shortfall(lpt: LlamaPretrain, visible: int) -> str | None:
    """Why this machine cannot run ``lpt`` (its GPUs per node), or None."""
    want = lpt.spec.resources.gpus_per_node
    if want <= visible:
        return None
    return (f"spec.resources.gpusPerNode is {want} but this machine has {visible} GPU(s). Fix: run it on a machine with "
            f"{want} GPUs, lower gpusPerNode (and the parallel degrees) to {visible}"
            + (", or train on CPU with gpusPerNode: 0 and processesPerNode (debug or custom model)" if not visible else ""))


def processes_per_node(lpt: LlamaPretrain) -> int:
    r = lpt.spec.resources
    return r.processes_per_node or max(1, r.gpus_per_node)


def spec_env(lpt: LlamaPretrain) -> dict[str, str]:
    """``spec.resources.env`` entries with a plain ``value``, as a pod gets them (``valueFrom`` needs a cluster)."""
    return {e["name"]: str(e["value"]) for e in lpt.spec.resources.env if "name" in e and "value" in e}


def config_for(lpt: LlamaPretrain, out: Path, steps: int | None, metrics_port: int, ledger: bool = False) -> dict:
    """The run's ``trainer.toml`` as a dict: the operator's rendering, with its dump folder ``out``, the metrics
    endpoint on this machine's loopback at ``metrics_port``, and s3:// shards staged under ``out`` (no staging
    emptyDir here)."""
    kt = render.kubetitan_table(lpt)
    kt = dataclasses.replace(kt, metrics_port=metrics_port, metrics_host="127.0.0.1")
    if ledger:
        kt.data = dataclasses.replace(kt.data, ledger=True)
    if kt.data_s3.stage_dir:
        kt.data_s3 = dataclasses.replace(kt.data_s3, stage_dir=str(out / "kubetitan" / "data-cache"))
    cfg = render.trainer_config(lpt, dump_folder=str(out), kubetitan=kt)
    if steps is not None:
        cfg["training"]["steps"] = steps
    return cfg


def write_config(lpt: LlamaPretrain, out: Path, steps: int | None, metrics_port: int, ledger: bool = False) -> Path:
    """The run's ``trainer.toml`` (:func:`config_for`) written into ``out``."""
    return write_toml(lpt, out, config_for(lpt, out, steps, metrics_port, ledger))


def write_toml(lpt: LlamaPretrain, out: Path, cfg: dict) -> Path:
    """``cfg`` (:func:`config_for`) as ``out``'s ``trainer.toml``, under the operator's header line."""
    path = out / contract.CONFIG_KEY
    path.write_text(render.trainer_toml(lpt, str(out)).split("\n", 1)[0] + "\n" + tomli_w.dumps(cfg))
    return path


def same_training(previous: Path, cfg: dict) -> bool:
    """Whether the ``trainer.toml`` a run left in its folder (``previous``) trains what ``cfg`` trains: equal but for
    the steps and the metrics port (a free port each time); False when there is none or it cannot be read."""
    import tomllib

    try:
        old = tomllib.loads(previous.read_text())
    except (OSError, ValueError):
        return False

    def comparable(c: dict) -> dict:
        c = {k: dict(v) if isinstance(v, dict) else v for k, v in c.items()}
        c.get("training", {}).pop("steps", None)
        c.get("kubetitan", {}).pop("metrics_port", None)
        return c

    return comparable(old) == comparable(tomllib.loads(tomli_w.dumps(cfg)))  # as written: tuples become lists


def local_launcher_args(lpt: LlamaPretrain, config: Path, master_port: int) -> LauncherArgs:
    """The launcher's arguments of a local run: what a pod of the spec gets (``launcher_args``: in-place restarts,
    the hang watchdog's policy, the save timeout), as the only node, its master on this machine."""
    args = launcher_args(lpt.spec, config=str(config), node_rank=0, master_addr="127.0.0.1", master_port=master_port,
                         rdzv_id=f"local-{lpt.metadata.name}", dns_timeout=5)
    return dataclasses.replace(args, nnodes=1, monitor_interval=monitor_interval_seconds(1))


def run_local(lpt: LlamaPretrain, output_dir: str | None = None, steps: int | None = None, ledger: bool = False) -> int:
    """Train ``lpt`` locally (``ledger``: with the sample ledger whatever ``spec.data.ledger`` says); returns the
    trainer's exit code (``kubetitan_core.contract.ExitCode``)."""
    name = lpt.metadata.name
    short = gpu_shortfall(lpt, visible_gpus()) if lpt.spec.resources.gpus_per_node > 0 else None
    if short:
        print(f"error: {short}", file=sys.stderr)
        return contract.ExitCode.CONFIG_ERROR
    out = Path(output_dir or Path("runs") / name).resolve()
    metrics_port, master_port = free_port(), free_port()
    cfg = config_for(lpt, out, steps, metrics_port, ledger)
    log_path = out / "train.log"
    target = steps or lpt.spec.training.steps
    done = completed_step(lpt, out)
    if done is not None and done >= target and same_training(out / contract.CONFIG_KEY, cfg):
        # nothing to train: say so at once, without starting the launcher and the workers (the trainer would say
        # the same after building the model and loading the checkpoint). A changed spec goes to the trainer.
        print(already_complete(done, target))
        _summary(lpt, out, log_path, metrics_port, contract.ExitCode.OK, started=False)
        return contract.ExitCode.OK
    try:
        out.mkdir(parents=True, exist_ok=True)
        config = write_toml(lpt, out, cfg)
        with open(out / "train.log", "ab"):
            pass
    except OSError as e:
        print(f"error: cannot write the output directory {out}: {e.strerror or e}. Fix: pass --output-dir with a "
              "writable directory (checkpoints, logs and metrics go there)", file=sys.stderr)
        return contract.ExitCode.CONFIG_ERROR
    nproc = processes_per_node(lpt)
    cmd = [sys.executable, "-m", "kubetitan_trainer.launch", *local_launcher_args(lpt, config, master_port).to_argv()]
    env = {**os.environ, **spec_env(lpt), contract.ENV_ATTEMPT: os.environ.get(contract.ENV_ATTEMPT, "0"),
           contract.ENV_JOB_NAME: name, contract.ENV_JOB_NAMESPACE: lpt.metadata.namespace or "default",
           contract.ENV_JOB_START_TIME: str(int(time.time()))}
    print(f"Training {name} with {nproc} process(es); log: {log_path}")
    with open(log_path, "ab") as logf:
        # Own session: Ctrl-C reaches this process only, which turns it into a graceful stop.
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code = _follow(proc, name, target, metrics_port)
    _summary(lpt, out, log_path, metrics_port, code)
    return code


def completed_step(lpt: LlamaPretrain, out: Path) -> int | None:
    """The newest complete checkpoint step of a local run's own checkpoint folder under ``out`` (the one resume
    rule, :func:`kubetitan_core.contract.newest_complete_step`); None without one, or when checkpoints are off or
    go to S3 (the trainer then looks itself)."""
    from kubetitan_trainer import storage  # torch-free

    ck = lpt.spec.checkpoint
    if not ck.enabled or ck.storage.s3 is not None:
        return None
    return storage.LocalStore(str(out / contract.CHECKPOINT_SUBDIR)).newest_complete_step()


def _follow(proc: subprocess.Popen, name: str, total: int, metrics_port: int) -> int:
    """A progress bar from the trainer's metrics until the launcher ends; the first Ctrl-C stops it gracefully
    (SIGTERM: a checkpoint at the next step), the second kills its process tree. Returns its exit code (128 + N
    when killed by signal N, as a shell reports it)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=name, unit="step", dynamic_ncols=True)
    interrupts = 0
    resumed = False
    eval_step = -1.0

    def on_sigint(signum, frame) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            bar.write("Stopping: the trainer saves a checkpoint at the next step (Ctrl-C again to kill)")
            proc.send_signal(signal.SIGTERM)
        else:
            killed = kill_tree(proc.pid)
            bar.write(f"Killed the launcher and its workers (PIDs {', '.join(map(str, killed))})")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        while proc.poll() is None:
            try:
                m = scrape(metrics_port)
            except OSError:
                m = {}
            if not resumed and m.get(contract.M_RESUMED_FROM_STEP, -1) >= 0:
                resumed = True  # the trainer loaded its state: it continues from this step
                if m[contract.M_RESUMED_FROM_STEP] > 0:
                    resume_bar(bar, int(m[contract.M_RESUMED_FROM_STEP]))
            if contract.M_STEP in m:
                bar.update(max(0, int(m[contract.M_STEP]) - bar.n))
                bar.set_postfix(bar_postfix(m), refresh=True)
            if contract.M_EVAL_LOSS in m and m.get(contract.M_EVAL_STEP, -1.0) != eval_step:
                eval_step = m.get(contract.M_EVAL_STEP, -1.0)
                bar.write(eval_line(m))  # above the bar, kept on the console
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    code = proc.wait()
    return 128 - code if code < 0 else code


def _summary(lpt: LlamaPretrain, out: Path, log_path: Path, metrics_port: int, code: int, started: bool = True) -> None:
    """What the run left and where: exit code, metrics, TensorBoard, checkpoints, and the log's tail on a failure
    (``started``: whether the launcher ran; a run with nothing to train starts nothing)."""
    ck = out / contract.CHECKPOINT_SUBDIR
    text = log_path.read_text(errors="replace") if started else ""
    complete = next((line for line in text.splitlines() if ALREADY_COMPLETE in line), None)
    if code == 0 and complete is not None:
        print(complete[complete.index(ALREADY_COMPLETE):])
    if (last := last_eval(out / "kubetitan" / "evals.jsonl")) is not None:
        print(f"Eval loss:   {last['eval_loss']:.4f} at step {last['step']} (perplexity "
              f"{last.get('eval_perplexity', float('nan')):.2f}); every evaluation: {out / 'kubetitan' / 'evals.jsonl'}")
    if code == contract.ExitCode.TERMINATED_CHECKPOINTED:
        print(f"Stopped with a checkpoint (exit code {code}); the same command resumes from it")
    else:
        print(f"Exit code {code}" + ("" if code == 0 else f"; see {log_path}"))
    if started:
        print(f"Metrics:     served on http://127.0.0.1:{metrics_port}/metrics while running; per-step log "
              f"{out / 'kubetitan' / 'steps.jsonl'}")
    else:
        print(f"Per-step log: {out / 'kubetitan' / 'steps.jsonl'} (nothing started this time)")
    if lpt.spec.monitoring.tensorboard:
        print(f"TensorBoard: {out / 'tb'}  (tensorboard --logdir {out / 'tb'})")
    print(f"Checkpoints: {ck}")
    if code not in (0, contract.ExitCode.TERMINATED_CHECKPOINTED):
        said = failure_message(text)
        print(f"error: {said}" if said else "\n".join(text.splitlines()[-15:]), file=sys.stderr)


def last_eval(path: Path) -> dict | None:
    """The last record of the trainer's ``evals.jsonl`` (None without one)."""
    import json

    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


_FAILED_FIRST = re.compile(r"Worker rank \d+ failed first with exit code -?\d+: (.+)$")
_ERROR_LINE = re.compile(r"^\[titan\] \S+ \S+ - \S+ - ERROR - (.+)$|^\[kubetitan\] \S+ \S+ ERROR (.+)$")


def failure_message(log_text: str) -> str | None:
    """The one line that says why a run failed, from its log: the launcher's ``Worker rank N failed first with exit
    code C: <the worker's error>`` (a configuration error's field, problem and fix; a crash's exception), else the
    last ERROR line a worker or the launcher logged; None when the log holds neither (then the caller shows its
    tail)."""
    last_error = None
    for line in log_text.splitlines():
        if m := _FAILED_FIRST.search(line):
            msg = m.group(1).strip()
            if msg and not msg.startswith(_NO_MESSAGE):
                return msg
        elif m := _ERROR_LINE.match(line):
            last_error = (m.group(1) or m.group(2)).strip()
    return last_error


_NO_MESSAGE = "To enable traceback see"
"""torch elastic's message for a worker that exited with a code and no recorded exception (one that logged its own
error line, e.g. the config checks' exit 2): the worker's ERROR line says more."""


LEDGER_HELP = ("write the sample ledger (every global sample each rank trains, OUTPUT/kubetitan/ledger/) whatever "
               "spec.data.ledger says")


def main(argv: list[str] | None = None) -> int:
    """``python -m kubetitan_trainer.local FILE [--output-dir DIR] [--steps N] [--ledger]`` (what ``kubetitan run``
    runs)."""
    import argparse

    from kubetitan_core.strictyaml import YamlError, load_all
    from kubetitan_core.validation import parse

    p = argparse.ArgumentParser(prog="kubetitan run", description="train a LlamaPretrain locally")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--output-dir", help="where checkpoints, logs and metrics go (default ./runs/<name>)")
    p.add_argument("--steps", type=int, help="override spec.training.steps")
    p.add_argument("--ledger", action="store_true", help=LEDGER_HELP)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        docs = [d for d in load_all(Path(a.file).read_bytes()) if d is not None]
    except (OSError, YamlError) as e:
        print(f"error: {a.file}: {e}", file=sys.stderr)
        return 1
    lpt, errors = parse(docs[0]) if len(docs) == 1 else (None, [f"holds {len(docs)} documents; give exactly one"])
    if errors or lpt is None:
        print(f"{a.file}: is not a valid LlamaPretrain (`kubetitan validate {a.file}` lists why):", file=sys.stderr)
        for e in errors:
            print(f"  - {e}", file=sys.stderr)
        return 1
    return run_local(lpt, output_dir=a.output_dir, steps=a.steps, ledger=a.ledger)


if __name__ == "__main__":
    sys.exit(main())
