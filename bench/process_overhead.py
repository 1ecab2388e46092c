"""What a trainer process pays before its first line of work and after its last: importing torch and torchtitan,
and the interpreter's shutdown, with the garbage collector as Python leaves it and as ``kubetitan_trainer.main``
sets it (``imports_without_gc`` + ``exit_now``). Prints the median of ``--repeat`` fresh processes of each.

    python bench/process_overhead.py [--repeat 5]

Shutdown is the time from the last Python statement to the process's end, as its parent sees it: with plain
``sys.exit`` the interpreter's final collections walk every object torch and torchtitan created.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "kubetitan":
    from kubetitan_trainer.main import exit_now, imports_without_gc
    with imports_without_gc():
        import torchtitan.train  # noqa: F401
else:
    import torchtitan.train  # noqa: F401
print(json.dumps({"import_s": time.perf_counter() - t0, "end": time.time()}), flush=True)
if sys.argv[1] == "kubetitan":
    exit_now(0)
"""


def once(mode: str) -> tuple[float, float]:
    p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    gone = time.time()
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return got["import_s"], gone - got["end"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print(f"{'mode':<34}{'import torchtitan.train (s)':>28}{'shutdown (s)':>14}")
    for mode, label in (("plain", "python defaults"), ("kubetitan", "imports_without_gc + exit_now")):
        runs = [once(mode) for _ in range(a.repeat)]
        print(f"{label:<34}{statistics.median(r[0] for r in runs):>28.2f}"
              f"{statistics.median(r[1] for r in runs):>14.2f}")


if __name__ == "__main__":
    main()
