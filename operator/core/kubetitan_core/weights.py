"""Mixture weight schedules: a source's weight as a function of the training step (docs/data.md, "Weight schedules").

One definition for the API's validation, the renderer and the trainer's global sample stream. A source's schedule
is its starting weight (``weight``, at step 0) and points ``(step, weight)`` in increasing step order: ``linear``
interpolates between neighbouring points (from the starting weight at step 0 to the first point, and so on),
``step`` holds each point's weight from its step on; after the last point its weight holds. The weight of training
step ``s`` (1-based: the samples ``[(s - 1) * B, s * B)`` of a global batch of ``B``) is the schedule's value at
``s``, computed exactly (:class:`fractions.Fraction` of the floats' binary values), so every rank and every world size
agrees on it.

Torch-free: the operator imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

INTERPOLATIONS = ("linear", "step")


@dataclass(frozen=True)
class WeightSchedule:
    """One source's weight over training: ``start`` at step 0, then ``points`` (step, weight)."""

    start: float
    interpolation: str = "linear"
    points: tuple[tuple[int, float], ...] = ()

    def at(self, step: int) -> Fraction:
        """The weight at ``step``, exact."""
        prev_s, prev_w = 0, Fraction(self.start)
        for s, w in self.points:
            if step < s:
                if self.interpolation == "step":
                    return prev_w
                return prev_w + (Fraction(w) - prev_w) * (step - prev_s) / (s - prev_s)
            prev_s, prev_w = s, Fraction(w)
        return prev_w

    @property
    def constant(self) -> bool:
        return all(w == self.start for _, w in self.points)

    def describe(self) -> str:
        """``linear: 1 at step 0, 1 at step 900, 10 at step 1000``."""
        pts = ", ".join(f"{w:g} at step {s}" for s, w in ((0, self.start), *self.points))
        return f"{self.interpolation}: {pts}"


def percent_step(percent: float, steps: int) -> int:
    """The step at ``percent`` % of a run of ``steps`` steps: the nearest one, halves up."""
    return int(Fraction(percent) * steps / 100 + Fraction(1, 2))


def problems(schedules: Sequence[WeightSchedule], steps: int) -> Iterator[tuple[int | None, str]]:
    """(source index, or None for the mixture as a whole; what is wrong and how to fix it) of every problem."""
    for i, sch in enumerate(schedules):
        if sch.interpolation not in INTERPOLATIONS:
            yield i, f"interpolation {sch.interpolation!r} is not one of {', '.join(INTERPOLATIONS)}"
        prev = None
        for k, (s, w) in enumerate(sch.points):
            if s < 0 or (prev is not None and s <= prev):
                yield i, (f"point {k} is at step {s}, not after point {k - 1}'s step {prev}: change the points' "
                          "order to increasing steps, one point per step" if prev is not None else
                          f"point {k} is at step {s}: use a step of 0 or more")
            if s > steps:
                yield i, (f"point {k} is at step {s}, after the run's last step ({steps}): it would never apply; "
                          "move it to a step within training.steps (or give its place as a percent)")
            if w < 0:
                yield i, f"point {k} has the weight {w}: use 0 or more"
            prev = s
        if sch.start <= 0 and all(w <= 0 for _, w in sch.points):
            yield i, ("has the weight 0 at every step, so it would never be trained: give it a positive weight, or a "
                      "schedule that raises it, or remove the source")
    ends = {1, max(1, steps)} | {min(max(s, 1), max(1, steps)) for sch in schedules for s, _ in sch.points}
    for s in sorted(ends):  # the weights are linear (or constant) between points: their sum's minimum is at one
        if schedules and sum(sch.at(s) for sch in schedules) <= 0:
            yield None, (f"every source's weight is 0 at step {s}: the mixture has nothing to train on there; give "
                         "some source a positive weight at every step")
            break


def step_of(position: int, samples_per_step: int) -> int:
    """The (1-based) training step that trains global sample ``position``."""
    return position // samples_per_step + 1


def from_lists(weights: Sequence[float], interpolations: Sequence[str], sources: Sequence[int],
               steps: Sequence[int], point_weights: Sequence[float]) -> list[WeightSchedule]:
    """The schedules of ``[kubetitan.data]``'s parallel lists (``mixture_weights``, ``mixture_schedule_*``: points
    as flat lists naming their source); ValueError, saying what is wrong, for lists that do not fit together."""
    if not len(sources) == len(steps) == len(point_weights):
        raise ValueError(f"mixture_schedule_sources, _steps and _weights have {len(sources)}, {len(steps)} and "
                         f"{len(point_weights)} entries: give each point a source, a step and a weight")
    if len(interpolations) > len(weights):
        raise ValueError(f"mixture_schedule_interpolations has {len(interpolations)} entries for {len(weights)} sources")
    interp = list(interpolations) + [""] * (len(weights) - len(interpolations))
    points: list[list[tuple[int, float]]] = [[] for _ in weights]
    for i, s, w in zip(sources, steps, point_weights):
        if not 0 <= i < len(weights):
            raise ValueError(f"a schedule point names source {i}; there are {len(weights)}")
        if not interp[i]:
            raise ValueError(f"source {i} has schedule points but no interpolation (mixture_schedule_interpolations)")
        points[i].append((int(s), float(w)))
    return [WeightSchedule(float(w), interp[i] or "linear", tuple(points[i])) for i, w in enumerate(weights)]
