"""Loss parity of bench runs (results.jsonl rows with per-step ``losses``): numbers, a text file and a PNG.

    python bench/plot_parity.py RECIPE.jsonl PLAIN_A.jsonl [PLAIN_B.jsonl] OUT.png [--txt OUT.txt] [--ema 0.9]
        [--tail 100] [--windows 25]

RECIPE and PLAIN_A share the seed (initial weights and data order); PLAIN_B is plain torchtitan with another seed:
``|PLAIN_A - PLAIN_B|`` is the run-to-run noise that the recipe's difference from PLAIN_A is judged against.
Over the last ``--tail`` steps it prints:

- mean |recipe - plain_A| per step, raw and of the smoothed curves, and the same for |plain_A - plain_B|;
- the gap of the tail means (recipe - plain_A, plain_B - plain_A): a systematic offset, with per-step noise averaged
  out;
- the standard deviation of each curve's step-to-step changes (how noisy one step's loss is).

Smoothing: an exponential moving average with weight ``--ema`` on the past (TensorBoard's "smoothing", with its
bias correction at the start). With two files (no PLAIN_B) it prints the recipe-vs-plain_A numbers alone, as the
synthetic-token runs (bench/device/loss_parity_synthetic.sh, loss_parity_fp8_head.sh) did. matplotlib is on the device image (not in the project's venv); the PNG is
written only when it imports.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


ROLES = {"recipe": "recipe (kubetitan run)", "plain_A": "plain torchtitan", "plain_B": "plain torchtitan"}


def short_label(role: str, row: dict) -> str:
    """``recipe (kubetitan run), FP8 output projection, seed 42``: the role, the head's precision and the seed."""
    case = row["case"]
    seed = re.search(r"(?:^|:)seed=(\d+)", case)
    head = "FP8 output projection" if re.search(r"(?:^|:)fp8out=1", case) and row.get("mode", "").startswith("fp8") \
        else "bf16 output projection"
    what = ROLES[role] if (row.get("path") == "kubetitan") == (role == "recipe") else \
        ("kubetitan run" if row.get("path") == "kubetitan" else "plain torchtitan")  # e.g. two recipe runs compared
    return f"{what}, {row.get('flavor', '')} {row.get('mode', '')} batch {row.get('batch', '')}, {head}, " \
        f"seed {seed.group(1) if seed else 42}"


def losses(path: str) -> tuple[str, list[float]]:
    """The label and per-step losses of the last row of a bench results.jsonl; a run without steps stops here."""
    try:
        row = [json.loads(x) for x in open(path) if x.strip()][-1]
    except (OSError, IndexError) as e:
        raise SystemExit(f"{path}: no bench result ({e}); see that run's log") from None
    if not row.get("losses"):
        raise SystemExit(f"{path}: {row['path']} {row['case']} logged no step (rc {row.get('rc')}); see its log")
    return row, row["losses"]


def ema(xs: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing): no pull towards 0 at the start."""
    out, acc, norm = [], 0.0, 0.0
    for x in xs:
        acc, norm = weight * acc + (1 - weight) * x, weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def step_std(xs: list[float], tail: range) -> float:
    return statistics.pstdev([xs[i] - xs[i - 1] for i in tail if i > 0])


def mean_abs(a: list[float], b: list[float], tail: range) -> float:
    return statistics.mean(abs(a[i] - b[i]) for i in tail)


def tail_mean(xs: list[float], tail: range) -> float:
    return statistics.mean(xs[i] for i in tail)


def report(curves: dict[str, list[float]], n: int, tail: range, weight: float) -> list[str]:  # long: one line each
    """The printed numbers (see the module docstring); ``curves``: recipe, plain_A and optionally plain_B."""
    sm = {k: ema(v[:n], weight) for k, v in curves.items()}
    r, a = curves["recipe"], curves["plain_A"]
    span = f"steps {tail.start + 1}-{n}"
    lines = [f"steps {n}; step 1: " + ", ".join(f"{k} {v[0]:.5f}" for k, v in curves.items()),
             f"step {n}: " + ", ".join(f"{k} {v[n - 1]:.4f}" for k, v in curves.items()),
             f"mean loss over {span}: " + ", ".join(f"{k} {tail_mean(v, tail):.4f}" for k, v in curves.items()),
             f"std of step-to-step change over {span}: "
             + ", ".join(f"{k} {step_std(v, tail):.4f}" for k, v in curves.items()),
             f"mean |recipe - plain_A| over {span}: raw {mean_abs(r, a, tail):.4f}, "
             f"smoothed (EMA {weight}) {mean_abs(sm['recipe'], sm['plain_A'], tail):.4f}; "
             f"gap of the means (recipe - plain_A) {tail_mean(r, tail) - tail_mean(a, tail):+.4f}"]
    if "plain_B" in curves:
        b = curves["plain_B"]
        noise_raw, noise_sm = mean_abs(a, b, tail), mean_abs(sm["plain_A"], sm["plain_B"], tail)
        noise_gap = tail_mean(b, tail) - tail_mean(a, tail)
        diff_raw, diff_sm = mean_abs(r, a, tail), mean_abs(sm["recipe"], sm["plain_A"], tail)
        diff_gap = tail_mean(r, tail) - tail_mean(a, tail)
        within = diff_raw <= noise_raw and diff_sm <= noise_sm and abs(diff_gap) <= abs(noise_gap)
        lines += [
            f"run-to-run noise, mean |plain_A - plain_B| over {span}: raw {noise_raw:.4f}, smoothed {noise_sm:.4f}; "
            f"gap of the means (plain_B - plain_A) {noise_gap:+.4f}",
            f"recipe vs plain_A against that noise: raw {diff_raw / noise_raw:.2f}x, "
            f"smoothed {diff_sm / noise_sm:.2f}x, |gap of the means| {abs(diff_gap):.4f} vs {abs(noise_gap):.4f}; "
            f"within run-to-run noise on all three: {within}",
        ]
    else:
        noise = step_std(a, tail)
        lines.append(f"within plain_A's step-to-step noise: {mean_abs(r, a, tail) < noise}")
    return lines


def windows(curves: dict[str, list[float]], n: int, width: int) -> list[str]:
    """Per ``width``-step window: the mean signed difference of the recipe and of plain_B from plain_A (a steady
    offset keeps its sign window after window; run-to-run noise swings both ways), and its mean |difference|."""
    a = curves["plain_A"]
    others = [k for k in ("recipe", "plain_B") if k in curves]
    lines = [f"per {width}-step window, difference from plain_A: mean (signed) and mean |.|: "
             + ", ".join(f"{k} - plain_A" for k in others)]
    for lo in range(0, n - width + 1, width):
        cells = []
        for k in others:
            d = [curves[k][i] - a[i] for i in range(lo, lo + width)]
            cells.append(f"{k} {statistics.mean(d):+.4f} |{statistics.mean(abs(x) for x in d):.4f}|")
        lines.append(f"  steps {lo + 1:>4}-{lo + width:<4} " + "   ".join(cells))
    return lines


def plot(curves: dict[str, list[float]], labels: dict[str, str], n: int, weight: float, png: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = range(1, n + 1)
    sm = {k: ema(v[:n], weight) for k, v in curves.items()}
    colours = {"recipe": "tab:orange", "plain_A": "tab:blue", "plain_B": "tab:green"}
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    style = {"recipe": "--", "plain_A": "-", "plain_B": "-"}  # dashed: the recipe stays visible on top of plain_A
    for k in sorted(curves, key=lambda k: k == "recipe"):  # the recipe last, on top
        v = curves[k]
        ax.plot(steps, v[:n], color=colours[k], lw=0.6, alpha=0.35)
        ax.plot(steps, sm[k], color=colours[k], lw=1.6, ls=style[k], label=f"{k}: {labels[k]}")
    ax.text(0.99, 0.99, f"faint: each step's loss; bold: EMA {weight}", transform=ax.transAxes, ha="right", va="top",
            fontsize=7)
    ax.set_ylabel("training loss (nats/token)")
    ax.set_yscale("log")
    ax.legend(fontsize=6.5)
    ax.set_title(title, fontsize=8)
    d = [sm["recipe"][i] - sm["plain_A"][i] for i in range(n)]
    dx.plot(steps, [curves["recipe"][i] - curves["plain_A"][i] for i in range(n)], color="tab:orange", lw=0.5,
            alpha=0.35)
    dx.plot(steps, d, color="tab:orange", lw=1.4, label="recipe - plain_A (same seed)")
    if "plain_B" in curves:
        dx.plot(steps, [curves["plain_B"][i] - curves["plain_A"][i] for i in range(n)], color="tab:green", lw=0.5,
                alpha=0.35)
        dx.plot(steps, [sm["plain_B"][i] - sm["plain_A"][i] for i in range(n)], color="tab:green", lw=1.4,
                label="plain_B - plain_A (other seed: run-to-run noise)")
    dx.axhline(0, color="k", lw=0.5)
    # the scale: the smoothed differences after the first quarter of the steps (raw spikes, early steps may be clipped)
    start = max(10, n // 4)
    settled = [abs(x) for x in d[start:]]
    if "plain_B" in curves:
        settled += [abs(sm["plain_B"][i] - sm["plain_A"][i]) for i in range(start, n)]
    lim = 1.5 * max(max(settled, default=0.0), 1e-3)
    dx.set_ylim(-lim, lim)
    dx.set_xlabel("step")
    dx.set_ylabel("loss difference")
    dx.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="RECIPE.jsonl PLAIN_A.jsonl [PLAIN_B.jsonl] OUT.png")
    ap.add_argument("--txt", help="also write the printed numbers here")
    ap.add_argument("--ema", type=float, default=0.9, help="EMA weight on the past (default 0.9: ~10 steps)")
    ap.add_argument("--tail", type=int, default=100, help="the last this many steps are compared (default 100)")
    ap.add_argument("--windows", type=int, default=25, help="also the mean differences per this many steps (0: none)")
    a = ap.parse_args(argv)
    if len(a.files) not in (3, 4):
        ap.error("give RECIPE.jsonl PLAIN_A.jsonl [PLAIN_B.jsonl] OUT.png")
    *runs, png = a.files
    loaded = dict(zip(("recipe", "plain_A", "plain_B"), (losses(f) for f in runs)))
    labels = {k: short_label(k, v[0]) for k, v in loaded.items()}
    curves = {k: v[1] for k, v in loaded.items()}
    n = min(len(v) for v in curves.values())
    if n < 2:
        raise SystemExit(f"too few steps to compare: {n} (" + ", ".join(f"{k} {len(v)}" for k, v in curves.items())
                         + "): see the runs' logs")
    tail = range(max(0, n - a.tail), n)
    lines = [f"{k}: {labels[k]}: {v[0]['path']} {v[0]['case']} ({len(curves[k])} steps)" for k, v in loaded.items()]
    lines += report(curves, n, tail, a.ema)
    if a.windows > 0:
        lines += windows(curves, n, a.windows)
    title = next(x for x in lines if x.startswith("mean |recipe"))
    if "plain_B" in curves:
        title += "\n" + next(x for x in lines if x.startswith("run-to-run"))
    if plot(curves, labels, n, a.ema, png, title):
        lines.append(f"wrote {png}")
    else:
        lines.append("matplotlib missing: no PNG")
    print("\n".join(lines))
    if a.txt:
        Path(a.txt).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
