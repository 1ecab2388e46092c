"""The GIL convoy between a compiling thread and a background tier copy, on CPU (restore_tier's
``defer_switch_interval_ms``, ``spec.runtime.deferSwitchIntervalMs``).

On an H100 (bench/device/recovery_knobs_vs_baseline.sh and recovery_deferred_copy.sh, docs/reliability.md) the optimizer's part of a tier load, copied in the background
on 4 threads while the first step compiled, ran at 5-7 GB/s against 16 GB/s alone. Each chunk a copy thread moves
releases the GIL for its system call and must take it back afterwards; while another thread runs Python (Dynamo's
trace is pure Python), that takes until the holder releases it on its own or the switch interval (5 ms) runs out.
This probe isolates that: a main thread runs a fixed amount of pure Python while one copy thread reads a
``/dev/shm`` file in chunks with ``os.preadv`` (the tier's ``pread`` mode) into one preallocated buffer, for several
switch intervals. Printed per interval: the Python work's seconds, the copy's chunks a second and GB/s, alone and
together.

    python bench/gil_convoy_probe.py [--mib 512] [--chunk-mib 8] [--intervals 5,1,0.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time


def python_work(n: int = 25_000_000) -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i % 7
    return time.perf_counter() - t0


def copy(fd: int, size: int, chunk: int, rounds: int, stop: threading.Event | None = None) -> tuple[int, float]:
    buf = memoryview(bytearray(chunk))
    n, t0 = 0, time.perf_counter()
    for _ in range(rounds):
        for off in range(0, size, chunk):
            os.preadv(fd, [buf], off)
            n += 1
            if stop is not None and stop.is_set():
                return n, time.perf_counter() - t0
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--intervals", default="5,1,0.5", help="switch intervals, ms")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    chunk, size = a.chunk_mib << 20, a.mib << 20
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    default = sys.getswitchinterval()
    with tempfile.NamedTemporaryFile(dir=folder, prefix="gil-convoy-") as f:
        f.write(os.urandom(1 << 20) * a.mib)
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            copy(fd, size, chunk, 1)  # pages in, buffer warm
            print(f"{len(os.sched_getaffinity(0))} CPUs; {a.mib} MiB from {folder} in {a.chunk_mib} MiB chunks")
            print("| switch interval | Python work alone s | with the copy s | copy alone GB/s | copy beside the Python "
                  "work GB/s (chunks/s) |")
            print("|---|---|---|---|---|")
            for ms in [float(v) for v in a.intervals.split(",")]:
                sys.setswitchinterval(ms / 1000)
                alone, beside, c_alone, c_beside, rate = [], [], [], [], []
                for _ in range(a.repeats):
                    alone.append(python_work())
                    n, s = copy(fd, size, chunk, 4)
                    c_alone.append(n * chunk / s / 1e9)
                    stop, box = threading.Event(), {}
                    t = threading.Thread(target=lambda: box.setdefault("r", copy(fd, size, chunk, 10**6, stop)))
                    t.start()
                    beside.append(python_work())
                    stop.set()
                    t.join()
                    n, s = box["r"]
                    c_beside.append(n * chunk / s / 1e9)
                    rate.append(n / s)
                med = statistics.median
                print(f"| {ms:g} ms | {med(alone):.2f} | {med(beside):.2f} | {med(c_alone):.1f} | "
                      f"{med(c_beside):.1f} ({med(rate):.0f}) |", flush=True)
        finally:
            os.close(fd)
            sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
