"""Times as the Kubernetes API writes them (RFC 3339, UTC) and back: the status's timestamps, the observation's
timers, the conditions' transition times."""

from __future__ import annotations

import datetime as dt


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_ms(ts: float) -> str:
    """RFC 3339 with milliseconds (timers kept in the status)."""
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def parse_time(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
