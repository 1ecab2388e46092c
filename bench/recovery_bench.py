"""Recovery anatomy bench: failure -> next first trained step through kubetitan's launch path.

One launcher (``python -m kubetitan_trainer.launch``, the pod entry point) with ``--max-restarts`` and the
restore tier trains a LlamaPretrain (default: examples/llama3-3b-h200.yaml) with checkpoints. Generation 0
starts cold (empty compile cache, no checkpoint), saves the step-``interval`` checkpoint (and the restore
tier), then its worker is SIGKILLed mid-run. Each further generation is one planned restart, killed again
after its first steps, before the next checkpoint (one full checkpoint on disk at any time):

- ``warm_tier``: compile cache kept, restore tier kept (the fast path);
- ``warm_dcp``: compile cache kept, the tier moved away first (so the load goes through DCP: "before");
- ``cold_tier`` / ``cold_dcp``: the compile cache moved away first (a cold compile), tier kept / moved.

An item written ``saved:<kind>`` makes the generation that is killed before it save first: it trains to its own
next checkpoint step N, writes the tier of step N (its pinned staging memory is then allocated, as in every worker of
a real run, which is what makes a dead worker's teardown slow), and is killed two steps later. The local disk holds
one 40 GiB DCP checkpoint, so before such a generation the bench deletes every DCP checkpoint (from then on every
load is from the tier) and after its kill the one it was writing.

Per generation it reports the trainer's start-up anatomy (``<dump>/kubetitan/startup.jsonl``,
:mod:`kubetitan_trainer.recovery.anatomy`) and the bench's own clock: SIGKILL -> the end of the first trained step.
Every event is printed and appended to ``<out>/events.jsonl`` as it happens (a cut-off run keeps its part).

    python3 bench/recovery_bench.py --out DIR [--lpt examples/llama3-3b-h200.yaml] [--plan warm_tier,warm_dcp]
    python3 bench/recovery_bench.py --out DIR --cpu      # the same driver on the debug model (dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

from kubetitan_core import contract  # noqa: E402
from kubetitan_core.api import LlamaPretrain  # noqa: E402
from kubetitan_trainer.local import free_port, scrape, spec_env, write_config  # noqa: E402

PLANS = ("warm_tier", "warm_dcp", "cold_tier", "cold_dcp")
NEED_S = {"warm_tier": 45, "warm_dcp": 100, "cold_tier": 100, "cold_dcp": 150}
SAVED = "saved:"
SAVED_NEED_S = 75  # a saved generation: steps to its checkpoint, the first pinned save of a process, the tier write
"""Seconds a planned restart may need (start-up + a few steps) on the H200; not started with less left. Once an item
has run, 1.5 x its measured cycle (+10 s) instead, when that is less."""

CPU_SPEC = {
    "model": {"flavor": "debug"},
    "training": {"seqLen": 128, "localBatchSize": 2, "learningRate": 0.002, "warmupSteps": 2, "seed": 7},
    "parallelism": {"dataParallelShardDegree": -1},
    "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32",
                  "float8": {"enabled": False}},
    "checkpoint": {"asyncMode": "disabled"},
    "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1},
}


class Events:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.time()

    def __call__(self, event: str, **kw) -> dict:
        rec = {"t": round(time.time() - self.t0, 3), "time": time.time(), "event": event, **kw}
        print(json.dumps(rec), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


def parse_runtime(text: str) -> dict:
    """``aotCompile=true,deferThreads=16`` -> ``{"aotCompile": True, "deferThreads": 16}``: ``spec.runtime`` fields
    (docs/api.md), each value read as YAML; the LlamaPretrain's validation refuses unknown fields and bad values."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--runtime {text!r}: {item!r} is not FIELD=VALUE (e.g. aotCompile=true,deferThreads=16)")
        out[key] = yaml.safe_load(value)
    return out


def build_lpt(path: Path, steps: int, interval: int, cpu: bool, runtime: dict | None = None) -> LlamaPretrain:
    doc = yaml.safe_load(path.read_text())
    spec = doc["spec"]
    if runtime:
        spec["runtime"] = {**spec.get("runtime", {}), **runtime}
    if cpu:
        for k, v in CPU_SPEC.items():
            spec[k] = {**spec.get(k, {}), **v} if isinstance(v, dict) else v
        spec["precision"] = {**CPU_SPEC["precision"]}
    spec["training"]["steps"] = steps
    spec["training"]["warmupSteps"] = min(spec["training"].get("warmupSteps", 2), max(1, steps // 4))
    spec["checkpoint"].update({"enabled": True, "intervalSteps": interval, "keepLatestK": 2})
    spec.setdefault("monitoring", {})["logFrequencySteps"] = 1
    doc["metadata"]["name"] = "recovery-bench"
    return LlamaPretrain.model_validate(doc)


def children(pid: int) -> list[int]:
    p = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in p.read_text().split()] if p.exists() else []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    out, todo = [], children(pid)
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children(p)
    return out


def startup_records(dump: Path) -> list[dict]:
    p = dump / "kubetitan" / "startup.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def cache_dir(env: dict) -> Path | None:
    from kubetitan_trainer.compile import compile_cache

    return compile_cache.root(env)


def tier_step(tier: Path) -> int | None:
    try:
        return json.loads((tier / "rank-0.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def run(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ev = Events(out / "events.jsonl")
    deadline = time.time() + a.deadline
    work = Path(a.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    dump = work / "out"
    dump.mkdir(parents=True)
    tier = Path(a.tier).resolve() if a.tier else work / "tier"
    shutil.rmtree(tier, ignore_errors=True)
    lpt = build_lpt(Path(a.lpt), a.steps, a.interval, a.cpu, parse_runtime(a.runtime))
    port = free_port()
    config = write_config(lpt, dump, None, port)
    plan = [p for p in a.plan.split(",") if p]
    assert all(p.removeprefix(SAVED) in PLANS for p in plan), f"--plan: each of {PLANS}, optionally {SAVED}<kind>"
    assert not (a.tier_only and any(p.endswith("_dcp") for p in plan)), "--tier-only: a plan without *_dcp items"
    env = {**os.environ, **spec_env(lpt), contract.ENV_ATTEMPT: "0", contract.ENV_JOB_NAME: "recovery-bench",
           contract.ENV_JOB_NAMESPACE: "bench", contract.ENV_JOB_START_TIME: str(int(time.time()))}
    from kubetitan_trainer.compile import compile_cache

    compile_cache.configure(str(config), env)  # what the launcher will set (setdefault): the bench can move it
    if a.precompile:
        env["TORCH_CACHING_PRECOMPILE"] = "1"
    cmd = [sys.executable, "-m", "kubetitan_trainer.launch", f"--config={config}", "--nnodes=1",
           "--nproc-per-node=1", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "--rdzv-id=recovery-bench", f"--max-restarts={len(plan)}", "--monitor-interval=0.1",
           f"--restore-tier={tier}", "--dns-timeout=5",
           # The bench pauses a worker (SIGSTOP) for as long as the checkpoint it must resume from takes to complete:
           # a hang to the launcher's watchdog under Auto's 30 s floor. The planned faults are kills, so the
           # watchdog gets the spec's fixed upper bound (900 s) instead.
           "--hang-timeout-policy=Fixed", "--hang-timeout-seconds=900"]
    free = shutil.disk_usage(tier.parent if tier.parent.exists() else "/").free
    ev("start", cmd=cmd, plan=plan, tier=str(tier), tier_free_gib=round(free / 2**30, 1),
       compile_cache=str(cache_dir(env)), deadline_s=a.deadline, tier_only=a.tier_only, precompile=a.precompile)
    log = open(out / "launcher.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    results: list[dict] = []
    ckpt_meta = dump / contract.CHECKPOINT_SUBDIR / f"step-{a.interval}" / contract.DCP_METADATA_FILE
    try:
        gen = 0
        kill_time = None
        cycles: dict[str, float] = {}  # plan item -> seconds from the kill before it to the kill after it
        killed_had_saved = False
        kind = "cold_start"
        while True:
            # 1. this generation's start-up record
            rec = wait(lambda: next((r for r in startup_records(dump) if r["generation"] == gen), None),
                       proc, deadline, ev, f"generation {gen} first step")
            if rec is None:
                break
            row = {"generation": gen, "kind": kind, "checkpoint_source": rec["checkpoint_source"],
                   "first_step": rec["first_step"], "origin": rec["origin"],
                   "phases": {k: round(v, 2) for k, v in rec["phases"].items()},
                   "startup_total_s": round(rec["total_seconds"], 2),
                   "compile_parts": rec.get("compile_parts", {}),  # torch's own compile phases (anatomy)
                   "compile_counts": rec.get("compile_counts", {})}  # graphs traced, cache hits/misses (anatomy)
            if kill_time is not None:
                row["kill_to_first_step_end_s"] = round(rec["time"] - kill_time, 2)
                row["kill_to_detected_s"] = round(rec["time"] - rec["total_seconds"] - kill_time, 2)
                row["killed_worker_had_saved"] = killed_had_saved
            results.append(row)
            ev("generation", **row)
            for moved in (Path(str(tier) + ".away"), Path(str(cache_dir(env) or "") + ".away")):
                if str(moved) != ".away" and moved.exists():  # put back what this generation ran without
                    back = Path(str(moved).removesuffix(".away"))
                    shutil.rmtree(back, ignore_errors=True)
                    moved.rename(back)
                    ev("restored", path=str(back))
            if gen >= len(plan):
                break
            item = plan[gen]
            nxt, own_save = item.removeprefix(SAVED), item.startswith(SAVED) and gen > 0  # gen 0 saves anyway
            left = deadline - time.time()
            need = NEED_S[nxt] + (SAVED_NEED_S if own_save else 0)
            if item in cycles:  # measured on this machine: kill -> start-up -> own save -> next kill point
                need = min(need, round(1.5 * cycles[item] + 10))
            if left < need * (0.2 if a.cpu else 1):
                ev("stop", reason=f"{left:.0f} s left, {item} may need {need} s")
                break
            # 2. the kill point: gen 0 a step or two past its complete step-`interval` checkpoint and tier; a
            #    saved generation two steps past its own checkpoint step N, once its tier holds N; any other one
            #    step past its first
            if own_save:
                for d in (dump / contract.CHECKPOINT_SUBDIR).glob("step-*"):  # room for its own DCP save
                    shutil.rmtree(d, ignore_errors=True)
                    ev("deleted", path=str(d), why="the disk holds one checkpoint; loads come from the tier now")
                save_at = -(-row["first_step"] // a.interval) * a.interval
                target = save_at + 2
            else:
                save_at = a.interval
                target = a.interval + 2 if gen == 0 else row["first_step"] + 1

            def ready():
                try:
                    m = scrape(port)
                except OSError:
                    return None
                step = int(m.get(contract.M_STEP, 0))
                if step < target:
                    return None
                return step

            step = wait(ready, proc, deadline, ev, f"generation {gen} at step {target}")
            if step is None:
                break
            workers = children(proc.pid)
            if not workers:
                ev("error", what="no worker process under the launcher")
                break

            def saved():
                if own_save:
                    return True if (tier_step(tier) or -1) >= save_at else None
                if gen > 0:
                    return True
                if a.tier_only:
                    return True if (tier_step(tier) or -1) >= a.interval else None
                if not ckpt_meta.exists():
                    return None
                if tier_step(tier) == a.interval:
                    return True
                text = (out / "launcher.log").read_text(errors="replace")
                return True if ("Restore tier skipped" in text or "Restore tier not written" in text) else None

            # The worker trains on while its save completes: DCP's async writer and the restore tier's background
            # thread (which a stopped worker would stop too). `interval` must leave room for that before the next
            # checkpoint step (the device's disk holds one full checkpoint).
            ok = wait(saved, proc, deadline, ev, f"generation {gen}'s checkpoint step-{save_at} and its tier")
            if ok is None:
                ev("warning", what=f"tier step {tier_step(tier)}, {ckpt_meta} exists: {ckpt_meta.exists()}")
                if not ckpt_meta.exists() and not own_save:
                    break
            step = ready() or step  # (the stopped worker serves no /metrics: read it first)
            workers = descendants(proc.pid)  # the workers and whatever they started (DCP's writer process)
            for w in workers:
                os.kill(w, signal.SIGSTOP)  # no further step while the bench moves things away
            ev("paused", step=step, workers=workers, saved_step=save_at if (own_save or gen == 0) else None)
            if step >= save_at + a.interval and not a.tier_only:
                ev("error", what=f"step {step}: a second checkpoint began before the first completed; raise --interval")
                break
            # 3. what the next generation runs without
            if nxt.endswith("_dcp") and tier.exists():
                tier.rename(Path(str(tier) + ".away"))
                ev("moved", path=str(tier), why="next generation loads through DCP")
            cc = cache_dir(env)
            if nxt.startswith("cold") and cc is not None and cc.exists():
                cc.rename(Path(str(cc) + ".away"))
                ev("moved", path=str(cc), why="next generation compiles cold")
            if kill_time is not None:
                cycles[kind] = time.time() - kill_time
            kill_time = time.time()
            for w in workers:
                os.kill(w, signal.SIGKILL)
            killed_had_saved = own_save or gen == 0
            ev("killed", workers=workers, step=step, next=nxt, killed_had_saved=killed_had_saved)
            if own_save:  # the DCP save it was writing (partial or complete): the tier holds that step
                shutil.rmtree(dump / contract.CHECKPOINT_SUBDIR / f"step-{save_at}", ignore_errors=True)
            gen += 1
            kind = item
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ev("launcher_ended", code=proc.returncode)
        for f in ("startup.jsonl", "steps.jsonl"):
            src = dump / "kubetitan" / f
            if src.exists():
                shutil.copy(src, out / f)
        if not a.keep:
            for p in (tier, Path(str(tier) + ".away"), work):
                shutil.rmtree(p, ignore_errors=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    tput = steady_throughput(out / "steps.jsonl", a.interval)
    if tput:
        ev("throughput", **tput)
    return 0 if len(results) == len(plan) + 1 else 1


def wait(cond, proc, deadline, ev, what, poll=0.1):
    while time.time() < deadline:
        if proc.poll() is not None:
            ev("error", what=f"launcher exited ({proc.returncode}) while waiting for {what}")
            return None
        v = cond()
        if v is not None:
            return v
        time.sleep(poll)
    ev("timeout", what=what)
    return None


def steady_throughput(steps_log: Path, interval: int) -> dict | None:
    """The recipe's tokens per second per GPU in steady steps: generation 0's steps after the first three, without
    a checkpoint step or the two after it (a save's stall); median and quartiles over the logged steps."""
    import statistics

    if not steps_log.exists():
        return None
    rows = [json.loads(x) for x in steps_log.read_text().splitlines() if x.strip()]
    tps = sorted(r["tokens_per_second_per_gpu"] for r in rows
                 if r.get("generation") == 0 and r["step"] > 3 and r["step"] % interval not in (0, 1, 2)
                 and r.get("tokens_per_second_per_gpu"))
    if len(tps) < 4:
        return None
    q = statistics.quantiles(tps, n=4)
    return {"steps": len(tps), "tokens_per_second_per_gpu_median": round(statistics.median(tps)),
            "q1": round(q[0]), "q3": round(q[2])}


def table(rows: list[dict]) -> str:
    from kubetitan_trainer.recovery.anatomy import PHASES

    head = ["gen", "start", "killed worker had saved", "loaded from", "kill -> first step end", "kill -> detected"] \
        + list(PHASES) + ["sum"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k = r.get("kill_to_first_step_end_s")
        d = r.get("kill_to_detected_s")
        lines.append("| " + " | ".join([str(r["generation"]), r["kind"],
                                        {True: "yes", False: "no"}.get(r.get("killed_worker_had_saved"), "-"),
                                        r["checkpoint_source"], "-" if k is None else f"{k:.1f} s",
                                        "-" if d is None else f"{d:.2f} s"]
                                       + [f"{r['phases'][p]:.1f}" for p in PHASES]
                                       + [f"{r['startup_total_s']:.1f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lpt", default=str(REPO / "examples" / "llama3-3b-h200.yaml"))
    p.add_argument("--plan", default="warm_tier,warm_dcp,cold_tier")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--interval", type=int, default=100,
                   help="checkpoint.intervalSteps; generation 0 trains on while its first save completes, so it must "
                        "outlast that save (on the H200 the 3B step is 1.14 s and 40 GiB reach the local disk in "
                        "over 45 s: 40 steps were too few, the step-80 save found the disk full)")
    p.add_argument("--tier", default="", help="restore tier folder (default: <work>/tier)")
    p.add_argument("--work", default="/tmp/recovery-bench")
    p.add_argument("--deadline", type=float, default=420, help="seconds for the whole bench")
    p.add_argument("--cpu", action="store_true", help="the debug model on CPU (dry run of the driver)")
    p.add_argument("--keep", action="store_true", help="keep the work folder and the tier")
    p.add_argument("--tier-only", action="store_true",
                   help="every load is from the tier: generation 0 is killed once its tier is written (its DCP save "
                        "need not complete) and DCP checkpoints may be deleted as they complete (a plan without "
                        "*_dcp items, on a disk too small for two checkpoints)")
    p.add_argument("--runtime", default="",
                   help="spec.runtime fields for every generation, FIELD=VALUE,... (e.g. aotCompile=true,deferThreads=16;"
                        " docs/api.md): the recovery path's settings, rendered into [kubetitan.runtime]")
    p.add_argument("--precompile", action="store_true",
                   help="TORCH_CACHING_PRECOMPILE=1 for every generation: torch 2.11's experimental Dynamo cache, "
                        "so a warm generation skips Dynamo's tracing too")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
