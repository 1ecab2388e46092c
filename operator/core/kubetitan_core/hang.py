"""The hang rule, defined once: the launcher's watchdog (an in-place restart, ``kubetitan_trainer.launch``) and
the operator's backstop (a re-created gang, ``kubetitan.decide.liveness.hung``) both time a step that stands still with it.

``runPolicy.hangTimeoutPolicy: Auto`` = min(hangTimeoutSeconds, max(10 x the median step time of the current
worker generation, the floor)) once that generation trained 5 steps; ``Fixed`` (or fewer steps) =
hangTimeoutSeconds. After a checkpoint step (and the last step: the final save) a save may pass:
``checkpoint.saveTimeoutSeconds`` is added. Pure functions, no clock.
"""

from __future__ import annotations

AUTO_HANG_STEP_FACTOR = 10
"""``hangTimeoutPolicy: Auto``: the timeout is this many median step times ..."""
AUTO_HANG_FLOOR_SECONDS = 30
"""... but never less than this (a slow data batch, a GC pause, a log flush; the operator's
``--hang-floor-seconds`` overrides it, and passes it on to every launcher) ..."""
AUTO_HANG_MIN_STEPS = 5
"""... once the current workers trained this many steps (before that: ``hangTimeoutSeconds``)."""
IN_PLACE_GRACE_SECONDS = 30.0
"""While the attempt may still restart in place, the operator's own hang limit is the launchers' plus this: the
launcher that sees its worker stand still stops it first and the gang restarts in place; the operator re-creates
the gang only when that did not happen (a frozen launcher, a pod that stopped as a whole)."""


def timeout(policy: str, fixed_seconds: float, floor: float, median_step_seconds: float | None,
            steps_trained: int | None) -> tuple[float, str]:
    """The hang timeout before a checkpoint step's save window, and how it was derived (for messages).

    ``steps_trained``: steps the current worker generation trained (None: unknown); ``median_step_seconds``: the
    median of its recent step times (None or 0: unknown)."""
    fixed = float(fixed_seconds), f"runPolicy.hangTimeoutSeconds={fixed_seconds:g}"
    if policy != "Auto" or not median_step_seconds or steps_trained is None or steps_trained < AUTO_HANG_MIN_STEPS:
        return fixed
    auto = max(AUTO_HANG_STEP_FACTOR * median_step_seconds, floor)
    if auto >= fixed[0]:
        return fixed
    return auto, (f"runPolicy.hangTimeoutPolicy=Auto: max({AUTO_HANG_STEP_FACTOR} x median step "
                  f"{median_step_seconds:.3g}s, {floor:g}s) = {auto:.0f}s")


def limit(base: float, save_window: bool, save_timeout_seconds: float) -> float:
    """``base`` (:func:`timeout`), plus ``checkpoint.saveTimeoutSeconds`` when the last step trained is a
    checkpoint step or the run's last step (its save may still be running)."""
    return base + (save_timeout_seconds if save_window else 0.0)


def save_window(step: int, last_step: int, checkpoint_enabled: bool, interval_steps: int) -> bool:
    """Whether a save may follow ``step``: a checkpoint step, or the last one."""
    return step >= last_step or (checkpoint_enabled and interval_steps > 0 and step % interval_steps == 0)
