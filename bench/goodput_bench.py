"""Goodput under injected faults (issue 8): prints numbers, not a test.

The REAL operator (in-process kopf) and the REAL trainer (torchrun + torchtitan's debug model on CPU,
gloo) run against kmockx with the e2e kubelet double (tests/e2e/kubelet.py): 2 "nodes" x 1 process.
One run kills one rank's processes (SIGKILL, alternating ranks) every ``--kill-every`` steps; a second,
identical run has no faults. Reported:

- goodput = productive step time / wall time since apply (productive: the step time of every step
  that the final model kept, i.e. the last occurrence of each step number in rank 0's step log);
- time to recover per failure = kill -> first step of the next attempt (p50 / max);
- lost steps per failure = steps trained before the kill that the next attempt trained again;
- restart-cause accuracy = status.restarts causes equal to the injected fault's (``ContainerFailed``).

    .venv/bin/python bench/goodput_bench.py --steps 600 --kill-every 100 --interval 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from common import CLAIM, NS, e2e_spec, free_port, lpt, step_log  # noqa: E402
from kubelet import Kubelet  # noqa: E402

from kmockx.harness import Cluster, Operator  # noqa: E402
from kubetitan.decide import parse_time  # noqa: E402


def run(steps: int, interval: int, kill_every: int | None, timeout: float, async_mode: str = "disabled",
        kill_offset: int = 0) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="goodput-"))
    ckpt = tmp / "ckpt"
    kills: list[dict] = []
    with Cluster() as c, Kubelet(c, tmp / "kubelet", claims={CLAIM: ckpt}) as k, Operator(c, namespaces=(NS,)):
        t0 = time.time()
        spec = e2e_spec(ckpt, steps, interval, free_port(), hangTimeoutSeconds=120)
        spec["checkpoint"]["asyncMode"] = async_mode
        c.apply(lpt("goodput", spec))
        next_kill = kill_every + kill_offset if kill_every else None
        while time.time() - t0 < timeout:
            st = c.status(NS, "goodput")
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            step = (st.get("training") or {}).get("step") or 0
            attempt = st.get("attempt") or 0
            if next_kill is not None and step >= next_kill and next_kill < steps:
                rank = len(kills) % 2
                pod = f"goodput-a{attempt}-{rank}"
                log = step_log(ckpt)
                try:
                    k.kill(NS, pod)
                except KeyError:  # the status is ahead of the kubelet: look again
                    time.sleep(0.1)
                    continue
                kills.append({"time": time.time(), "pod": pod, "step": log[-1]["step"] if log else step})
                next_kill += kill_every
            time.sleep(0.1)
        wall = time.time() - t0
        st = c.status(NS, "goodput")
    (tmp / "raw.json").write_text(json.dumps({"status": st, "kills": kills, "wall_s": wall}))  # re-analysable
    print(f"  raw data: {tmp}/raw.json, {ckpt}/kubetitan/steps.jsonl", flush=True)
    log = step_log(ckpt)
    restarts = st.get("restarts") or []
    # Where each new attempt starts in rank 0's step log: the first record more than 1 s after the restart was
    # recorded (rank 0 of the ended attempt is blocked in a collective or gone by then; status times are whole
    # seconds). A resume right after a checkpoint continues the step numbers, so the numbers alone cannot split it.
    starts: list[int] = []
    for r in restarts:
        t = parse_time(r["time"]) + 1.0
        j = next((i for i, x in enumerate(log) if x["time"] > t), None)
        if j is not None:
            starts.append(j)
    bounds = [0, *starts, len(log)]
    segs = [log[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    # productive time: the duration of each kept step (the last occurrence of each step number)
    kept: dict[int, float] = {}
    for seg in segs:
        gaps = [b["time"] - a["time"] for a, b in zip(seg, seg[1:], strict=False)]
        first = statistics.median(gaps) if gaps else 0.0
        for i, r in enumerate(seg):
            kept[r["step"]] = first if i == 0 else seg[i]["time"] - seg[i - 1]["time"]
    productive = sum(kept.values())
    recover, lost, downtime_ok = [], [], []
    for kill, r, j in zip(kills, restarts, starts, strict=False):
        first = log[j]
        recover.append(first["time"] - kill["time"])
        lost.append(log[j - 1]["step"] - (first["step"] - 1))  # trained by the killed attempt, trained again
        # the operator's downtimeSeconds must end at this first trained step
        if r.get("downtimeSeconds") is not None:
            downtime_ok.append(abs(parse_time(r["time"]) + r["downtimeSeconds"] - first["time"]) < 1.0)
    causes = [r["cause"] for r in st.get("restarts") or []]
    right = sum(1 for c_ in causes if c_ == "ContainerFailed")
    return {"phase": st.get("phase"), "final_step": (st.get("training") or {}).get("step"), "wall_s": round(wall, 1),
            "productive_s": round(productive, 1), "goodput": round(productive / wall, 4) if wall else None,
            "status_goodput": (st.get("training") or {}).get("goodput"), "faults": len(kills),
            "restarts": st.get("restartCount"), "recover_s": [round(x, 1) for x in recover],
            "recover_p50_s": round(statistics.median(recover), 1) if recover else None,
            "recover_max_s": round(max(recover), 1) if recover else None, "lost_steps": lost,
            "cause_accuracy": round(right / len(kills), 3) if kills else None, "causes": causes,
            "resumed_from": [r.get("resumedFromStep") for r in restarts],
            "status_lost_steps": [r.get("lostSteps") for r in restarts],
            "status_downtime_s": [r.get("downtimeSeconds") for r in restarts],
            "downtime_ends_at_first_step": all(downtime_ok) if downtime_ok else None,
            "step_seconds_p50": round(statistics.median(
                [b["time"] - a["time"] for s_ in segs for a, b in zip(s_, s_[1:], strict=False)]), 3) if log else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--interval", type=int, default=50, help="checkpoint.intervalSteps")
    p.add_argument("--kill-every", type=int, default=100)
    p.add_argument("--kill-offset", type=int, default=0,
                   help="kill at kill-every x k + this many steps (0: on multiples of --kill-every, which are "
                        "checkpoint steps whenever the interval divides it, so every kill cuts a save short)")
    p.add_argument("--async-mode", default="disabled", choices=("disabled", "async"), help="checkpoint.asyncMode")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--only", choices=("faults", "baseline"), help="run just one of the two runs")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    out = {"args": vars(a) | {"json": str(a.json) if a.json else None}}
    if a.only != "baseline":
        out["faults"] = run(a.steps, a.interval, a.kill_every, a.timeout, a.async_mode, a.kill_offset)
        print("with faults:", json.dumps(out["faults"]), flush=True)
    if a.only != "faults":
        out["baseline"] = run(a.steps, a.interval, None, a.timeout, a.async_mode)
        print("fault-free: ", json.dumps(out["baseline"]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if "faults" not in out:
        return 0
    f, b = out["faults"], out.get("baseline", {})
    if f["goodput"] and b.get("goodput"):
        out["goodput_vs_fault_free"] = round(f["goodput"] / b["goodput"], 3)
    print(f"goodput {f['goodput']} (fault-free {out.get('baseline', {}).get('goodput')}, "
          f"ratio {out.get('goodput_vs_fault_free')}); recover p50 {f['recover_p50_s']} s max {f['recover_max_s']} s; "
          f"lost steps {f['lost_steps']} (interval {a.interval}); cause accuracy {f['cause_accuracy']}")
    if b.get("wall_s") and f["faults"]:
        # Unproductive wall time (wall - productive step time) over the baseline's, so that the two runs'
        # step speeds (the machine's load) do not count as fault cost.
        idle = (f["wall_s"] - f["productive_s"]) - (b["wall_s"] - b["productive_s"])
        out["unproductive_s_per_fault"] = round(idle / f["faults"], 1)
        print(f"each fault cost {out['unproductive_s_per_fault']} s of unproductive wall time: recover p50 {f['recover_p50_s']} s "
              f"+ lost steps {statistics.mean(f['lost_steps']) if f['lost_steps'] else 0:.1f} x {f['step_seconds_p50']} s")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
