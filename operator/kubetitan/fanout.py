"""Slow start for a gang's creates: each accepted create admits two more, a refused one stops the sending.

Kubernetes' ReplicaSet and Job controllers create pods in batches of 1, 2, 4, 8, ... (``slowStartBatch``) so that
a quota or an admission rule that refuses every pod costs one refused request, not one per pod. Their batches
wait for each other: a round ends with its slowest create. Here the same bound holds without the barrier: after
``k`` accepted creates at most ``2k + 1`` were started, exactly as after the batches 1, 2, 4, ..., but a create
that waits out a ``Retry-After`` (429/503, retried inside ``kube.Client``) holds back only itself, not the
next round. The API server is not hammered: ``kube.Client``'s semaphore still caps the requests in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


async def slow_start(items: Sequence[T], send: Callable[[T], Awaitable[bool]]) -> int:
    """Send ``items`` in order, a window that grows by two with each accepted one (``send`` -> True).

    After the first refusal (``send`` -> False) nothing more is started; the creates already started finish.
    An exception from ``send`` (e.g. ``leader.NotLeader``: this replica lost the Lease) also stops the sending;
    it is raised once the started ones have finished, so no create is left running unowned (and a cancelled
    ``slow_start`` cancels them). Returns how many items were never sent.
    """
    started = accepted = 0
    refused = False
    error: BaseException | None = None
    running: set[asyncio.Task[bool]] = set()
    finished: asyncio.Queue[asyncio.Task[bool]] = asyncio.Queue()  # each task, as it ends (its done callback)
    while True:
        while not refused and error is None and started < len(items) and started < 2 * accepted + 1:
            task = asyncio.ensure_future(send(items[started]))
            task.add_done_callback(finished.put_nowait)
            running.add(task)
            started += 1
        if not running:
            return len(items) - started
        try:
            done = [await finished.get()]
        except asyncio.CancelledError:  # the cycle is cancelled (the operator stops): so are its creates
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        while not finished.empty():  # every create that has ended by now, as asyncio.wait(FIRST_COMPLETED) gave
            done.append(finished.get_nowait())
        # (not asyncio.wait: it hooks a callback onto every running task on each call, O(running) per answer, and
        # a 1,024-pod gang has hundreds of tasks waiting on the client's semaphore at once)
        running.difference_update(done)
        for t in done:
            if t.cancelled():
                error = error or asyncio.CancelledError()
            elif t.exception() is not None:
                error = error or t.exception()
            elif t.result():
                accepted += 1
            else:
                refused = True
        if error is not None and not running:
            raise error
