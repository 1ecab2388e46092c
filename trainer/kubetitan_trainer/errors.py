"""Exceptions that map to the documented exit codes (``kubetitan_core.contract.ExitCode``)."""

from __future__ import annotations

from kubetitan_core.contract import ExitCode


class ConfigError(Exception):
    """The configuration cannot work. Exit code 2; the message names the field and the fix."""

    exit_code = ExitCode.CONFIG_ERROR

    def __init__(self, field: str, problem: str, fix: str, rule: str = "") -> None:
        self.field, self.problem, self.fix = field, problem, fix
        self.rule = rule
        """The ``kubetitan_core.validation.RULES`` id this re-checks, or empty for a trainer-only check."""
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class NonFiniteLossError(Exception):
    """The loss became NaN or infinite. Exit code 3."""

    exit_code = ExitCode.NON_FINITE_LOSS

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"The loss became non-finite (NaN or inf) at step {step}; the run resumes from the last "
            "checkpoint. If it repeats, lower spec.training.learningRate or spec.training.maxNorm"
        )


class StorageFullError(Exception):
    """The checkpoint volume has less free space than the next save needs. Exit code 4 (not retried)."""

    exit_code = ExitCode.STORAGE_FULL

    def __init__(self, folder: str, free: int, needed: int, other_rank: bool = False, short_bytes: int = 0) -> None:
        self.folder, self.free, self.needed, self.other_rank = folder, free, needed, other_rank
        where = (f"Another rank's checkpoint volume lacks {short_bytes / 2**30:.2f} GiB for the next save (this "
                 f"rank's, at {folder}, has {free / 2**30:.2f} GiB free)" if other_rank else
                 f"The checkpoint volume at {folder} has {free / 2**30:.2f} GiB free; the next save needs about "
                 f"{needed / 2**30:.2f} GiB")
        super().__init__(f"{where}. Free space, enlarge the volume or lower spec.checkpoint.keepLatestK, then "
                         "re-create the run")


class NetworkNotEfaError(Exception):
    """EFA was requested on eks/hyperpod but NCCL is not on it. Exit code 5 (not retried)."""

    exit_code = ExitCode.NETWORK_NOT_EFA


class TransientError(Exception):
    """A transient failure (network errors, HTTP 429/5xx) that outlasted the trainer's own retries. Exit code 6
    (``RETRYABLE``): the operator restarts the run like any other failure."""

    exit_code = ExitCode.RETRYABLE
