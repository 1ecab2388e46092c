"""What changed between the spec an attempt was created from and the spec now, by wire path: applied at once,
deferred to the next attempt, or refused (``status.spec_gate`` says what each does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


LIVE_FIELDS = ("training.steps", "runPolicy")
"""Applied at once while running: the operator reads them every cycle (steps: from the next attempt
for the trainer, at once for the status)."""
REJECTED_FIELDS = ("model", "tokenizer", "checkpoint.storage", "checkpoint.mountPath", "checkpoint.enabled")
"""Would make the existing checkpoints unusable: refused while the run has an attempt; revert them,
or create a new LlamaPretrain."""


def _flatten(d: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leaf paths of nested dicts (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict is a leaf)."""
    out = {} if out is None else out
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = {} if isinstance(d, dict) else d
    return out


def spec_changes(applied: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Changed wire paths between two specs, as (live, deferred, rejected)."""
    a, b = _flatten(dict(applied)), _flatten(dict(desired))
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    live, deferred, rejected = [], [], []
    for k in changed:
        if any(k == f or k.startswith(f + ".") for f in REJECTED_FIELDS):
            rejected.append(k)
        elif any(k == f or k.startswith(f + ".") for f in LIVE_FIELDS):
            live.append(k)
        else:
            deferred.append(k)
    return live, deferred, rejected
