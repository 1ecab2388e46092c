"""Where the operator's memory goes: the operator bench's ``many`` scenario with ``bench/memhook`` in the operator,
dumped at the scenario's steps (measurement, not product code).

    KUBETITAN_MEMHOOK_DIR=/tmp/mem .venv/bin/python bench/memhook/where.py [--server double|real] [--runs 2000]
                                                                          [--trace] [--every S] [--operator-src DIR]

Dumps (``DIR/dump<n>_<pid>.txt``, see ``sitecustomize.py``): the operator idle, before the first apply; with
``--every S``, every S seconds from the first apply on (what the burst holds); ten seconds after every run is
``Starting`` (the bench's "settled" point). ``--trace`` starts tracemalloc right after
the idle dump (the allocations of the burst and after are traced; the operator runs several times slower and its
RSS includes tracemalloc's own tables). A dump allocates too (the object walk and its sets of ids: tens of MiB,
part of which the allocators keep), so the RSS of a run with dumps is not the bench's number. ``--operator-src``
as the bench's (the memhook directory is put first on the operator's ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import operator_bench as ob  # noqa: E402


class _Steps:
    """``time`` for the bench module: its idle wait (2 s) and settle wait (10 s) also dump the operator."""

    def __init__(self, trace: bool, every: float | None) -> None:
        self.trace, self.every = trace, every
        self.op: Any = None
        self.dumps = 0
        self.lock = threading.Lock()
        self.settled = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        if seconds in (2.0, 10.0) and self.op is not None:
            self.dump(f"{'idle, before the first apply' if seconds == 2.0 else 'settled: 10 s after all Starting'}")
            if seconds == 2.0 and self.trace:
                os.kill(self.op.pid, signal.SIGUSR2)
            if seconds == 2.0 and self.every:
                threading.Thread(target=self._periodic, daemon=True).start()

    def _periodic(self) -> None:
        start = time.monotonic()
        while not self.settled.wait(self.every):
            self.dump(f"{time.monotonic() - start:.0f} s after the first apply")

    def dump(self, what: str) -> None:
        if what.startswith("settled"):
            self.settled.set()
        with self.lock:  # one dump at a time (the operator numbers them in the order it receives the signals)
            self.dumps += 1
            path = Path(os.environ["KUBETITAN_MEMHOOK_DIR"]) / f"dump{self.dumps}_{self.op.pid}.txt"
            print(f"dump {self.dumps} ({what}): {self.op.memory_mb()} -> {path}", flush=True)
            t0 = time.monotonic()
            os.kill(self.op.pid, signal.SIGUSR1)
            ob.wait_for(path.exists, 600, f"the operator's dump {path}", every=0.2)
            print(f"  written in {time.monotonic() - t0:.1f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", choices=["double", "real"], default="double")
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--trace", action="store_true", help="tracemalloc from the idle dump on")
    p.add_argument("--every", type=float, metavar="S", help="also dump every S seconds from the first apply on")
    p.add_argument("--operator-src", metavar="DIR", default=f"{ob.ROOT / 'operator'}:{ob.ROOT / 'operator/core'}")
    a = p.parse_args()
    if not os.environ.get("KUBETITAN_MEMHOOK_DIR"):
        p.error("set KUBETITAN_MEMHOOK_DIR to the directory the operator writes its dumps to")
    ob.SERVER = ob.RealServer if a.server == "real" else ob.Server
    ob.OPERATOR_SRC = f"{HERE}:{a.operator_src}"
    steps = _Steps(a.trace, a.every)
    ob.time = steps
    start_operator = ob.operator

    def operator(*args: Any) -> Any:
        steps.op = start_operator(*args)
        return steps.op

    ob.operator = operator
    print(f"machine: {os.cpu_count()} CPUs, {ob._load()} at start; {a.runs} runs on {a.server}, "
          f"operator from {ob.OPERATOR_SRC}", flush=True)
    r = ob.many(None, a.runs)
    print(f"{a.runs} runs: {r} ({ob._load()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
