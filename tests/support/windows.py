"""How much training a scenario's mid-run action left: the slack of a (trigger -> action) window.

An end-to-end scenario waits for the run to reach some point (a scraped status, a step-log line, a checkpoint folder)
and then acts on it (kills, freezes, fails a node, patches the spec). The action tests what it says only while the
run still trains when it lands; a test that widens its window with more steps reports here how wide it was: the
steps rank 0 had left before the window closes (the run's last step, or whatever else ends it), and what they take at
the step time rank 0 logged so far in that attempt. Printed (``pytest -s`` shows it;
bench/results/suite/s16_windows_e2e_s3.txt.xz keeps runs of it), never asserted: a number of seconds is a timing, not a pass/fail check.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def slack(what: str, log: list[dict[str, Any]], closes_at: int, attempt: int | None = None,
          at: float | None = None) -> tuple[int, float]:
    """Print and return (steps left, seconds left) for the action ``what`` that landed at ``at`` (default: now):
    ``closes_at`` minus the newest step rank 0 logged by then (``log``: its step records, of ``attempt`` if given),
    times the median step time of those records (consecutive steps only, so a checkpoint load or a restart does not
    count as a step)."""
    at = time.time() if at is None else at
    recs = [r for r in log if (attempt is None or r.get("attempt") == attempt) and r["time"] <= at]
    if not recs:
        print(f"window {what}: landed before the attempt's first step ({closes_at} steps left)", flush=True)
        return closes_at, float("nan")
    gaps, of = _gaps(recs), "this attempt's"
    if not gaps:  # its first step only: the steps of the run so far
        gaps, of = _gaps([r for r in log if r["time"] <= at]), "the run's"
    step_s = statistics.median(gaps) if gaps else float("nan")
    left = closes_at - recs[-1]["step"]
    print(f"window {what}: landed at step {recs[-1]['step']}, {left} steps left before step {closes_at} = "
          f"{left * step_s:.1f} s at {step_s:.3f} s a step ({of} median)", flush=True)
    return left, left * step_s


def _gaps(recs: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive steps of one attempt and generation (a restart in between is not a step)."""
    return [b["time"] - a["time"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1
            and (a.get("attempt"), a.get("generation")) == (b.get("attempt"), b.get("generation"))]
