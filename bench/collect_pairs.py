#!/usr/bin/env python3
"""Collect every pair of test directories (``pytest --collect-only -q tests/A tests/B``, each in a fresh
interpreter) and print one line per pair: ok/FAILED, the tests collected, the CPU seconds it took.

    python bench/collect_pairs.py                # every pair (and every directory alone), in both orders
    python bench/collect_pairs.py --one-order    # each unordered pair once

A pair fails when the two directories' modules clash (two conftests imported as ``conftest``, two helpers with
one name); tests/test_layout.py checks the causes statically and collects tests/api with tests/operator in the
suite. Slow (a minute or more of CPU per ten pairs, the torch-importing directories most): run it by hand."""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_dirs() -> list[str]:
    return sorted(f"tests/{d.name}" for d in (REPO / "tests").iterdir()
                  if d.is_dir() and any(d.rglob("test_*.py")))


def collect(args: list[str]) -> tuple[bool, str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    return r.returncode == 0, last if r.returncode == 0 else (r.stdout + r.stderr)[-3000:], cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-order", action="store_true", help="each unordered pair once")
    args = ap.parse_args(argv)
    dirs = test_dirs()
    runs = [[d] for d in dirs] + [list(p) for p in (itertools.combinations(dirs, 2) if args.one_order
                                                     else itertools.permutations(dirs, 2))]
    print(f"{len(dirs)} test directories, {len(runs)} collections; load {os.getloadavg()[0]:.1f}", flush=True)
    failed, total_cpu, t0 = 0, 0.0, time.monotonic()
    for run in runs:
        ok, what, cpu = collect(run)
        total_cpu += cpu
        failed += not ok
        print(f"{'ok    ' if ok else 'FAILED'} {cpu:6.1f} s CPU  {' '.join(run)}: {what}", flush=True)
    print(f"{len(runs) - failed} of {len(runs)} collected; {total_cpu:.0f} s CPU, {time.monotonic() - t0:.0f} s wall; "
          f"load {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
