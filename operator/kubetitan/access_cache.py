"""A short-lived, bounded cache of SubjectAccessReview answers for the webhook's requester checks.

The API server's own webhook authorizer caches its answers the same way (``--authorization-webhook-cache-
authorized-ttl`` 5 min, ``...-unauthorized-ttl`` 30 s): a repeated ``kubectl apply`` by the same user of the same
spec asks nothing again, and a burst of identical requests asks once (the first request's review is shared by
those that arrive while it is in flight). The price is staleness, bounded and documented (docs/install.md,
"Trust model"): a permission revoked now may still be honoured for ``allowed_seconds``, one granted now may still
be refused for ``denied_seconds``. A review that failed (API error, timeout) is never cached.

The key is everything a SubjectAccessReview's answer depends on: the user (name, groups, uid, extra) and the
resource attributes (verb, group, resource, namespace, name). The entries are a ``cachetools.TLRUCache``: each
answer expires after its own TTL (allowed or denied), at most ``max_entries`` are kept (the least recently used
dropped first, expired ones before any); the clock is injectable, so expiry is tested without sleeping. What is
ours is the key, the two TTLs and the sharing of a review in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from cachetools import TLRUCache

from kubetitan.admission import Access

Answer = bool | str
"""True, or the reason the access was denied (``kubetitan.admission.review``'s answers)."""


@dataclass(frozen=True)
class CacheConfig:
    allowed_seconds: float = 30.0
    """How long an allowed answer is reused (0: never cached): the longest a revoked permission is still honoured."""
    denied_seconds: float = 5.0
    """How long a denied answer is reused (0: never cached): the longest a new grant is still refused."""
    max_entries: int = 4096
    """The most answers kept (least recently used dropped first); 0 disables the cache."""


def key(check: Access, user: Mapping[str, Any]) -> tuple[Hashable, ...]:
    """Everything the answer to ``check.sar(user)`` depends on."""
    extra = tuple(sorted((str(k), tuple(str(x) for x in v)) for k, v in (user.get("extra") or {}).items()))
    return (str(user.get("username", "")), tuple(sorted(str(g) for g in user.get("groups") or ())),
            str(user.get("uid") or ""), extra, check.verb, check.group, check.resource, check.namespace, check.name)


class AccessCache:
    """SubjectAccessReview answers by :func:`key`, each until its expiry; concurrent misses of one key share one
    review."""

    def __init__(self, config: CacheConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or CacheConfig()
        self.clock = clock
        self._entries: TLRUCache | None = (
            TLRUCache(self.config.max_entries, self._expiry, timer=clock) if self.config.max_entries > 0 else None)
        self._inflight: dict[tuple[Hashable, ...], asyncio.Future[Answer]] = {}
        self.hits = 0
        self.misses = 0

    def _expiry(self, _key: tuple[Hashable, ...], answer: Answer, now: float) -> float:
        return now + (self.config.allowed_seconds if answer is True else self.config.denied_seconds)

    def __len__(self) -> int:
        return 0 if self._entries is None else len(self._entries)

    def lookup(self, k: tuple[Hashable, ...]) -> Answer | None:
        """The cached answer, or None (missing or expired)."""
        return None if self._entries is None else self._entries.get(k)

    def store(self, k: tuple[Hashable, ...], answer: Answer, cacheable: bool = True) -> None:
        """Keep ``answer`` for its TTL (not at all when not ``cacheable``, or with a TTL of 0: an entry that expires
        at once is not stored)."""
        if cacheable and self._entries is not None:
            self._entries[k] = answer

    async def get(self, check: Access, user: Mapping[str, Any],
                  ask: Callable[[], Awaitable[tuple[Answer, bool]]]) -> Answer:
        """The answer for ``check`` and ``user``: cached, or from ``ask()`` (which returns the answer and whether it
        may be cached: False for a review that failed). Concurrent callers for one key share the first one's
        ``ask()``; when that caller is cancelled (its admission request timed out), the others ask again instead of
        failing with it."""
        k = key(check, user)
        while True:
            cached = self.lookup(k)
            if cached is not None:
                self.hits += 1
                return cached
            if (pending := self._inflight.get(k)) is None:
                break
            self.hits += 1
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not pending.cancelled() or (task is not None and task.cancelling()):
                    raise  # this caller itself was cancelled
                self.hits -= 1  # the first asker was cancelled (its client gave up): ask again
        self.misses += 1
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._inflight[k] = fut
        try:
            answer, cacheable = await ask()
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(e)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._inflight.pop(k, None)
        self.store(k, answer, cacheable)
        fut.set_result(answer)
        return answer
