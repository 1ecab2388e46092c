"""One row per injected fault of an in-place run's log (bench/device/inplace_faults_gpu.sh): fault -> restart decided
-> state loaded (or kept: a fault before the optimizer step loads nothing) -> the end of the first trained step after
it, in seconds from the fault's own log line, and whether the process stayed the same (its pid in the restart lines).

    python bench/inplace_faults_table.py RUN_LOG
"""

from __future__ import annotations

import re
import sys
from datetime import datetime

STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
FAULT = re.compile(r"Injected fault '(\w+)' at rank \d+ step (\d+)")
RESTART = re.compile(r"In-process restart (\d+): .*restarting in-process")
REBOUND = re.compile(r"In-process restart \d+: process groups re-bound.*\(pid (\d+)\)")
FIRST_PID = re.compile(r"In-process restarts on: .*\(pid (\d+)\)")
LOADED = re.compile(r"Loaded step (\d+) from the restore tier|In-process restart: every rank kept the state of step (\d+)")
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)")


def stamp(line: str) -> float | None:
    m = STAMP.search(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def rows(lines: list[str]) -> tuple[list[dict], str | None]:
    out: list[dict] = []
    first_pid = None
    cur: dict | None = None
    for raw in lines:
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw)
        t = stamp(line)
        if (m := FIRST_PID.search(line)) and first_pid is None:
            first_pid = m.group(1)
        if (m := FAULT.search(line)) and t is not None:
            cur = {"kind": m.group(1), "fault_step": int(m.group(2)), "t": t}
            out.append(cur)
        elif cur is None or t is None:
            continue
        elif RESTART.search(line) and "restart_s" not in cur:
            cur["restart_s"] = t - cur["t"]
        elif (m := REBOUND.search(line)) and "pid" not in cur:
            cur["pid"] = m.group(1)
        elif (m := LOADED.search(line)) and "loaded_s" not in cur:
            cur["loaded_s"], cur["loaded_step"] = t - cur["t"], int(m.group(1) or m.group(2))
            cur["kept"] = m.group(2) is not None
        elif (m := STEP.search(line)) and "loaded_s" in cur and "first_step_s" not in cur:
            cur["first_step_s"], cur["first_step"] = t - cur["t"], int(m.group(1))
    return out, first_pid


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    found, first_pid = rows(open(argv[0], errors="replace").read().splitlines())
    if not found:
        print("no injected fault in the log")
        return 1
    print("| fault | at step | restart decided | state loaded (step) | first step end (step) | same process |")
    print("|---|---|---|---|---|---|")
    ok = True
    for r in found:
        def s(key: str) -> str:
            return f"{r[key]:.2f} s" if key in r else "—"
        same = "yes" if r.get("pid") and r.get("pid") == first_pid else f"no ({r.get('pid')} vs {first_pid})"
        ok &= "first_step_s" in r and same == "yes"
        held = f"{r.get('loaded_step', '—')}{', kept' if r.get('kept') else ''}"
        print(f"| {r['kind']} | {r['fault_step']} | {s('restart_s')} | {s('loaded_s')} ({held}) | "
              f"{s('first_step_s')} ({r.get('first_step', '—')}) | {same} |")
    print("(seconds from the fault's own log line; a hang's include its detection, the progress timeout)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
