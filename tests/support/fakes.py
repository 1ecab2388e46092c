"""Small stand-ins the unit tests share: a clock that moves only when a test moves it, the operator's options
parsed from a command line."""

from __future__ import annotations


class FakeClock:
    """``clock()`` is ``clock.now``, which stands still until a test moves it (expiry, TTLs and Lease terms are
    tested without sleeping)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def operator_options(*argv: str):
    """``kubetitan operator -A ARGV...`` parsed into the operator's options (as the CLI does)."""
    from kubetitan import runner

    return runner.options_from_args(runner.build_parser().parse_args(["-A", *argv]))
