"""The launcher's hang watchdog: heartbeats written by a worker, the hang rule on them (kubetitan_core.hang, the
operator's too), and which posted failure began a generation. Pure and table-tested; the end-to-end behaviour is
tests/e2e/test_inplace.py (a frozen worker of rank 1, then of rank 0, restarts the gang in place, cause Hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kubetitan_core.contract import ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_trainer.launch import launcher as launch
from kubetitan_trainer.launch import state as launch_state
from kubetitan_trainer.launch import store as rdzv_store
from kubetitan_trainer.recovery import heartbeat
from kubetitan_trainer.recovery.heartbeat import Rule, stalled
from support.memstore import MemStore

NOW = 1_000_000.0
AUTO = Rule(policy="Auto", timeout_seconds=900, floor_seconds=30, save_timeout_seconds=120)


def beat(ago: float, step: int = 20, median: float | None = 0.5, steps: int = 10, generation: int = 0,
         save: bool = False) -> dict:
    return {"generation": generation, "step": step, "time": 0.0, "monotonic": NOW - ago, "median_step_seconds": median,
            "steps_trained": steps, "save_window": save}


CASES = [
    # (id, beats by local rank, generation, rule, stalled local rank or None, limit)
    ("fresh-step", {0: beat(1)}, 0, AUTO, None, None),
    ("auto-floor-30s", {0: beat(31)}, 0, AUTO, 0, 30),
    ("auto-not-before-the-floor", {0: beat(29)}, 0, AUTO, None, None),
    ("auto-10x-median", {0: beat(41, median=4.0)}, 0, AUTO, 0, 40),
    ("auto-not-before-10x-median", {0: beat(39, median=4.0)}, 0, AUTO, None, None),
    ("auto-needs-5-steps-of-the-generation", {0: beat(100, steps=4)}, 0, AUTO, None, None),
    ("fewer-steps-use-hang-timeout", {0: beat(901, steps=4)}, 0, AUTO, 0, 900),
    ("save-window-after-a-checkpoint-step", {0: beat(149, save=True)}, 0, AUTO, None, None),
    ("save-window-ends", {0: beat(151, save=True)}, 0, AUTO, 0, 150),
    ("fixed-ignores-the-step-time", {0: beat(100)}, 0, Rule("Fixed", 900, 30, 120), None, None),
    ("fixed-fires-at-hang-timeout", {0: beat(901)}, 0, Rule("Fixed", 900, 30, 120), 0, 900),
    ("lowered-floor", {0: beat(6, median=0.2)}, 0, Rule("Auto", 900, 5, 120), 0, 5),
    ("previous-generation-ignored", {0: beat(1000, generation=0)}, 1, AUTO, None, None),
    ("stalest-local-rank-named", {0: beat(31), 1: beat(45), 2: beat(2)}, 0, AUTO, 1, 30),
    ("no-heartbeat-yet", {}, 0, AUTO, None, None),
]


@pytest.mark.parametrize(("beats", "generation", "rule", "rank", "limit"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_stalled(beats, generation, rule, rank, limit) -> None:
    s = stalled(beats, generation, NOW, rule)
    if rank is None:
        assert s is None, s
    else:
        assert s is not None and (s.local_rank, s.limit_seconds) == (rank, limit), s
        assert f"local rank {rank} made no step progress" in s.describe()


def test_writer_writes_what_the_watchdog_reads(tmp_path) -> None:
    w = heartbeat.Writer(str(tmp_path), local_rank=1, generation=2, last_step=100, checkpoint_enabled=True,
                         interval_steps=10)
    for step, seconds in ((11, 1.0), (12, 3.0), (13, 2.0)):
        w.step_done(step, seconds, now=NOW)
    got = heartbeat.read(str(tmp_path), range(2))
    assert list(got) == [1]
    assert abs(got[1].pop("time") - time.time()) < 60  # wall clock, for people
    assert got[1] == {"generation": 2, "step": 13, "monotonic": NOW, "median_step_seconds": 2.0, "steps_trained": 3,
                      "save_window": False}
    w.step_done(20, 1.0, now=NOW)
    assert heartbeat.read(str(tmp_path), [1])[1]["save_window"] is True  # a checkpoint step: a save may follow
    w.step_done(21, 1.0, now=NOW)
    assert heartbeat.read(str(tmp_path), [1])[1]["save_window"] is False
    w.step_done(22, 1.0, saving=True, now=NOW)  # a SIGTERM stop's full save, at any step
    assert heartbeat.read(str(tmp_path), [1])[1]["save_window"] is True
    heartbeat.clear(str(tmp_path), range(2))
    assert heartbeat.read(str(tmp_path), range(2)) == {}


def test_a_heartbeat_that_cannot_be_written_never_stops_training(tmp_path, caplog) -> None:
    w = heartbeat.Writer(str(tmp_path / "gone"), local_rank=0, generation=0, last_step=10, checkpoint_enabled=False,
                         interval_steps=0)
    w.step_done(1, 1.0)  # the folder does not exist: OSError, logged once
    w.step_done(2, 1.0)
    assert [r.getMessage() for r in caplog.records].count(next(r.getMessage() for r in caplog.records)) == 1
    assert "Could not write the step heartbeat" in caplog.records[0].getMessage()


def test_writer_is_off_without_the_launchers_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(heartbeat.ENV_HEARTBEAT_DIR, raising=False)
    w = heartbeat.Writer.from_env(last_step=10, checkpoint_enabled=False, interval_steps=0)
    w.step_done(1, 1.0)
    assert w.file == "" and not os.listdir(tmp_path)


def fail(code: int, t: float, stopped: bool = False) -> FailureReport:
    return FailureReport(exit_code=code, time=t, stopped=stopped, node_rank=int(t))


@pytest.mark.parametrize(("posted", "first"), [
    ([fail(1, 1), fail(137, 2)], 2),                                 # a peer's collateral 1 loses to the kill
    ([fail(ExitCode.HANG, 1), fail(ExitCode.HANG, 2, stopped=True)], 2),  # the stopped worker is the hung one
    ([fail(ExitCode.HANG, 1), fail(ExitCode.HANG, 2)], 1),           # neither stopped: the first to stop its own
    ([fail(137, 1), fail(ExitCode.HANG, 2, stopped=True)], 2),       # a stopped worker beats an earlier crash:
    ([fail(134, 1), fail(ExitCode.HANG, 2, stopped=True)], 2),       # the watchdog's kill made the peers crash
    ([fail(ExitCode.HANG, 1), fail(134, 2)], 1),                     # a hang, then the peers' NCCL abort
    ([fail(137, 1), fail(ExitCode.HANG, 2)], 1),                     # a crash, then a watchdog that only waited
    ([fail(1, 1), fail(ExitCode.HANG, 5)], 5),
], ids=["generic-1-last", "stopped-hang-first", "earliest-hang", "stopped-hang-over-earlier-kill",
        "stopped-hang-over-nccl-abort", "hang-then-nccl-abort", "crash-then-waiting-hang", "hang-over-generic-1"])
def test_the_failure_that_began_a_generation(posted, first) -> None:
    assert min(posted, key=rdzv_store.failure_order).node_rank == first


def hang(time: float, stopped: bool) -> FailureReport:
    """The hang watchdog's report before it is posted (the posting launcher sets the node rank)."""
    return FailureReport(exit_code=ExitCode.HANG, node_rank=0, time=time, local_rank=0, stopped=stopped)


def test_a_hang_names_its_node_only_when_a_worker_was_stopped() -> None:
    """Every rank's step stands still together in a gang: a hang no stopped worker explains names no node (rank -1;
    the launcher that saw it is kept), so the operator's "same node twice in a row" escalation never counts it."""
    store = MemStore()
    rdzv_store.post_failure(store, 3, 0, {}, hang(time=1.0, stopped=False))
    rdzv_store.post_failure(store, 3, 1, {}, hang(time=2.0, stopped=True))
    got = rdzv_store.earliest_failure(store, 3, 2)
    assert (got.node_rank, got.seen_by) == (1, 1)
    store = MemStore()
    rdzv_store.post_failure(store, 4, 0, {}, hang(time=1.0, stopped=False))
    rdzv_store.post_failure(store, 4, 1, {}, hang(time=1.1, stopped=False))
    got = rdzv_store.earliest_failure(store, 4, 2)
    assert (got.exit_code, got.node_rank, got.seen_by) == (7, -1, 0)


def test_process_state_sees_a_stopped_process_and_kill_workers_ends_it() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while launch_state.process_state(p.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert launch_state.process_state(p.pid) in ("T", "t")
        launch_state.kill_workers([p.pid])  # SIGKILL reaches a stopped process; SIGTERM would wait for SIGCONT
        assert p.wait(10) == -signal.SIGKILL
        assert launch_state.process_state(p.pid) == ""
    finally:
        if p.poll() is None:
            p.kill()


def test_launcher_flags_carry_the_hang_rule() -> None:
    a = launch.parse_args(["--config=/c", "--hang-timeout-seconds=120", "--hang-timeout-policy=Fixed",
                           "--hang-floor-seconds=5", "--save-timeout-seconds=10"])
    assert (a.hang_timeout_seconds, a.hang_timeout_policy, a.hang_floor_seconds, a.save_timeout_seconds) == \
        (120.0, "Fixed", 5.0, 10.0)
    assert json.loads(json.dumps(vars(a)))  # plain values
