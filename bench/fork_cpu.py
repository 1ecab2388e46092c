"""Where the suite's forked processes spend their CPU: tests/support/forkserver.py serves `make test`'s xdist workers,
the warm parents (tests/support/zygote.py) and the CLI runs of the tests, and the warm parents serve the trainer
launches. With ``KUBETITAN_FORKSERVER_LOG=FILE`` both write one line per fork they reap: its CPU (``wait4``'s user +
system, the processes it reaped included), its wall time, its first arguments, the test that started it
(``PYTEST_CURRENT_TEST`` of the requester) and who forked it. The same file gets one line per process that ran cold
instead (no server for its environment):

    KUBETITAN_FORKSERVER_LOG=/tmp/fork.log python -m pytest -n 5 --dist loadgroup --no-loadscope-reorder tests
    python bench/fork_cpu.py /tmp/fork.log [--top 30]

A fork's figure includes every process it reaped (a launcher's workers; an xdist worker's cold subprocesses,
operators and control plane), so a warm parent's line includes its forks' lines: the kinds overlap, the total is an
upper bound. Processes that the pytest controller starts itself are not here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def kind(argv: list[str]) -> str:
    """A short name for a fork: ``-m MODULE``, an xdist worker, ``-c`` and the code's first line, or the script."""
    args = [a for a in argv if a not in ("-u", "-B", "-S", "-I")]
    if not args:
        return "?"
    if args[0] == "-m" and len(args) > 1:
        return "-m " + args[1] + (" " + args[2] if len(args) > 2 and not args[2].startswith("-") and "/" not in args[2]
                                  else "")
    if args[0] == "-c" and len(args) > 1 and "exec(eval(sys.stdin.readline()))" in args[1]:
        return "xdist worker (its tests and the processes it reaped: cold starts, operators, the control plane)"
    if args[0] == "-c" and len(args) > 1:
        lines = [ln.strip() for ln in args[1].splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return "-c " + (lines[0][:60] if lines else "")
    return os.path.basename(args[0])  # a script (the warm parents: zygote.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    forks, cold, bad = [], collections.Counter(), 0
    with open(a.log) as f:
        for line in f:
            if line.startswith("forkserver: cpu "):
                try:
                    forks.append(json.loads(line[len("forkserver: cpu "):]))
                except json.JSONDecodeError:
                    bad += 1
            elif line.startswith(("forkrun: no server", "forkserver: cold")):
                cold[line.rstrip()[:120]] += 1
    total = sum(r["cpu"] for r in forks)
    print(f"{len(forks)} forks, {total:.1f} CPU s (a parent's figure includes its forks'); "
          f"{sum(cold.values())} cold starts" + (f"; {bad} unreadable lines skipped" if bad else ""))
    none = "(no test: xdist workers, warm parents, e2e pods)"
    for title, key in (("by kind", lambda r: f'{r.get("parent", "server")}: {kind(r["argv"])}'),
                       ("by test file", lambda r: r["test"].split("::")[0] or none),
                       ("by test", lambda r: r["test"].rsplit(" ", 1)[0] or none)):
        cpu, n = collections.Counter(), collections.Counter()
        for r in forks:
            cpu[key(r)] += r["cpu"]
            n[key(r)] += 1
        print(f"\n{title}: CPU s, forks")
        for k, v in cpu.most_common(a.top):
            print(f"  {v:7.1f} {n[k]:5d}  {k}")
    if cold:
        print("\ncold starts:")
        for k, v in cold.most_common(a.top):
            print(f"  {v:5d}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
