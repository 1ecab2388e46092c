"""Elastic training's loss curve against an uninterrupted run (does a resize cost convergence?): numbers and a PNG, not a test.

The REAL operator (in-process kopf) and the REAL trainer (launcher, torchrun, torchtitan's debug model on CPU, gloo)
run against kmockx with the e2e kubelet double (tests/e2e/kubelet.py) on 3 "nodes" x 1 process, synthetic data,
seed 42, global batch 6 samples of 32 tokens:

- ``elastic``: ``runPolicy.elastic {minNodes: 2}``; at the checkpoint of step ``--fail-at`` the node of rank 2 fails
  (no replacement: the gang shrinks to 2 after ``shrinkAfterSeconds``); once attempt 1 has trained ``--return-after``
  steps the node returns and the gang grows back to 3 at its next checkpoint;
- ``uninterrupted``: the same run, not elastic, no fault (3 nodes throughout).

Written to ``--out`` (bench/results/elastic/): ``<run>-steps.jsonl`` (rank 0's step log: step, loss, tokens, attempt,
time), ``<run>-status.json`` (the final status: restart records with sizes, downtime, lost steps), and ``summary.json``;
``plot`` prints the comparison and draws ``--png`` (docs/elastic_loss.png) when matplotlib imports (it is not in the
project's venv: put it on PYTHONPATH).

    nice -n 10 .venv/bin/python bench/elastic_loss.py run
    PYTHONPATH=<matplotlib site> .venv/bin/python bench/elastic_loss.py plot
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

from common import complete_checkpoints, free_port, step_log  # noqa: E402
from support.specs import CLAIM, NS, e2e_elastic_spec, lpt, with_debug_model  # noqa: E402
from kubelet import Kubelet  # noqa: E402

from kmockx.harness import Cluster, Operator, wait_for  # noqa: E402

RUNS = ("elastic", "uninterrupted")
START = 600.0


def one(run: str, a: argparse.Namespace, out: Path) -> None:
    """One run to the end; its step log and final status into ``out``."""
    with tempfile.TemporaryDirectory(prefix=f"elastic-{run}-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        elastic = {"shrinkAfterSeconds": a.shrink_after, "growCheckSeconds": a.grow_check} if run == "elastic" else None
        spec = with_debug_model(e2e_elastic_spec(ckpt, a.steps, a.interval, free_port(), 6, elastic))
        with Cluster() as c, Kubelet(c, Path(tmp) / "kubelet", nodes=3, claims={CLAIM: ckpt}) as k:
            op = Operator(c, namespaces=(NS,), scan_interval=0.2, scrape_interval=0.5)
            op.options.resize_min_interval_seconds = 1.0
            st = lambda: c.status(NS, run)  # noqa: E731
            t0 = time.time()
            with op:
                c.apply(lpt(run, spec))
                try:
                    scenario(run, a, c, k, ckpt, t0)
                except AssertionError:
                    print(f"status: {json.dumps(st())}\nexits: {k.exits}", flush=True)
                    raise
            wall = time.time() - t0
            (out / f"{run}-steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in step_log(ckpt)))
            (out / f"{run}-status.json").write_text(json.dumps({**st(), "wallSeconds": round(wall, 1)}, indent=1))
            print(f"{run}: {st().get('phase')} in {wall:.1f}s; restarts {st().get('restarts')}", flush=True)


def scenario(run: str, a: argparse.Namespace, c: Cluster, k: Kubelet, ckpt: Path, t0: float) -> None:
    """The elastic run's fault and return (nothing for the uninterrupted one), then the end of the run."""
    st = lambda: c.status(NS, run)  # noqa: E731
    if run == "elastic":
        wait_for(lambda: a.fail_at in complete_checkpoints(ckpt), START, f"checkpoint {a.fail_at}")
        node = k.proc(NS, f"{run}-a0-2").node
        k.fail_node(node)
        print(f"{time.time() - t0:6.1f}s failed {node} at checkpoint {a.fail_at}", flush=True)
        wait_for(lambda: st().get("resizeCount") == 1, START, "the shrink")
        shrunk = st()["attempt"]
        print(f"{time.time() - t0:6.1f}s shrank: {st()['restarts'][-1]['message']}", flush=True)
        first = wait_for(lambda: [r["step"] for r in step_log(ckpt) if r.get("attempt", 0) >= shrunk], START,
                         "the first step after the shrink")[0]
        wait_for(lambda: max(r["step"] for r in step_log(ckpt)) >= first + a.return_after, START,
                 "steps after the shrink")
        k.restore_node(node)
        print(f"{time.time() - t0:6.1f}s restored {node}", flush=True)
        wait_for(lambda: st().get("resizeCount") == 2, START, "the grow")
        print(f"{time.time() - t0:6.1f}s grew: {st()['restarts'][-1]['message']}", flush=True)
    wait_for(lambda: st().get("phase") in ("Succeeded", "Failed"), START * 2, "the end")


def final_losses(path: Path) -> dict[int, float]:
    """Step -> loss of the attempt that the final model kept (a step trained again keeps its last record)."""
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def plot(a: argparse.Namespace) -> None:
    out = Path(a.out)
    el, base = final_losses(out / "elastic-steps.jsonl"), final_losses(out / "uninterrupted-steps.jsonl")
    status = json.loads((out / "elastic-status.json").read_text())
    steps = sorted(set(el) & set(base))
    diffs = [abs(el[s] - base[s]) for s in steps]
    rel = [abs(el[s] - base[s]) / base[s] for s in steps]
    noise = statistics.pstdev([base[s] - base[p] for p, s in zip(steps, steps[1:])])
    resizes = [(r["cause"], r["fromNodes"], r["toNodes"], r["resumedFromStep"], r.get("downtimeSeconds"),
                r.get("lostSteps")) for r in status["restarts"]]
    summary = {"steps": len(steps), "max_abs_loss_diff": max(diffs), "mean_abs_loss_diff": statistics.mean(diffs),
               "max_rel_loss_diff": max(rel), "uninterrupted_step_to_step_std": noise, "resizes": resizes,
               "elastic_wall_seconds": status.get("wallSeconds"),
               "uninterrupted_wall_seconds": json.loads((out / "uninterrupted-status.json").read_text()).get(
                   "wallSeconds")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.plot(steps, [base[s] for s in steps], lw=1.6, label="uninterrupted, 3 nodes")
    ax1.plot(steps, [el[s] for s in steps], lw=1, ls="--", marker=".", ms=4, label="elastic, 3 -> 2 -> 3 nodes")
    for cause, frm, to, at, down, _lost in resizes:
        for ax in (ax1, ax2):
            ax.axvline(at + 0.5, color="grey", lw=0.8, ls=":")
        ax1.annotate(f"{cause} {frm}->{to}\n(downtime {down:.0f}s)" if down is not None else f"{cause} {frm}->{to}",
                     (at + 0.5, max(base.values())), fontsize=7, ha="left", va="top")
    ax1.set_ylabel("training loss")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [el[s] - base[s] for s in steps], lw=1, color="C3")
    ax2.set_ylabel("elastic - uninterrupted")
    ax2.set_xlabel("step (global batch 6 x 32 tokens at every size)")
    fig.suptitle(f"debug model on CPU: elastic 3->2->3 vs uninterrupted, max |loss diff| {max(diffs):.2e}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["run", "plot"])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "elastic"))
    p.add_argument("--png", default=str(REPO / "docs" / "elastic_loss.png"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--fail-at", type=int, default=8, help="checkpoint step at which rank 2's node fails")
    p.add_argument("--return-after", type=int, default=8, help="steps attempt 1 trains before the node returns")
    p.add_argument("--shrink-after", type=int, default=2)
    p.add_argument("--grow-check", type=int, default=2)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "run":
        for run in RUNS:
            one(run, a, out)
    plot(a)


if __name__ == "__main__":
    main()
