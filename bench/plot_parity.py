"""Loss parity of two bench runs (results.jsonl rows with per-step ``losses``): numbers and a PNG.

    python bench/plot_parity.py KT_RESULTS.jsonl PLAIN_RESULTS.jsonl OUT.png

Prints the mean |loss difference| over the last 100 steps and the noise it is judged against: the
standard deviation of the reference curve's step-to-step changes over the same steps. matplotlib is on
the device image (not in the project's venv); the PNG is written only when it imports.
"""

from __future__ import annotations

import json
import statistics
import sys


def losses(path: str) -> tuple[str, list[float]]:
    row = [json.loads(x) for x in open(path) if x.strip()][-1]
    return f"{row['path']} {row['case']}", row["losses"]


def main(kt: str, plain: str, png: str) -> None:
    (lk, a), (lp, b) = losses(kt), losses(plain)
    n = min(len(a), len(b))
    tail = range(max(0, n - 100), n)
    diff = statistics.mean(abs(a[i] - b[i]) for i in tail)
    noise = statistics.pstdev([b[i] - b[i - 1] for i in tail if i > 0])
    print(f"steps {n}; step 1: {a[0]:.5f} vs {b[0]:.5f}; last: {a[n - 1]:.4f} vs {b[n - 1]:.4f}")
    print(f"mean |kubetitan - plain| over steps {tail.start + 1}-{n}: {diff:.4f}; "
          f"std of plain's step-to-step change there: {noise:.4f}; within noise: {diff < noise}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, n + 1), b[:n], label=lp, lw=1)
    ax.plot(range(1, n + 1), a[:n], label=lk, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(f"loss parity: mean |diff| last 100 steps {diff:.4f}, step-to-step std {noise:.4f}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
