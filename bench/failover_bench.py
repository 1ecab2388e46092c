"""Leader fail-over against kmockx (prints numbers; asserts no timing).

    .venv/bin/python bench/failover_bench.py [--lease 15] [--deadline 10] [--retry 2] [--rounds 2]
                                             [--mode release|crash|partition ...]

Two ``kubetitan operator --leader-elect`` processes (the CLI code path, the chart's default terms unless given)
and one run of one pod. Each round:

- ``release``: the leader gets SIGTERM (it releases the Lease): seconds until the standby holds the Lease, and
  until its first write of the run (a status patch after a pod event), until the old leader's last Lease update
  (its release) and until its process ended (the hand-off is timed from the signal, not from the exit);
- ``crash``: the leader gets SIGKILL (no release): the same two times; the standby waits out the lease duration
  after the record last changed, so this is about ``lease`` + up to ``retry`` x 2.2;
- ``partition``: the leader's Lease updates get 503 (it keeps running): seconds until its last write (its fence
  closes ``deadline`` after the last renewal it sent) and until the standby holds the Lease.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "operator"), str(ROOT / "operator" / "core")]

from kmockx.harness import NS, RELEASE_NS, Cluster, OperatorProcess, cpu_spec, lpt, wait_for  # noqa: E402

LEASES = "coordination.k8s.io/v1/leases"


def _holder(c: Cluster) -> str:
    return ((c.get(LEASES, RELEASE_NS, "bench") or {}).get("spec") or {}).get("holderIdentity") or ""


def _first_write(c: Cluster, ident: str, after: float, timeout: float) -> float:
    def seen() -> float | None:
        return next((e.time for e in list(c.k.log) if e.time > after and f"({ident})" in e.agent
                     and e.verb in ("create", "update", "patch", "delete") and "/leases" not in e.path), None)
    return wait_for(seen, timeout, f"{ident}'s first write", every=0.01)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lease", type=float, default=15.0)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--retry", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mode", choices=["release", "crash", "partition"], action="append",
                   help="run only this kind of round (repeatable; default all three)")
    a = p.parse_args(argv)
    out: dict[str, list[dict[str, float]]] = {m: [] for m in a.mode or ("release", "crash", "partition")}
    wait = 3 * a.lease + 10

    def args(ident: str) -> tuple[str, ...]:
        return ("--namespace", NS, "--scan-interval", "1", "--leader-elect", "--leader-elect-identity", ident,
                "--leader-elect-resource-name", "bench", "--leader-elect-resource-namespace", RELEASE_NS,
                "--leader-elect-lease-duration", str(a.lease), "--leader-elect-renew-deadline", str(a.deadline),
                "--leader-elect-retry-period", str(a.retry))

    for rnd in range(a.rounds):
        for mode in out:
            with Cluster() as c:
                ops = {i: OperatorProcess(c.kubeconfig, *args(i)).start() for i in ("first", "second")}
                try:
                    leader = wait_for(lambda: _holder(c), wait, "a leader")
                    standby = "second" if leader == "first" else "first"
                    c.apply(lpt("fo", cpu_spec(nodes=1)))
                    wait_for(lambda: c.pod_names(NS, "fo") == ["fo-a0-0"], 30, "the pod")
                    time.sleep(a.retry)  # a renewal or two in between
                    t0 = time.monotonic()
                    exited: list[float] = []
                    if mode == "release":
                        proc = ops[leader].proc
                        proc.send_signal(signal.SIGTERM)  # not stop(): that waits for the exit
                        threading.Thread(target=lambda p=proc: (p.wait(), exited.append(time.monotonic())),
                                         daemon=True).start()
                    elif mode == "crash":
                        ops[leader].kill()
                    else:
                        c.k.inject(code=503, resource="leases", verbs={"update"}, agent=f"({leader})")
                    wait_for(lambda: _holder(c) == standby, wait, "the standby takes over", every=0.01)
                    took = time.monotonic() - t0
                    c.run_pod(NS, "fo-a0-0", "node-0")  # something to write about
                    first = _first_write(c, standby, t0, 30) - t0
                    row = {"takeover_s": round(took, 2), "standby_first_write_s": round(first, 2)}
                    if mode == "release":
                        wait_for(lambda: exited, 30, "the old leader's exit")
                        row["leader_exit_s"] = round(exited[0] - t0, 2)
                        released = [e.time for e in list(c.k.log) if e.time > t0 and f"({leader})" in e.agent
                                    and e.verb == "update" and "/leases" in e.path]
                        row["lease_released_s"] = round(released[-1] - t0, 2) if released else None
                    if mode == "partition":
                        last = max((e.time for e in list(c.k.log) if f"({leader})" in e.agent and e.verb in (
                            "create", "update", "patch", "delete") and "/leases" not in e.path), default=t0)
                        row["old_leader_last_write_s"] = round(last - t0, 2)
                    out[mode].append(row)
                    print(json.dumps({"round": rnd, "mode": mode, **row}), flush=True)
                finally:
                    for op in ops.values():
                        if op.proc is not None and op.proc.poll() is None:
                            op.stop()
                        os.unlink(op.log_path)
    print(json.dumps({"lease": a.lease, "deadline": a.deadline, "retry": a.retry, "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
