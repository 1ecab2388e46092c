"""compat's registry: every shim declares the upstream things it depends on (:class:`Upstream`), kept in
:data:`SHIMS` for the canary tests and the doc table; :func:`_rebind`, the one place upstream attributes are
rebound."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


TORCH_VERSION = "2.11"


TORCHTITAN_VERSION = "0.2.2"
"""The versions every shim below was written and checked against."""


@dataclasses.dataclass(frozen=True)
class Upstream:
    """One upstream thing a shim depends on: ``symbol`` is ``module:qualified.name``."""

    symbol: str
    params: tuple[str, ...] | None = None
    """The parameter names (``inspect.signature``, in order) the shim calls, overrides or mirrors; None: unchecked."""
    sets: tuple[str, ...] = ()
    """Attributes the symbol (a function: its body; a class: its ``__init__``) assigns on ``self``."""
    sets_exactly: bool = False
    """True: ``sets`` is the complete list (the shim mirrors an ``__init__`` and must set the same attributes)."""
    contains: tuple[str, ...] = ()
    """Source text the symbol must contain: a call made through a name kubetitan rebinds, a key it reads."""


SHIMS: dict[str, tuple[Upstream, ...]] = {}
"""Shim name -> the upstream things it depends on (the canary tests and the doc table iterate this)."""


def _shim(*upstream: Upstream) -> Callable:
    def register(fn: Callable) -> Callable:
        SHIMS[fn.__name__] = upstream
        return fn

    return register


CONSTANT_SUMMARIES: dict[str, str] = {}
"""Constant name -> its one-line description (the doc table's; a constant has no introspectable docstring)."""


def _declare(name: str, summary: str, *upstream: Upstream) -> None:
    SHIMS[name] = upstream
    CONSTANT_SUMMARIES[name] = summary


def _rebind(obj: Any, name: str, value: Any) -> None:
    """The one place attributes of upstream modules, classes and objects are rebound."""
    setattr(obj, name, value)
