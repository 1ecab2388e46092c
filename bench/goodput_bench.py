"""Goodput under injected faults (worker, node and hang faults, recovered by re-created gangs or in place): prints numbers, not a test.

The REAL operator (in-process kopf) and the REAL trainer (the launcher, torchrun + torchtitan's debug model on
CPU, gloo) run against kmockx with the e2e kubelet double (tests/e2e/kubelet.py): 2 "nodes" x 1 process.
One run injects a fault every ``--kill-every`` steps (alternating ranks); a second, identical run has none.
``--fault``:

- ``worker``: SIGKILL the rank's worker processes only (its launcher lives on): in-place restart;
- ``container``: SIGKILL every process of the pod (the launcher too): the pod fails, the gang is re-created;
- ``node``: the rank's node goes NotReady (its processes freeze), then is lost: the gang is re-created;
- ``hang``: SIGSTOP the rank's workers: hang detection (``runPolicy.hangTimeoutPolicy``), then re-created.

Reported:

- goodput = productive step time / wall time since apply (productive: the step time of every step that the
  final model kept, i.e. the last occurrence of each step number in rank 0's step log);
- time to recover per fault = fault -> first trained step of the next attempt or worker generation (p50/max);
- lost steps per fault = steps trained before the fault that the next attempt/generation trained again;
- restart-cause accuracy = status.restarts causes equal to the injected fault's; the restart modes;
- hangs: fault -> the operator's restart decision (the Hang record's time), and Hang records in runs without a
  hang (false positives).

    .venv/bin/python bench/goodput_bench.py --steps 600 --kill-every 100 --interval 10 --fault worker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from common import free_port, step_log  # noqa: E402
from support.specs import CLAIM, NS, e2e_spec, lpt, with_debug_model  # noqa: E402
from kubelet import Kubelet  # noqa: E402

from kmockx.harness import Cluster, Operator  # noqa: E402
from kubetitan.timestamps import parse_time  # noqa: E402


EXPECTED_CAUSE = {"worker": "ContainerFailed", "container": "ContainerFailed", "node": "NodeFailure", "hang": "Hang"}


def _segments(log: list[dict]) -> list[list[dict]]:
    """Rank 0's step records split by the (attempt, worker generation) that trained them."""
    segs: list[list[dict]] = []
    for r in log:
        key = (r.get("attempt", 0), r.get("generation", 0))
        if not segs or key != (segs[-1][-1].get("attempt", 0), segs[-1][-1].get("generation", 0)):
            segs.append([])
        segs[-1].append(r)
    return segs


def run(steps: int, interval: int, kill_every: int | None, timeout: float, async_mode: str = "disabled",
        kill_offset: int = 0, fault: str = "worker", in_place: int = 10, nodes: int = 2) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="goodput-"))
    ckpt = tmp / "ckpt"
    kills: list[dict] = []
    with Cluster() as c, Kubelet(c, tmp / "kubelet", nodes=nodes, claims={CLAIM: ckpt}) as k, Operator(c, namespaces=(NS,)):
        t0 = time.time()
        spec = with_debug_model(e2e_spec(ckpt, steps, interval, free_port(), hangTimeoutSeconds=120,
                                          maxInPlaceRestarts=in_place))
        spec["checkpoint"]["asyncMode"] = async_mode
        c.apply(lpt("goodput", spec))
        next_kill = kill_every + kill_offset if kill_every else None
        lost_node: dict | None = None
        while time.time() - t0 < timeout:
            st = c.status(NS, "goodput")
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            if lost_node is not None:  # the node fault's second half: the machine is gone, then a new one joins
                if c.get("v1/pods", NS, lost_node["pod"]) is None:
                    k.crash_node_processes(lost_node["node"])
                    k.restore_node(lost_node["node"])
                    lost_node = None
                time.sleep(0.1)
                continue
            step = (st.get("training") or {}).get("step") or 0
            attempt = st.get("attempt") or 0
            gens = {(x.get("attempt"), x.get("generation")) for x in step_log(ckpt)[-3:]}
            settled = all(r.get("downtimeSeconds") is not None for r in st.get("restarts") or [])
            if next_kill is not None and step >= next_kill and next_kill < steps and settled and len(gens) == 1:
                rank = len(kills) % 2
                pod = f"goodput-a{attempt}-{rank}"
                log = step_log(ckpt)
                try:
                    if fault == "worker":
                        pids = k.kill_workers(NS, pod)
                        if not pids:
                            raise KeyError(pod)
                    elif fault == "container":
                        k.kill(NS, pod)
                    elif fault == "hang":
                        if not k.freeze(NS, pod):
                            raise KeyError(pod)
                    else:
                        node = c.get("v1/pods", NS, pod)["spec"]["nodeName"]
                        k.fail_node(node)
                        lost_node = {"pod": pod, "node": node}
                except (KeyError, TypeError):  # the status is ahead of the kubelet: look again
                    time.sleep(0.1)
                    continue
                kills.append({"time": time.time(), "pod": pod, "step": log[-1]["step"] if log else step})
                next_kill += kill_every
            time.sleep(0.1)
        wall = time.time() - t0
        st = c.status(NS, "goodput")
    (tmp / "raw.json").write_text(json.dumps({"status": st, "kills": kills, "wall_s": wall, "fault": fault}))
    print(f"  raw data: {tmp}/raw.json, {ckpt}/kubetitan/steps.jsonl", flush=True)
    log = step_log(ckpt)
    restarts = st.get("restarts") or []
    segs = _segments(log)
    # productive time: the duration of each kept step (the last occurrence of each step number)
    kept: dict[int, float] = {}
    for seg in segs:
        gaps = [b["time"] - a["time"] for a, b in zip(seg, seg[1:], strict=False)]
        first = statistics.median(gaps) if gaps else 0.0
        for i, r in enumerate(seg):
            kept[r["step"]] = first if i == 0 else seg[i]["time"] - seg[i - 1]["time"]
    productive = sum(kept.values())
    recover, lost, downtime_ok, detect = [], [], [], []
    for kill in kills:
        # the first segment that starts after the fault is the recovery; the one before it is the failed one
        j = next((i for i, sg in enumerate(segs) if i > 0 and sg[0]["time"] > kill["time"]), None)
        if j is None:
            continue
        first, prev = segs[j][0], segs[j - 1]
        recover.append(first["time"] - kill["time"])
        lost.append(max(0, prev[-1]["step"] - (first["step"] - 1)))  # trained before the fault, trained again
    for r, sg in zip(restarts, segs[1:], strict=False):
        if r.get("downtimeSeconds") is not None:  # the operator's downtime must end at that first trained step
            downtime_ok.append(abs(parse_time(r["time"]) + r["downtimeSeconds"] - sg[0]["time"]) < 1.0)
    for kill, r in zip(kills, restarts, strict=False):
        detect.append(parse_time(r["time"]) - kill["time"])  # fault -> the restart decision (record time)
    causes = [r["cause"] for r in restarts]
    right = sum(1 for c_ in causes if c_ == EXPECTED_CAUSE[fault])
    return {"fault": fault, "phase": st.get("phase"), "final_step": (st.get("training") or {}).get("step"),
            "wall_s": round(wall, 1), "productive_s": round(productive, 1),
            "goodput": round(productive / wall, 4) if wall else None,
            "status_goodput": (st.get("training") or {}).get("goodput"), "faults": len(kills),
            "restarts": st.get("restartCount"), "modes": [r.get("mode") for r in restarts],
            "recover_s": [round(x, 2) for x in recover],
            "recover_p50_s": round(statistics.median(recover), 2) if recover else None,
            "recover_max_s": round(max(recover), 2) if recover else None, "lost_steps": lost,
            "cause_accuracy": round(right / len(kills), 3) if kills else None, "causes": causes,
            "false_hangs": sum(1 for c_ in causes if c_ == "Hang") if fault != "hang" else None,
            "detect_s": [round(x, 1) for x in detect] if fault == "hang" else None,
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
    p.add_argument("--fault", default="worker", choices=tuple(EXPECTED_CAUSE), help="what each fault is (see above)")
    p.add_argument("--in-place", type=int, default=10, help="runPolicy.maxInPlaceRestarts (0: every fault re-creates)")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the kubelet double (--fault node: a node that failed "
                   "twice is kept out of later attempts, so 5 node faults need more than 2)")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--only", choices=("faults", "baseline"), help="run just one of the two runs")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    out = {"args": vars(a) | {"json": str(a.json) if a.json else None},
           "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    if a.only != "baseline":
        out["faults"] = run(a.steps, a.interval, a.kill_every, a.timeout, a.async_mode, a.kill_offset, a.fault,
                            a.in_place, a.nodes)
        print("with faults:", json.dumps(out["faults"]), flush=True)
    if a.only != "faults":
        out["baseline"] = run(a.steps, a.interval, None, a.timeout, a.async_mode, in_place=a.in_place)
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
        # A recovery ends at the end of the next attempt's first step, which counts as productive: the split is
        # (mean recovery - one step) + mean lost steps x step; what is left over is the step each kill cut off.
        step = f["step_seconds_p50"] or 0.0
        lost = statistics.mean(f["lost_steps"]) if f["lost_steps"] else 0.0
        rec = statistics.mean(f["recover_s"]) if f["recover_s"] else 0.0
        print(f"each fault cost {out['unproductive_s_per_fault']} s of unproductive wall time; of it, about "
              f"(recover mean {rec:.1f} s - one step {step} s) + lost steps {lost:.1f} x {step} s = "
              f"{rec - step + lost * step:.1f} s")
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average (1, 5, 15 min) at start {out['loadavg_at_start']}, at end {out['loadavg_at_end']}, "
          f"{out['cpus']} CPUs")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
