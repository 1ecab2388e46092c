"""CPU of every process on the machine while a command runs, summed by kind of process: each process's own
utime + stime (not its children's), read from /proc every 0.5 s; a process that lives less than 0.5 s is missed, and
processes that ran before the first read count from there. Where a suite's CPU goes by program (the tests' own
processes, the warm parent's forks, the control plane, operators):

    python bench/proc_cpu.py OUT.json -- python -m pytest -n 4 --dist loadgroup tests
    python bench/proc_cpu.py OUT.json            # print a saved summary

Kinds: the control plane's programs by name; ``pytest-controller`` (``python -m pytest``); ``python:-u`` (xdist's
workers: the tests that run in process); ``python:zygote.py`` (the tests' warm parent and its forks: launchers,
workers, e2e pods); ``pytest-path:ARGS`` (a process whose arguments name a pytest temporary path: operators, CLI runs,
cold launches); ``py-m:MODULE``; ``trainer:...`` (a ``python -c`` script of the trainer tests).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
NAMES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "helm", "kubectl", "prometheus",
         "moto_server", "promtool")


def kind(pid: int) -> str | None:
    try:
        raw = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return None
    cmd = [c.decode(errors="replace") for c in raw if c]
    if not cmd:
        return "kernel"
    line = " ".join(cmd)
    for name in NAMES:
        if name in line:
            return name
    if "-m" in cmd and cmd[cmd.index("-m") + 1:cmd.index("-m") + 2] == ["pytest"]:
        return "pytest-controller"
    if "xdist" in line or "pytest" in line:
        return "pytest-path:" + " ".join(w for w in cmd[1:6] if not w.startswith("/"))[:80]
    if "kubetitan_trainer" in line or "torchrun" in line:
        return "trainer:" + next((c for c in cmd if c.startswith(("kubetitan_trainer", "tests."))), cmd[-1])[:50]
    if "-m" in cmd:
        return "py-m:" + (cmd[cmd.index("-m") + 1] if cmd.index("-m") + 1 < len(cmd) else "?")
    return os.path.basename(cmd[0])[:20] + ":" + (os.path.basename(cmd[1])[:40] if len(cmd) > 1 else "")


def sample(total: collections.Counter, last: dict, first: bool) -> None:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        cpu, key = (int(rest[11]) + int(rest[12])) / TICK, (int(d), rest[19])  # (pid, start time): pids are reused
        if key in last:
            total[last[key][1]] += cpu - last[key][0]
            last[key] = (cpu, last[key][1])
        elif (k := kind(int(d))) is not None:
            last[key] = (cpu, k)
            if not first:
                total[k] += cpu


def main(argv: list[str]) -> int:
    out, cmd = argv[0], argv[2:] if len(argv) > 1 and argv[1] == "--" else []
    if cmd:
        total: collections.Counter = collections.Counter()
        last: dict = {}
        proc = subprocess.Popen(cmd)
        first = True
        while proc.poll() is None:
            sample(total, last, first)
            first = False
            time.sleep(0.5)
        sample(total, last, False)
        with open(out, "w") as f:
            json.dump({"command": cmd, "returncode": proc.returncode, "cpu": total.most_common()}, f, indent=0)
    saved = json.load(open(out))
    print(f"{' '.join(saved['command'])}: exit {saved['returncode']}, {sum(v for _, v in saved['cpu']):.0f} CPU s")
    for k, v in saved["cpu"]:
        if v >= 0.1:
            print(f"{v:7.1f}  {k!r}")
    return 0 if not cmd else proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
