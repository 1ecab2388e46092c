"""Loss curves of the loader on a real corpus: shuffled vs sequential (the old corpus order), same tokens, held-out eval.

    nice -n 10 python bench/loader_curves.py run [--mb 4] [--steps 300] [--out bench/results/loader_curves]
    python bench/loader_curves.py plot [--out bench/results/loader_curves] [--png docs/loader_curves.png]

``run`` builds a corpus of at least ``--mb`` MB from this interpreter's standard library (``*.py`` sorted by path, one
document per file: real text whose order clusters by module, as a crawled corpus clusters by site), tokenizes it with
``kubetitan prepare-data`` (the builtin tokenizer), and trains the debug model on CPU twice through the real
launcher and trainer: ``data.order`` ``sequential`` and ``shuffled``, the same seed, steps, batch and held-out set
(the last 2% of the windows, never trained on, ``eval.samples`` of them evaluated every ``--eval-every`` steps).
The runs' per-step logs (``kubetitan/steps.jsonl``, ``kubetitan/evals.jsonl``) are copied to ``--out``.

``plot`` prints the numbers (mean and spread of the training loss over the last 100 steps, final eval loss) and
writes the PNG (needs matplotlib, not in the project's venv: put it on PYTHONPATH).
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
ORDERS = ("sequential", "shuffled")


def corpus(work: Path, mb: float) -> tuple[Path, int]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    src = work / "stdlib.jsonl"
    size = 0
    with src.open("w") as f:
        for p in files:
            if "site-packages" in p.parts:
                continue
            text = p.read_text(errors="replace")
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
                size += len(text.encode())
            if size >= mb * 1e6:
                break
    return src, size


def spec(shards: Path, order: str, steps: int, eval_every: int) -> dict:
    return {
        "apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
        "metadata": {"name": f"curves-{order}", "namespace": "bench"},
        "spec": {
            "model": {"flavor": "debug"},
            "training": {"steps": steps, "seqLen": 128, "localBatchSize": 8, "learningRate": 0.002,
                         "warmupSteps": 20, "seed": 7},
            "parallelism": {"dataParallelShardDegree": 1},
            "precision": {"compile": False, "activationCheckpointing": "none", "mixedPrecisionParam": "float32"},
            "data": {"source": "shards", "shards": {"path": str(shards)}, "order": order,
                     "eval": {"intervalSteps": eval_every, "samples": 64, "heldOutPercent": 2}},
            "tokenizer": {"source": "builtin"},
            "checkpoint": {"enabled": False},
            "resources": {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 1},
            "monitoring": {"logFrequencySteps": 1},
        },
    }


def run(a: argparse.Namespace) -> None:
    import tomli_w

    from kubetitan_core import render
    from kubetitan_core.api import LlamaPretrain
    from kubetitan_trainer.data.prepare import main as prepare
    from kubetitan_trainer.local import free_port

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="loader-curves-"))
    src, size = corpus(work, a.mb)
    t = time.time()
    assert prepare([str(src), "-o", str(work / "shards")]) == 0
    index = json.loads((work / "shards" / "index.json").read_text())
    meta = {"corpus_bytes": size, "documents": index["documents"], "tokens": index["total_tokens"],
            "prepare_seconds": round(time.time() - t, 1), "steps": a.steps, "seq_len": 128, "batch": 8,
            "eval_every": a.eval_every, "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(meta))
    for order in ORDERS:
        obj = LlamaPretrain.model_validate(spec(work / "shards", order, a.steps, a.eval_every))
        dump = work / order
        cfg = render.trainer_config(obj, dump_folder=str(dump))
        cfg["kubetitan"]["metrics_port"] = 0
        config = work / f"{order}.toml"
        config.write_text(tomli_w.dumps(cfg))
        t = time.time()
        with open(work / f"{order}.log", "wb") as log:
            rc = subprocess.run([sys.executable, "-m", "kubetitan_trainer.launch", f"--config={config}", "--nnodes=1",
                                 "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--rdzv-id=curves",
                                 "--max-restarts=0"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        print(f"{order}: exit {rc} in {time.time() - t:.0f} s")
        if rc:
            print((work / f"{order}.log").read_text(errors="replace")[-3000:])
            sys.exit(rc)
        for name in ("steps.jsonl", "evals.jsonl"):
            shutil.copy(dump / "kubetitan" / name, out / f"{order}-{name}")
        meta[f"{order}_seconds"] = round(time.time() - t, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot(a: argparse.Namespace) -> None:
    out = Path(a.out)
    meta = json.loads((out / "meta.json").read_text())
    curves = {o: ({r["step"]: r["loss"] for r in rows(out / f"{o}-steps.jsonl")},
                  {r["step"]: r["eval_loss"] for r in rows(out / f"{o}-evals.jsonl")}) for o in ORDERS}
    print(f"corpus: {meta['corpus_bytes'] / 1e6:.1f} MB, {meta['documents']} documents, {meta['tokens']:,} tokens; "
          f"{meta['steps']} steps x {meta['batch']} x {meta['seq_len'] + 1} tokens")
    for o, (train, ev) in curves.items():
        last = [train[s] for s in sorted(train)[-100:]]
        steps = sorted(train)
        jumps = [abs(train[s] - train[p]) for p, s in zip(steps, steps[1:])][-100:]
        print(f"{o:10s} train loss last 100 steps: mean {statistics.mean(last):.3f}, std {statistics.pstdev(last):.3f}, "
              f"max {max(last):.3f}, mean |step-to-step change| {statistics.mean(jumps):.3f}; "
              f"eval loss at step {max(ev)}: {ev[max(ev)]:.3f} (best {min(ev.values()):.3f})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for o, (train, ev) in curves.items():
        s = sorted(train)
        ax1.plot(s, [train[i] for i in s], lw=0.8, label=f"{o}")
        e = sorted(ev)
        ax2.plot(e, [ev[i] for i in e], marker="o", ms=3, lw=1.2, label=f"{o}")
    ax1.set_title("training loss (same corpus, seed, steps)")
    ax2.set_title(f"held-out loss ({meta.get('eval_every')}-step interval, 64 sequences)")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend(fontsize=8)
    fig.suptitle(f"debug model on CPU, {meta['corpus_bytes'] / 1e6:.1f} MB of Python sources "
                 f"({meta['tokens'] / 1e6:.2f} M tokens), data.order sequential vs shuffled", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["run", "plot"])
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "loader_curves"))
    p.add_argument("--png", default=str(REPO / "docs" / "loader_curves.png"))
    a = p.parse_args()
    run(a) if a.what == "run" else plot(a)


if __name__ == "__main__":
    main()
