"""Checks on rank 0's scraped values before any of them enters the status (pure: no I/O, no clock).

A tenant's pod serves ``/metrics``; the operator copies numbers from it into ``status.observation`` and
``status.training``. Nothing a pod says is trusted as is: every sample the status reads has one row in
:data:`RULES` (its range, whether it is an integer, a Unix time, or a count that may not go back), and
:func:`check` keeps only the samples that pass. A refused value is never stored: the status keeps the last
good one, and the caller reports the refusal (a Warning Event ``MetricsValueRefused``, a log line and
``kubetitan_operator_scraped_values_refused_total``). Samples without a row are dropped: the status never
reads them.

JSON cannot hold NaN or ±Infinity (the API server refuses a body with one), and integers above 2^53 - 1 lose
exactness in every JSON reader; hence "finite" for every row and :data:`MAX_STEP` for steps.

Finite is not enough (``step 9007199254740991 of 100``, ``loss 1e308``): :class:`SpecBounds` tightens the rows by
what the run's spec makes possible (check ``spec``): a step at most the steps the run trains (+
:data:`STEP_SLACK`), a loss at most :data:`MAX_LOSS`, a throughput at most the run's processes x
:data:`MAX_TOKENS_PER_SECOND_PER_PROCESS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kubetitan_core import contract
from kubetitan_core.api import AttemptObservation, LlamaPretrainSpec, elastic_sizes, processes_per_node

MAX_STEP = 2**53 - 1
"""The largest step (or count) stored: the largest integer every JSON reader keeps exact."""
MAX_STEP_SECONDS = 86400.0
"""The longest optimizer step believed (a day): the ETA (now + steps left x step time) and the automatic hang
timeout scale with it, so a larger value would put a date past year 9999 into the status or switch hang
detection off."""
CLOCK_SKEW_SECONDS = 600.0
"""How far ahead of the operator's clock a pod's Unix time may be (a clock further ahead would hold the hang
timer off for as long)."""

STEP_SLACK = 10
"""Steps past the run's ``training.steps`` still believed: a trainer stops at its count (the launcher's last
log line and a scrape racing a steps edit come within one step); more is a made-up number."""
MAX_LOSS = 1000.0
"""The largest training or eval loss believed (nats per token). A model guessing uniformly over a 128k
vocabulary has ln(128256) = 11.8; a diverged run reaches tens to a few hundred before it turns NaN."""
MAX_TOKENS_PER_SECOND_PER_PROCESS = 1.0e8
"""The fastest throughput believed per training process (tokens per second): about a hundred times what a
debug-size model reaches on an H100; the run's bound is this times its processes (``SpecBounds.processes``)."""

Scope = Literal["", "attempt", "generation"]


@dataclass(frozen=True)
class Rule:
    """What one scraped sample must satisfy to be stored."""

    metric: str
    """Sample name as ``observation.scrape.parse_metrics`` keys it (``name/phase`` for the start-up phases)."""
    low: float = 0.0
    """Smallest value allowed (inclusive)."""
    high: float = math.inf
    """Largest value allowed (inclusive); ``math.inf`` for no bound beyond being finite."""
    integer: bool = False
    """The value must be a whole number (steps, counts, ranks, codes)."""
    timestamp: bool = False
    """A Unix time in seconds: at most ``now + CLOCK_SKEW_SECONDS``."""
    monotonic: Scope = ""
    """May not go below the value already observed in the same ``attempt`` or the same worker ``generation``
    (an in-place restart starts a new generation, whose steps go back to the checkpoint)."""
    unset: float | None = None
    """The value the trainer's gauge reads before it is set in a new process: not a regression, not stored."""


def _phase(p: str) -> str:
    return f"{contract.M_STARTUP_PHASE_SECONDS}/{p}"


RULES: tuple[Rule, ...] = (
    Rule(contract.M_ATTEMPT, high=MAX_STEP, integer=True),
    Rule(contract.M_RESTART_GENERATION, high=MAX_STEP, integer=True, monotonic="attempt"),
    Rule(contract.M_STEP, high=MAX_STEP, integer=True, monotonic="generation"),
    Rule(contract.M_LAST_CHECKPOINT_STEP, high=MAX_STEP, integer=True, monotonic="attempt", unset=0),
    Rule(contract.M_RESUMED_FROM_STEP, low=-1, high=MAX_STEP, integer=True),
    Rule(contract.M_RESTART_PREVIOUS_STEP, low=-1, high=MAX_STEP, integer=True),
    Rule(contract.M_RESTART_EXIT_CODE, low=-1, high=255, integer=True),
    Rule(contract.M_RESTART_NODE_RANK, low=-1, high=MAX_STEP, integer=True),
    Rule(contract.M_RESTART_TIMESTAMP, timestamp=True),
    Rule(contract.M_LAST_STEP_TIMESTAMP, timestamp=True),
    Rule(contract.M_FIRST_STEP_TIMESTAMP, timestamp=True),
    Rule(contract.M_JOB_START_TIMESTAMP, timestamp=True),
    Rule(contract.M_LOSS),
    Rule(contract.M_TOKENS_PER_SECOND),
    Rule(contract.M_TOKENS_PER_SECOND_PER_GPU),
    Rule(contract.M_FLOPS_PER_GPU),
    Rule(contract.M_MFU, high=1.0),
    Rule(contract.M_EVAL_LOSS),
    Rule(contract.M_SOURCE_LOSS),
    Rule(contract.M_SOURCE_EVAL_LOSS),
    Rule(contract.M_EVAL_PERPLEXITY),
    Rule(contract.M_EVAL_STEP, high=MAX_STEP, integer=True, monotonic="generation"),
    Rule(contract.M_STEP_DURATION, high=MAX_STEP_SECONDS),
    Rule(contract.M_STEP_DURATION_MEDIAN, high=MAX_STEP_SECONDS),
    Rule(contract.M_PRODUCTIVE_SECONDS),
    Rule(contract.M_STARTUP_SECONDS),
    *(Rule(_phase(p)) for p in contract.STARTUP_PHASES),
    Rule(contract.M_CHECKPOINT_SAVES_FAILED, high=MAX_STEP, integer=True),
    Rule(contract.M_CHECKPOINT_SAVES_FAILED_IN_A_ROW, high=MAX_STEP, integer=True),
    Rule(contract.M_CHECKPOINT_MAX_FAILED_SAVES, high=MAX_STEP, integer=True),
    Rule(contract.M_CHECKPOINT_LAST_FAILED_SAVE_STEP, low=-1, high=MAX_STEP, integer=True),
    Rule(contract.M_CHECKPOINT_SAVE_FAILURE, high=1.0, integer=True),
)
"""One row per sample the status reads (``kubetitan.status`` reads no other)."""

BY_METRIC: dict[str, Rule] = {r.metric: r for r in RULES}
PER_SOURCE = (contract.M_SOURCE_LOSS, contract.M_SOURCE_EVAL_LOSS)
"""Metrics read per ``source`` label (``name/<source>``), each source under the metric's row."""


def rule_for(name: str) -> Rule | None:
    """The row of a sample as ``observation.scrape.parse_metrics`` keys it (a per-source one under its metric's row; a
    failed save's ``error`` label only when it is a name, ``contract.SAVE_ERROR``: it goes into a condition message)."""
    rule = BY_METRIC.get(name)
    if rule is None and "/" in name:
        base, label = name.split("/", 1)
        if base in PER_SOURCE or (base == contract.M_CHECKPOINT_SAVE_FAILURE and contract.SAVE_ERROR.match(label)):
            rule = BY_METRIC[base]
    return rule

Check = Literal["finite", "integer", "range", "future", "regression", "spec"]

STEP_METRICS = (contract.M_STEP, contract.M_LAST_CHECKPOINT_STEP, contract.M_EVAL_STEP, contract.M_RESUMED_FROM_STEP,
                contract.M_RESTART_PREVIOUS_STEP, contract.M_CHECKPOINT_LAST_FAILED_SAVE_STEP)
"""Steps: at most the steps the run trains (+ ``STEP_SLACK``)."""


@dataclass(frozen=True)
class SpecBounds:
    """What the run's spec makes possible, tightening :data:`RULES` (check ``spec``)."""

    steps: int
    """The most steps an attempt of the run trains: ``training.steps`` of the spec and of the spec the current
    attempt was created from (an edit lowering it reaches the trainer only with the next attempt)."""
    processes: int
    """The most training processes of the run: its largest gang (``maxNodes`` of an elastic run) x processes per
    node, of either spec."""

    @classmethod
    def of(cls, spec: LlamaPretrainSpec, applied: Mapping[str, object] | None = None) -> SpecBounds:
        steps = spec.training.steps
        processes = (elastic_sizes(spec).stop - 1) * processes_per_node(spec)
        if applied:  # the attempt's own spec, in wire form (read, not validated again: only two numbers)
            t, r = applied.get("training"), applied.get("resources")
            if isinstance(t, Mapping) and isinstance(t.get("steps"), int):
                steps = max(steps, t["steps"])
            if isinstance(r, Mapping) and isinstance(r.get("nodes"), int):
                per = r.get("processesPerNode") or r.get("gpusPerNode") or 1
                processes = max(processes, r["nodes"] * (per if isinstance(per, int) and per > 0 else 1))
        return cls(steps=steps, processes=processes)

    def high(self, metric: str) -> tuple[float, str] | None:
        """The spec's bound of ``metric`` and what it is, or None when the spec bounds it no tighter."""
        if metric in STEP_METRICS:
            return float(self.steps + STEP_SLACK), f"the run trains {self.steps} steps (+{STEP_SLACK})"
        if metric in (contract.M_LOSS, contract.M_EVAL_LOSS):
            return MAX_LOSS, f"a loss above {MAX_LOSS:g} nats per token"
        if metric == contract.M_TOKENS_PER_SECOND:
            return (self.processes * MAX_TOKENS_PER_SECOND_PER_PROCESS,
                    f"{self.processes} processes x {MAX_TOKENS_PER_SECOND_PER_PROCESS:g} tokens/s")
        if metric == contract.M_TOKENS_PER_SECOND_PER_GPU:
            return MAX_TOKENS_PER_SECOND_PER_PROCESS, f"{MAX_TOKENS_PER_SECOND_PER_PROCESS:g} tokens/s per process"
        return None


@dataclass(frozen=True)
class Refusal:
    """A scraped value that was not stored, and why."""

    metric: str
    value: float
    check: Check
    why: str

    def __str__(self) -> str:
        return f"{self.metric}={self.value:g} ({self.why})"


def _bound(x: float) -> str:
    return "2^53 - 1" if x == MAX_STEP else f"{x:g}"


def _value_refusal(rule: Rule, v: float, now: float) -> Refusal | None:
    """The first check of ``rule`` that ``v`` fails, on its own (no history)."""
    if not math.isfinite(v):
        return Refusal(rule.metric, v, "finite", "not a finite number")
    if rule.integer and not v.is_integer():
        return Refusal(rule.metric, v, "integer", "not a whole number")
    if v < rule.low:
        return Refusal(rule.metric, v, "range", f"below {_bound(rule.low)}")
    if v > rule.high:
        return Refusal(rule.metric, v, "range", f"above {_bound(rule.high)}")
    if rule.timestamp and v > now + CLOCK_SKEW_SECONDS:
        return Refusal(rule.metric, v, "future", f"more than {CLOCK_SKEW_SECONDS:g} s ahead of the operator's clock")
    return None


def _previous(rule: Rule, prev: AttemptObservation | None, same_generation: bool) -> int | None:
    """The value already observed that ``rule``'s sample may not go below (None: no bound)."""
    if prev is None or not rule.monotonic or (rule.monotonic == "generation" and not same_generation):
        return None
    return {contract.M_STEP: prev.step, contract.M_LAST_CHECKPOINT_STEP: prev.last_checkpoint_step,
            contract.M_RESTART_GENERATION: prev.generation}.get(rule.metric)


def _spec_refusal(metric: str, v: float, bounds: SpecBounds | None) -> Refusal | None:
    limit = bounds.high(metric) if bounds is not None else None
    if limit is not None and v > limit[0]:
        return Refusal(metric, v, "spec", f"above {limit[0]:g}: {limit[1]}")
    return None


def check(metrics: Mapping[str, float], *, attempt: int, prev: AttemptObservation | None,
          now: float, bounds: SpecBounds | None = None) -> tuple[dict[str, float], list[Refusal]]:
    """(the samples that may be stored, the refused ones) of one scrape of rank 0.

    ``attempt``: the run's current attempt; ``prev``: its observation so far (another attempt's does not bind);
    ``now``: the operator's clock; ``bounds``: what the run's spec makes possible (None: the rows alone). A scrape
    whose own attempt gauge names another attempt is not compared with this one's history (``observation.tracking.track``
    refuses it whole).
    """
    kept: dict[str, float] = {}
    refused: list[Refusal] = []
    for name, v in metrics.items():
        rule = rule_for(name)
        if rule is None:
            continue
        r = _value_refusal(rule, float(v), now) or _spec_refusal(name, float(v), bounds)
        if r is not None:
            refused.append(r)
        else:
            kept[name] = float(v)
    own = kept.get(contract.M_ATTEMPT)
    history = prev if prev is not None and prev.attempt == attempt and (own is None or own == attempt) else None
    gen = kept.get(contract.M_RESTART_GENERATION)
    same_generation = history is not None and (gen is None or gen <= (history.generation or 0))
    for name in [n for n in kept if rule_for(n).monotonic]:  # type: ignore[union-attr]
        rule, v = rule_for(name), kept[name]
        assert rule is not None
        before = _previous(rule, history, same_generation)
        if before is None or v >= before:
            continue
        del kept[name]
        if rule.unset is None or v != rule.unset:
            scope = "worker generation" if rule.monotonic == "generation" else "attempt"
            refused.append(Refusal(name, v, "regression", f"went back from {before} within attempt {attempt}'s "
                                   f"{scope}"))
    return kept, refused


def summary(refused: list[Refusal]) -> str:
    """One message for an Event and a log line."""
    return ("rank 0's /metrics reported values the operator did not store (the status keeps the last good "
            "ones): " + "; ".join(map(str, refused)))


def signature(refused: list[Refusal]) -> frozenset[tuple[str, str]]:
    """What makes two refusals the same problem (the values may differ scrape to scrape): one Event per change."""
    return frozenset((r.metric, r.check) for r in refused)


__all__ = ["BY_METRIC", "CLOCK_SKEW_SECONDS", "MAX_LOSS", "MAX_STEP", "MAX_STEP_SECONDS",
           "MAX_TOKENS_PER_SECOND_PER_PROCESS", "RULES", "Refusal", "Rule", "STEP_SLACK", "SpecBounds", "check",
           "signature", "summary"]
