"""The trainer's one retry loop, on tenacity: a call tried again while it fails with an exception its caller calls
transient, with capped exponential waits (full jitter when asked), each failure said in one line.

Its callers keep only their policy: which exceptions are transient, how many tries, what the last failure becomes.
The checkpoint store (``kubetitan_trainer.storage``: the pre-flight LIST, the last save), the S3 staging of shards
(``kubetitan_trainer.data.s3shards``: each ranged GET) and the hub (``kubetitan_trainer.data.downloads.with_retries``: the
tokenizer download, a hub dataset's opening).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (hub and S3 errors carry whole responses)."""
    return (str(e).strip().splitlines() or [""])[0]


def retry(fn: Callable[[], Any], *, what: str, transient: Callable[[BaseException], bool], attempts: int,
          first_wait: float = 1.0, max_wait: float = 30.0, jitter: Callable[[], float] | None = None,
          sleep: Callable[[float], None] | None = None, say: Callable[[str], None] | None = None,
          describe: Callable[[BaseException], str] | None = None) -> Any:
    """``fn()``, tried again while it raises an exception ``transient`` accepts, at most ``attempts`` tries. The wait
    before retry ``n`` (0-based) is ``min(max_wait, first_wait * 2**n)``, times ``jitter()`` (a number in [0, 1]: full
    jitter) when given; without it ranks retrying one collective save stay in step. ``sleep`` waits (default
    ``time.sleep``, looked up at the call). Each failure followed by a retry is said through ``say`` (``what``,
    ``describe(e)`` or the exception's type and first line, the retry's number, the wait). The last exception, or the
    first one ``transient`` refuses, is raised as it is."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    backoff = wait_exponential(multiplier=first_wait, max=max_wait)

    def wait(state: Any) -> float:
        return backoff(state) if jitter is None else jitter() * backoff(state)

    def said(state: Any) -> None:
        if say is None:
            return
        e = state.outcome.exception()
        text = describe(e) if describe is not None else f"{type(e).__name__}: {first_line(e)}"
        say(f"{what}: {text}; retry {state.attempt_number}/{attempts - 1} in {state.next_action.sleep:.1f} s")

    return Retrying(stop=stop_after_attempt(attempts), wait=wait, sleep=time.sleep if sleep is None else sleep,
                    retry=retry_if_exception(transient), before_sleep=said, reraise=True)(fn)
