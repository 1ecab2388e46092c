"""A dead worker's processes are ended by its launcher (kubetitan_trainer.launch.orphans): torch's async-checkpoint
writer is a ``spawn`` child of the worker and outlived it on an H100, writing on into the checkpoint volume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from kubetitan_trainer.launch import agent, orphans
from support.procs import running

SCRIPT = textwrap.dedent("""
    import json, multiprocessing as mp, os, signal, sys, time
    import psutil
    from kubetitan_trainer.launch import orphans

    def worker(q):  # a forked worker (torch elastic's start method) whose spawned writer outlives it
        writer = mp.get_context("spawn").Process(target=time.sleep, args=(300,))
        writer.start()
        q.put(writer.pid)
        os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        subreaper = orphans.become_subreaper() if sys.argv[1] == "on" else False
        q = mp.get_context("fork").SimpleQueue()
        w = mp.get_context("fork").Process(target=worker, args=(q,))
        w.start()
        writer = q.get()
        w.join()
        adopted = writer in [c.pid for c in psutil.Process().children()]
        ended = orphans.reap()
        print(json.dumps({"subreaper": subreaper, "writer": writer, "adopted": adopted, "ended": ended,
                          "worker_code": w.exitcode}))
""")


def _run(tmp_path, mode: str) -> dict:
    log = tmp_path / f"{mode}.log"  # a file, not a pipe: an orphan that holds the pipe would keep it open
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-c", SCRIPT, mode], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    out = log.read_text()
    assert code == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_launcher_adopts_and_ends_what_a_killed_worker_left_running(tmp_path):
    got = _run(tmp_path, "on")
    assert got["subreaper"] is True and got["worker_code"] == -9
    assert got["adopted"] is True and got["writer"] in got["ended"]  # (with spawn's resource tracker)
    assert not running(got["writer"])


def test_without_the_subreaper_the_writer_outlives_its_worker_and_the_launcher_cannot_see_it(tmp_path):
    got = _run(tmp_path, "off")  # torch elastic's own behaviour: the orphan goes to init, out of the launcher's reach
    try:
        assert got["adopted"] is False and got["ended"] == [] and running(got["writer"])
    finally:
        if running(got["writer"]):
            os.kill(got["writer"], 9)


def test_the_agent_ends_the_orphans_whenever_it_stops_its_workers(monkeypatch):
    calls = []
    monkeypatch.setattr(agent.LocalElasticAgent, "_shutdown", lambda self, death_sig=None: calls.append("workers"))
    monkeypatch.setattr(orphans, "reap", lambda keep=frozenset(), timeout=5.0: calls.append("orphans") or [])
    agent.InPlaceAgent._shutdown(object.__new__(agent.InPlaceAgent))
    assert calls == ["workers", "orphans"]
