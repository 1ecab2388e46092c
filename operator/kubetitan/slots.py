"""A semaphore that grants its free slots by priority instead of in arrival order.

Both bounded resources of the operator need it: the API client's request slots (``kube.Slots``: a retry keeps the
place its call had) and the scrape slots (``observation.scrape.FairSlots``: the run whose scrapes cost the least goes
first). A slot is handed to its waiter directly on release, so no newcomer can take it in between; a waiter
cancelled after being handed one passes it on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PrioritySlots:
    """At most ``n`` holders; a free slot goes to the waiter with the smallest priority, the oldest among equals."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []  # a heap: (priority, tie-break, future)
        self._ties = itertools.count()

    @property
    def waiting(self) -> int:
        """Holders queued for a slot (cancelled ones not yet skipped included)."""
        return len(self._waiting)

    async def acquire(self, priority: float) -> None:
        if self._free > 0:  # a free slot means nobody waits: release hands a slot straight to a waiter
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._ties), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot just as it gave up: pass it on
                self.release()
            raise  # (a cancelled future stays in the heap; release skips it)

    def release(self) -> None:
        while self._waiting:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1
