"""A two-source mixture trained locally with and without document masking: per-source losses, and the masking's cost.

    nice -n 10 python bench/doc_mask_bench.py run [--steps 60] [--seq-len 512] [--out bench/results/doc_mask]
    python bench/doc_mask_bench.py plot [--out bench/results/doc_mask] [--png docs/data_sources.png]

``run`` builds two sources from files of this machine (no download): ``code``, Python modules of the standard library
(one document each), and ``prose``, the licence and copyright texts under /usr/share (one document each), tokenizes
each with ``kubetitan prepare-data`` (the builtin tokenizer), and trains the debug model on CPU with ``kubetitan run``
twice, the same seed, data and steps: ``data.attentionMask`` ``causal`` and ``document``. A 3:1 mixture, a held-out
split (2% of each source) evaluated every ``--eval-every`` steps. Copied to ``--out``: each run's ``steps.jsonl`` and
``evals.jsonl`` (per-source losses, tokens and epochs) and a summary (``summary.txt``: the command, the machine's load,
tokens/s of each run as the median of its logged steps after the first 5, and the masking's cost).

``plot`` writes the per-source training and held-out loss curves of both runs (needs matplotlib, not in the project's
venv: put it on PYTHONPATH) and prints the Markdown table docs/data.md shows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MASKS = ("causal", "document")


def sources(work: Path) -> dict[str, Path]:
    code = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]
    prose = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    out = {}
    for name, files in (("code", code), ("prose", prose)):
        src = work / f"{name}.jsonl"
        with src.open("w") as f:
            for p in files:
                try:
                    text = Path(p).read_text()
                except (OSError, UnicodeDecodeError):
                    continue
                if text.strip():
                    f.write(json.dumps({"text": text}) + "\n")
        r = subprocess.run([sys.executable, "-m", "kubetitan_trainer.data.prepare", str(src), "-o", str(work / name),
                            "--no-progress"], capture_output=True, text=True, check=True)
        print(r.stdout.strip())
        out[name] = work / name
    return out


def spec(shards: dict[str, Path], mask: str, steps: int, seq_len: int, eval_every: int) -> dict:
    return {
        "apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
        "metadata": {"name": f"two-source-{mask}", "namespace": "bench"},
        "spec": {
            "model": {"flavor": "debug"},
            "training": {"steps": steps, "seqLen": seq_len, "localBatchSize": 4, "learningRate": 0.002,
                         "warmupSteps": 10, "seed": 7},
            "parallelism": {"dataParallelShardDegree": 1},
            "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32"},
            "data": {"source": "mixture", "attentionMask": mask,
                     "mixture": [{"name": "code", "weight": 3, "shards": {"path": str(shards["code"])}},
                                 {"name": "prose", "weight": 1, "shards": {"path": str(shards["prose"])}}],
                     "eval": {"intervalSteps": eval_every, "samples": 32, "heldOutPercent": 2}},
            "tokenizer": {"source": "builtin"},
            "checkpoint": {"enabled": False},
            "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1},
            "runPolicy": {"maxRestarts": 0},
            "monitoring": {"logFrequencySteps": 1},
        },
    }


def tokens_per_second(steps_file: Path) -> float:
    recs = [json.loads(line) for line in steps_file.read_text().splitlines()]
    return statistics.median(r["tokens_per_second_per_gpu"] for r in recs[5:] if r["tokens_per_second_per_gpu"] > 0)


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="doc-mask-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "trainer"), str(REPO / "operator" / "core"),
                                                       str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    lines = [f"# {' '.join(sys.argv)}", f"# {os.uname().nodename}: {os.cpu_count()} CPUs, load average before "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, nice {os.nice(0)}"]
    shards = sources(work)
    rates = {}
    for mask in MASKS:
        f = work / f"{mask}.yaml"
        f.write_text(yaml.safe_dump(spec(shards, mask, a.steps, a.seq_len, a.eval_every)))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kubetitan.cli", "run", str(f), "--output-dir", str(work / mask)],
                           env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if r.returncode:
            raise SystemExit(f"{mask}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        for name in ("steps.jsonl", "evals.jsonl"):
            shutil.copy(work / mask / "kubetitan" / name, out / f"{mask}-{name}")
        rates[mask] = tokens_per_second(work / mask / "kubetitan" / "steps.jsonl")
        lines.append(f"{mask}: {a.steps} steps of {4 * a.seq_len} tokens in {wall:.0f} s (with start-up); "
                     f"median {rates[mask]:,.0f} tokens/s over steps 6-{a.steps}")
    change = rates["document"] / rates["causal"] - 1
    lines.append(f"document masking on CPU (dense mask through SDPA): {change:+.1%} tokens/s against causal "
                 f"({rates['document']:,.0f} vs {rates['causal']:,.0f}); load average after "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def table(out: Path) -> str:
    rows = ["| attention | source | training loss, mean of the last 10 steps | held-out loss at the last evaluation | "
            "tokens | epochs |", "|---|---|---|---|---|---|"]
    for mask in MASKS:
        steps = [json.loads(line) for line in (out / f"{mask}-steps.jsonl").read_text().splitlines()]
        evals = [json.loads(line) for line in (out / f"{mask}-evals.jsonl").read_text().splitlines()]
        for name in ("code", "prose"):
            tail = [s["sources"][name]["loss"] for s in steps[-10:] if "loss" in s["sources"][name]]
            last = steps[-1]["sources"][name]
            rows.append(f"| {mask} | {name} | {statistics.mean(tail):.3f} | "
                        f"{evals[-1]['sources'][name]['eval_loss']:.3f} (step {evals[-1]['step']}) | "
                        f"{last['tokens']:,} | {last['epochs']:.3f} |")
    return "\n".join(rows)


def plot(a: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(a.out)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mask in zip(axes, MASKS):
        steps = [json.loads(line) for line in (out / f"{mask}-steps.jsonl").read_text().splitlines()]
        evals = [json.loads(line) for line in (out / f"{mask}-evals.jsonl").read_text().splitlines()]
        for name, colour in (("code", "tab:blue"), ("prose", "tab:orange")):
            ax.plot([s["step"] for s in steps], [s["sources"][name].get("loss") for s in steps], color=colour,
                    alpha=0.6, label=f"{name}, training")
            ax.plot([e["step"] for e in evals], [e["sources"][name]["eval_loss"] for e in evals], "o-", color=colour,
                    label=f"{name}, held-out")
        ax.set_title(f"attentionMask: {mask}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats per token)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(table(out))
    print(f"wrote {a.png}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["run", "plot"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "doc_mask"))
    ap.add_argument("--png", default=str(REPO / "docs" / "data_sources.png"))
    a = ap.parse_args()
    return run(a) if a.command == "run" else plot(a)


if __name__ == "__main__":
    sys.exit(main())
