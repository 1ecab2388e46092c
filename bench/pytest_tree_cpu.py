"""A pytest plugin that charges each test the CPU time of its process tree: the xdist worker and every process
below it (the warm parents, trainers, operators, API doubles), read from /proc before and after the test
(utime + stime + cutime + cstime of each live descendant). Writes one JSON list per worker, [nodeid, CPU s, wall s, start (epoch s)]:

    PYTHONPATH=bench KUBETITAN_TREE_CPU_DIR=/tmp/cpu python -m pytest -p pytest_tree_cpu -n 3 --dist loadgroup tests
    python bench/pytest_tree_cpu.py /tmp/cpu            # per directory, per file, the slowest tests

A process that ends during a test is counted through its parent's cutime when the parent reaps it; one that another
test's process reaps is charged to that test. Session fixtures' processes are charged to the tests that run while
they work. Good to a few percent for finding where the CPU goes, not a benchmark.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

TICK = os.sysconf("SC_CLK_TCK")
_OUT: list[tuple[str, float, float]] = []


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and every live process below it (their reaped children included)."""
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append(int(d))
        cpu[int(d)] = sum(int(x) for x in rest[11:15]) / TICK
    total, stack = 0.0, [root]
    while stack:
        p = stack.pop()
        total += cpu.get(p, 0.0)
        stack.extend(kids.get(p, []))
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0, start = tree_cpu(os.getpid()), time.monotonic(), time.time()
    yield
    _OUT.append((item.nodeid, tree_cpu(os.getpid()) - c0, time.monotonic() - t0, start))


def pytest_sessionfinish(session):
    out = os.environ.get("KUBETITAN_TREE_CPU_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"cpu_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json"), "w") as f:
            json.dump(_OUT, f)


def main(folder: str, top: int = 40, timeline: bool = True) -> None:
    rows = [r for f in glob.glob(os.path.join(folder, "cpu_*.json")) for r in json.load(open(f))]
    print(f"{len(rows)} tests, {sum(r[1] for r in rows):.0f} CPU s in their process trees")
    by_dir: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    for nodeid, c, *_ in rows:
        path = nodeid.split("::")[0]
        by_file[path] += c
        by_dir["/".join(path.split("/")[:2])] += c
    print("by directory:", ", ".join(f"{d} {c:.0f}" for d, c in by_dir.most_common()))
    for path, c in by_file.most_common(top):
        print(f"{c:7.1f}  {path}")
    if timeline:
        print("per worker: busy from its first test's start to its last test's end")
        for f in sorted(glob.glob(os.path.join(folder, "cpu_*.json"))):
            mine = [r for r in json.load(open(f)) if len(r) > 3]
            if mine:
                t0 = min(r[3] for r in rows if len(r) > 3)
                print(f"  {os.path.basename(f)}: {min(r[3] for r in mine) - t0:6.1f} -> "
                      f"{max(r[3] + r[2] for r in mine) - t0:6.1f} s, {len(mine)} tests, "
                      f"{sum(r[1] for r in mine):.0f} CPU s")
    print("slowest tests (CPU s, wall s):")
    for nodeid, c, w, *_ in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{c:6.1f} {w:6.1f}  {nodeid}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
