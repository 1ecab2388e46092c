"""`kubetitan run` (kubetitan_trainer.local): Ctrl-C handling with a real launcher and real workers, and the bar."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml
from prometheus_client import generate_latest

import pytest

from kubetitan_core import contract
from kubetitan_core.api import LlamaPretrain, S3CheckpointStorage
from kubetitan_core.contract import ExitCode

from support.specs import TINY, make_lpt
from support import yamlio

PY = sys.executable


def _lines(stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def _wait_line(q: queue.Queue, text: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no line with {text!r} within {timeout} s; got {seen}")


def _workers(local: psutil.Process, n: int, timeout: float = 180) -> tuple[psutil.Process, list[psutil.Process]]:
    """The launcher (``kubetitan_trainer.launch``) under ``local`` and its ``n`` worker processes (forked from it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        launcher = next((p for p in local.children() if "kubetitan_trainer.launch" in " ".join(p.cmdline())), None)
        found = launcher.children() if launcher is not None else []
        if len(found) == n:
            return launcher, found
        time.sleep(0.2)
    raise AssertionError(f"{n} workers did not start within {timeout} s")


def test_the_second_ctrl_c_ends_the_launcher_and_every_frozen_worker(tmp_path):
    """A real `kubetitan run` (launcher + 2 torchrun workers). The workers are frozen (SIGSTOP, as a rank stuck in
    a collective would be: they cannot stop by themselves), then Ctrl-C twice: no launcher or worker PID may
    survive (``local.kill_tree`` kills every descendant, in whatever session or process group it runs)."""
    spec = {**TINY, "training": {**TINY["training"], "steps": 100000}}
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                 "metadata": {"name": "ctrlc", "namespace": "t"}, "spec": spec}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.Popen([PY, "-m", "kubetitan_trainer.local", str(f), "--output-dir", str(tmp_path / "out")],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                           start_new_session=True)
    out = _lines(run.stdout)
    tree: list[psutil.Process] = []
    try:
        local = psutil.Process(run.pid)
        _launcher, workers = _workers(local, 2)
        tree = [p for p in local.children(recursive=True)]
        assert set(workers) <= set(tree)
        for w in workers:
            w.suspend()
        os.kill(run.pid, signal.SIGINT)
        _wait_line(out, "Stopping:")
        os.kill(run.pid, signal.SIGINT)
        _wait_line(out, "Killed the launcher and its workers")
        assert run.wait(timeout=60) == contract.EXIT_SIGKILL  # the launcher's SIGKILL, as 128 + 9
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_gone(p) for p in tree):
            time.sleep(0.1)
        assert [p.pid for p in tree if not _gone(p)] == [], "processes of the run survived the second Ctrl-C"
    finally:
        for p in [*tree, psutil.Process(run.pid) if run.poll() is None else None]:
            if p is not None and not _gone(p):
                p.kill()


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_bar_shows_no_loss_before_the_first_logged_step():
    """The trainer exports no loss until a step is logged (a 0 would read as a loss), so the bar shows none."""
    import time as _t

    from kubetitan_trainer.local import bar_postfix, parse_metrics
    from kubetitan_trainer.metrics import Exporter

    ex = Exporter(peak_flops=None, total_steps=10, attempt=0, job_start=_t.time())
    ex.step_done(1, 0.5)  # a step ran, none was logged yet
    before = parse_metrics(generate_latest(ex.registry).decode())
    assert contract.M_STEP in before and contract.M_LOSS not in before
    assert bar_postfix(before) == {}
    ex.set_loss(2.25)
    ex.tps_total.set(1234.0)
    after = parse_metrics(generate_latest(ex.registry).decode())
    assert bar_postfix(after) == {"loss": "2.2500", "tok/s": "1,234"}
    ex.set_loss(2.0)  # later logs update the one registered gauge
    assert bar_postfix(parse_metrics(generate_latest(ex.registry).decode()))["loss"] == "2.0000"


# ------------------------------------------------------------------ polish of `kubetitan run` (issue 25, item 5)
def test_a_resumed_bar_counts_rate_and_eta_from_the_resumed_step():
    from tqdm import tqdm

    from kubetitan_trainer.local import resume_bar

    clock = [100.0]
    bar = tqdm(total=1000, disable=False, file=open(os.devnull, "w"), mininterval=0)
    bar._time = lambda: clock[0]  # the bar's clock, moved by hand
    bar.start_t = bar.last_print_t = clock[0]
    clock[0] += 1
    resume_bar(bar, 500)
    assert (bar.n, bar.initial) == (500, 500)
    clock[0] += 10
    bar.update(10)  # 10 steps in 10 s after the resume
    d = bar.format_dict
    assert d["n"] == 510 and d["elapsed"] == pytest.approx(10)
    line = tqdm.format_meter(**d)
    assert "510/1000" in line and "<08:10" in line, line  # ETA: 490 steps at 1 step/s, not a jump from 0 to 500


def _finished(out: Path, *steps: int, partial: tuple[int, ...] = ()) -> None:
    """Checkpoint folders under ``out`` as a run leaves them: complete steps (DCP metadata last) and cut-off ones."""
    for step in (*steps, *partial):
        (out / contract.CHECKPOINT_SUBDIR / f"step-{step}").mkdir(parents=True)
    for step in steps:
        (out / contract.CHECKPOINT_SUBDIR / f"step-{step}" / contract.DCP_METADATA_FILE).write_bytes(b"")


@pytest.mark.parametrize("case, steps_arg, want_started", [
    ("complete", None, False),               # newest complete step 4 = training.steps: nothing starts
    ("lower --steps", 3, False),             # asked for fewer than it has
    ("higher --steps", 6, True),             # more to train: the launcher starts (and resumes from step 4)
    ("partial only", None, True),            # step 4 was cut off: the newest complete is 2
    ("checkpoints off", None, True),         # no resume rule without checkpoints: trains from scratch
    ("checkpoints in S3", None, True),       # the trainer looks in the bucket itself
    ("changed spec", None, True),            # another learning rate than the folder's trainer.toml: the trainer decides
    ("no trainer.toml", None, True),         # a folder some other tool filled
])
def test_a_finished_run_starts_nothing_unless_there_is_more_or_other_to_train(tmp_path, monkeypatch, capsys, case,
                                                                               steps_arg, want_started):
    from kubetitan_trainer import local

    spec = {**TINY, "training": {**TINY["training"], "steps": 4}}
    if case == "checkpoints off":
        spec["checkpoint"] = {**spec.get("checkpoint", {}), "enabled": False}
    lpt = LlamaPretrain.model_validate(make_lpt(spec, name="done", namespace="t"))
    out = tmp_path / "out"
    out.mkdir()
    if case != "no trainer.toml":
        local.write_config(lpt, out, None, metrics_port=1)  # the first run's
    if case == "partial only":
        _finished(out, 2, partial=(4,))
    else:
        _finished(out, 2, 4)
    if case == "checkpoints in S3":
        lpt.spec.checkpoint.storage.s3 = S3CheckpointStorage(uri="s3://bucket/run")
    if case == "changed spec":
        lpt.spec.training.learning_rate *= 2
    started = []

    class Launcher:  # stands in for the launcher's process: records that it was started
        def __init__(self, cmd, **kwargs):
            started.append(cmd)

    monkeypatch.setattr(local.subprocess, "Popen", Launcher)
    monkeypatch.setattr(local, "_follow", lambda proc, name, total, port: 0)
    code = local.run_local(lpt, output_dir=str(out), steps=steps_arg)
    said = capsys.readouterr().out
    assert code == 0 and bool(started) == want_started, (case, said)
    target = steps_arg or 4
    assert ("already complete at step 4 (training.steps is %d)" % target in said) == (not want_started), said


def test_the_summary_shows_the_trainers_own_already_complete_line(tmp_path, capsys):
    """Where ``kubetitan run`` cannot see the checkpoint (S3), the trainer finds it complete after its load and logs
    the line; the summary shows it from the log."""
    from kubetitan_trainer import already_complete, local

    lpt = LlamaPretrain.model_validate(make_lpt({**TINY, "training": {**TINY["training"], "steps": 4}}, name="s3",
                                                namespace="t"))
    log = tmp_path / "train.log"
    log.write_text(f"[titan] 2026-12-08 00:00:00,000 - root - WARNING - {already_complete(4, 4)}\n")
    local._summary(lpt, tmp_path, log, 1, 0)
    assert already_complete(4, 4) + "\n" in capsys.readouterr().out


def test_gpu_shortfall_says_so_before_any_process_starts():
    from kubetitan_trainer.local import gpu_shortfall

    spec = {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain", "metadata": {"name": "x"},
            "spec": {"resources": {"gpusPerNode": 8}}}
    lpt = LlamaPretrain.model_validate(spec)
    msg = gpu_shortfall(lpt, 0)
    assert msg.startswith("spec.resources.gpusPerNode is 8 but this machine has 0 GPU(s). Fix:") and "gpusPerNode: 0" in msg
    assert "gpusPerNode: 0" not in gpu_shortfall(lpt, 4)
    assert gpu_shortfall(lpt, 8) is None


def test_an_unwritable_output_dir_is_one_line_and_a_config_error(tmp_path, monkeypatch, capsys):
    import errno

    from kubetitan_trainer import local

    lpt = LlamaPretrain.model_validate({"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
                                        "metadata": {"name": "x"}, "spec": {"resources": {"gpusPerNode": 0}}})

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(local.Path, "mkdir", read_only)
    assert local.run_local(lpt, output_dir=str(tmp_path / "out")) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Read-only file system" in err[0] and "--output-dir" in err[0], err


def test_a_clean_stop_is_not_logged_as_a_worker_failure():
    import logging

    from kubetitan_trainer.launch.launcher import CleanStopLogFilter

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    def attached(exc: BaseException):  # what torch's agent attaches for a forked worker: its join's exception
        try:
            raise exc
        except BaseException:
            return sys.exc_info()

    def record(code: int, exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                                 "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s", (code, 0, 1, "x"),
                                 attached(exc))

    stop = record(75, ProcessExitedException("process 0 terminated with exit code 75", 0, 1, 75))
    exited = record(2, ProcessExitedException("process 0 terminated with exit code 2", 0, 1, 2))
    raised = record(1, ProcessRaisedException("Traceback ... RuntimeError: CUDA out of memory", 0, 1))
    assert all(CleanStopLogFilter().filter(r) for r in (stop, exited, raised))
    assert stop.levelno == logging.INFO and "stop checkpoint" in stop.getMessage()
    assert exited.levelno == logging.ERROR and "exitcode: 2" in exited.getMessage()
    formatted = logging.Formatter().format(exited)  # a classified exit: the line stays, the agent's traceback goes
    assert "exitcode: 2" in formatted and "Traceback" not in formatted
    formatted = logging.Formatter().format(raised)  # a crash: the worker's traceback is kept, the only one there is
    assert "exitcode: 1" in formatted and "CUDA out of memory" in formatted


def _run_local(tmp_path: Path, name: str, spec: dict, out: Path) -> subprocess.CompletedProcess:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(make_lpt(spec, name=name, namespace="t")))
    tmp = tmp_path / f"tmp-{name}"  # the run's temporary folder, to see what it leaves there
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp)}
    return subprocess.run([PY, "-m", "kubetitan_trainer.local", str(f), "--output-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


def _left_behind(tmp_path: Path, name: str) -> list[str]:
    """What the launcher and torchrun left in the run's temporary folder (their state, heartbeats and logs)."""
    folder = tmp_path / f"tmp-{name}"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("kubetitan-", "torchelastic")))


def test_a_local_run_shows_its_eval_loss_a_rerun_says_it_is_complete_and_a_failure_is_one_line(tmp_path):
    """`kubetitan run` on the console: the held-out loss (a line per evaluation and one in the summary); the same
    command again says the run is already complete at its last step; a run that fails prints the worker's error in
    one line (not the log's last 15 lines)."""
    spec = {**TINY, "training": {**TINY["training"], "steps": 4},
            "data": {"source": "synthetic", "eval": {"intervalSteps": 2, "samples": 8}},
            "resources": {**TINY["resources"], "processesPerNode": 1}, "parallelism": {"dataParallelShardDegree": 1}}
    out = tmp_path / "out"
    first = _run_local(tmp_path, "evals", spec, out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    evals = [line for line in (out / "kubetitan" / "evals.jsonl").read_text().splitlines() if line]
    last = yamlio.load(evals[-1])
    assert f"Eval loss:   {last['eval_loss']:.4f} at step {last['step']}" in first.stdout, first.stdout
    assert "already complete" not in first.stdout
    assert _left_behind(tmp_path, "evals") == []  # the launcher's folder and torchrun's logs went with it

    log_size = (out / "train.log").stat().st_size
    again = _run_local(tmp_path, "evals", spec, out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if "already complete" in line]
    assert said == ["The run is already complete at step 4 (training.steps is 4): nothing to train. To train further, "
                    "raise spec.training.steps (or --steps); to train again from scratch, use a new run name or "
                    "output directory"], again.stdout
    # said before anything starts: no launcher, no worker, nothing more in the log
    assert "Training evals with" not in again.stdout and (out / "train.log").stat().st_size == log_size, again.stdout
    assert f"Eval loss:   {last['eval_loss']:.4f} at step {last['step']}" in again.stdout, again.stdout

    bad = {**spec, "data": {"source": "shards", "shards": {"path": str(tmp_path / "no-shards-here")}}}
    failed = _run_local(tmp_path, "bad", bad, tmp_path / "bad")
    assert failed.returncode == ExitCode.CONFIG_ERROR, failed.stdout[-3000:] + failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not exist" in errors[0] and "Fix:" in errors[0], failed.stderr
    assert "[titan]" not in failed.stdout + failed.stderr and "[kubetitan]" not in failed.stdout + failed.stderr, (
        failed.stdout + failed.stderr)  # no log lines on the console: the one error, and where the log is


def test_failure_message_is_the_first_failed_workers_error():
    from kubetitan_trainer.local import failure_message

    log = ("[titan] 2026-12-06 16:41:13,850 - root - ERROR - Config error: kubetitan.data.shards_path: x. Fix: y\n"
           "E1206 16:41:13.940000 18759 api.py:835] failed (exitcode: 2) local_rank: 0 (pid: 1) of fn: run_worker\n"
           "[kubetitan] 2026-12-06 16:41:13,942 ERROR Worker rank 0 failed first with exit code 2: ConfigError: "
           "kubetitan.data.shards_path: x. Fix: y\n"
           "[kubetitan] 2026-12-06 16:41:13,945 INFO Exiting with code 2\n")
    assert failure_message(log) == "ConfigError: kubetitan.data.shards_path: x. Fix: y"
    # no launcher summary (a worker that ended before torch elastic recorded a message): the last ERROR line
    assert failure_message(log.splitlines()[0] + "\n") == "Config error: kubetitan.data.shards_path: x. Fix: y"
    assert failure_message("[titan] 2026 INFO - nothing wrong\n") is None
    # a worker that exited 2 by itself: torch elastic recorded no message, the worker's own ERROR line says it
    placeholder = (log.splitlines()[0] + "\n[kubetitan] 2026-12-06 16:41:13,942 ERROR Worker rank 0 failed first with "
                   "exit code 2: To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert failure_message(placeholder) == "Config error: kubetitan.data.shards_path: x. Fix: y"
