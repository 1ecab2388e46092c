"""The one module where the operator touches kopf's internals: a transform of every watched object.

Pinned: kopf 1.45.2 (constraints.txt). client-go's informers take a transform (``SetTransform``) that drops what a
controller never reads before an object enters the cache; kopf has no such hook. A real API server's objects carry
``metadata.managedFields`` (server-side apply's bookkeeping: a field tree per manager, larger than the spec it
describes), and kopf keeps each run's last body for the run's daemon: on a real server ``managedFields`` was more
than half of the run bodies' memory (docs/benchmarks.md). :func:`install` wraps kopf's watch stream so that every
listed or watched object passes through :func:`trim` before kopf queues, indexes, stores or hands it to a handler.

The operator never reads ``managedFields`` (it writes with merge patches and never sends a watched body back, so the
server's managed fields stay as they are). Nothing else is dropped: every other field of a watched object may be
read by kopf (uid, resourceVersion, finalizers, annotations, deletionTimestamp) or by the operator.

Each upstream thing the shim depends on is declared in :data:`UPSTREAM`; ``tests/operator/test_compat.py`` checks
them against the installed kopf (signature, the call site's source) and runs kopf's watch stream end to end, so an
upgrade that moves the stream fails there with the symbol's name, not as a silent loss of the transform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator
from typing import Any

KOPF_VERSION = "1.45.2"
"""The kopf version the shim was written and checked against."""

DROPPED_METADATA = ("managedFields",)
"""Keys of a watched object's ``metadata`` the operator and kopf never read: dropped before kopf sees the object."""


@dataclasses.dataclass(frozen=True)
class Upstream:
    """One kopf internal the shim depends on: ``symbol`` is ``module:qualified.name``."""

    symbol: str
    params: tuple[str, ...] | None = None
    """Its parameter names, in order (``inspect.signature``); None: unchecked."""
    contains: tuple[str, ...] = ()
    """Source text it must contain (a call the shim relies on going through a module attribute)."""
    why: str = ""


UPSTREAM: tuple[Upstream, ...] = (
    Upstream("kopf._cogs.clients.watching:infinite_watch",
             params=("settings", "resource", "namespace", "operator_paused", "_iterations"),
             why="the stream of listed and watched events the shim wraps: an async iterator of raw events "
                 "({'type', 'object'}) and Bookmark markers, called with keywords only"),
    Upstream("kopf._core.reactor.queueing:watcher", contains=("watching.infinite_watch(",),
             why="kopf's only consumer of the stream; it looks the function up on the module at each call, so "
                 "rebinding the module attribute reaches it"),
)


def trim(obj: Any) -> Any:
    """Drop :data:`DROPPED_METADATA` from one object, in place; anything not shaped like an object is left alone."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if isinstance(meta, dict):
        for key in DROPPED_METADATA:
            meta.pop(key, None)
    return obj


def install() -> None:
    """Wrap kopf's watch stream so that every event's object passes through :func:`trim` (idempotent)."""
    from kopf._cogs.clients import watching

    original = watching.infinite_watch
    if getattr(original, "_kubetitan_trim", False):
        return

    @functools.wraps(original)
    async def infinite_watch(**kwargs: Any) -> AsyncIterator[Any]:
        async with contextlib.aclosing(original(**kwargs)) as stream:
            async for event in stream:
                if isinstance(event, dict):
                    trim(event.get("object"))
                yield event

    infinite_watch._kubetitan_trim = True  # type: ignore[attr-defined]
    watching.infinite_watch = infinite_watch
