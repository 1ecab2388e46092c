"""Operator benchmark against kmockx (prints numbers; not a test). Run: .venv/bin/python bench/operator_bench.py

1. apply -> all pods created, for a 64-node gang;
2. 500 LlamaPretrains applied at once -> time until every one has its pods and a status, operator RSS;
3. a pod failure -> the next attempt's pods created.

The operator runs in-process (its thread) next to the kmock server (its own thread), so RSS is the
whole process: operator + kmock + the test harness (an upper bound for the operator alone).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kmockx.harness import NS, Cluster, Operator, cpu_spec, lpt, wait_for  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gang_64() -> float:
    with Cluster() as c, Operator(c, scan_interval=5.0):
        t0 = time.perf_counter()
        c.apply(lpt("big", cpu_spec(nodes=64)))
        wait_for(lambda: len(c.list("v1/pods", NS, "kubetitan.io/name=big")) == 64, 30, "64 pods", every=0.01)
        return time.perf_counter() - t0


def many(n: int = 500) -> tuple[float, float, float]:
    with Cluster() as c, Operator(c, scan_interval=10.0):
        base = rss_mb()
        t0 = time.perf_counter()
        for i in range(n):
            c.apply(lpt(f"j{i}", cpu_spec(nodes=1)))
        applied = time.perf_counter() - t0

        def done() -> bool:
            pods = len(c.list("v1/pods", NS))
            with_status = sum(1 for o in c.list("kubetitan.io/v1alpha1/llamapretrains", NS)
                              if (o.get("status") or {}).get("phase") == "Starting")
            return pods >= n and with_status >= n

        wait_for(done, 300, f"{n} runs reconciled", every=0.5)
        total = time.perf_counter() - t0
        return applied, total, rss_mb() - base


def recovery() -> float:
    with Cluster() as c, Operator(c, scan_interval=5.0):
        c.apply(lpt("rec", cpu_spec(nodes=8)))
        wait_for(lambda: len(c.pod_names(NS, "rec")) == 8, 30, "pods")
        for r in range(8):
            c.run_pod(NS, f"rec-a0-{r}", f"node-{r}")
        time.sleep(0.3)
        t0 = time.perf_counter()
        c.terminate_pod(NS, "rec-a0-3", 1)
        wait_for(lambda: sum(n.startswith("rec-a1-") for n in c.pod_names(NS, "rec")) == 8, 30, "attempt 1")
        return time.perf_counter() - t0


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(f"apply -> all 64 pods created (64-node gang):     {gang_64():.3f} s   (target < 1 s)")
    print(f"pod failure -> next attempt's 8 pods created:    {recovery():.3f} s   (target < 5 s; backoffSeconds=0)")
    applied, total, rss = many()
    print(f"500 LlamaPretrains: applied in {applied:.2f} s, all reconciled (pods + status) after {total:.2f} s")
    print(f"process RSS {rss_mb():.0f} MB (+{rss:.0f} MB for 500 runs; operator + kmock + harness)  (target < 200 MB)")
