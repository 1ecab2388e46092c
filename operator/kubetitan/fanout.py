"""Slow start for a gang's creates: each accepted create admits two more, a refused one stops the sending.

Kubernetes' ReplicaSet and Job controllers create pods in batches of 1, 2, 4, 8, ... (``slowStartBatch``) so that
a quota or an admission rule that refuses every pod costs one refused request, not one per pod. Their batches
wait for each other: a round ends with its slowest create. Here the same bound holds without the barrier: after
``k`` accepted creates at most ``2k + 1`` were started, exactly as after the batches 1, 2, 4, ..., but a create
that waits out a ``Retry-After`` (429/503, retried inside ``kube.Client``) holds back only itself, not the
next round. The API server is not hammered: ``kube.Client``'s request slots still cap the requests in flight.

A create the server told to come back later has had no verdict yet (neither accepted nor refused). With
``slowStartBatch`` (client-go retries inside the create call) it holds its whole batch: one throttled create
among the first stalls the gang for a full ``Retry-After``. Here, while it waits (the client says so through the
``waiting`` context variable, ``kube.RETRY_WAIT``), its place in the window is lent to the next create, at most
``k + 1`` places after ``k`` accepted: the bound becomes ``3k + 2`` started, so a quota that refuses the whole gang
still costs a handful of refused creates, and a server that throttles every create still gets at most two of
this gang's creates before it accepts one.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


async def _settled(create: Awaitable[T]) -> T | Exception:
    """A create's verdict (or any write's result), or the exception it raised, as the task's result: no such task
    ever ends with an exception. kopf re-raises the exception of every task of the loop that ends while the operator stops
    (``kopf._core.reactor.running.run_tasks``, its "hung" tasks), even one :func:`slow_start` has already handled:
    a create that met the client's closing (``kube.ClientClosed``) during a stop crashed the operator's exit."""
    try:
        return await create
    except Exception as e:  # noqa: BLE001 - handed to slow_start, which raises the first once the others end
        return e


async def gather(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` for the operator's writes: every awaitable runs to its end in a task that never ends with
    an exception (:func:`_settled`), then the first exception, if any, is raised. Nothing is left running unowned,
    and nothing is left for kopf to raise again while the operator stops."""
    results = await asyncio.gather(*(_settled(a) for a in aws))
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results  # type: ignore[return-value]


# long: one loop that starts, collects and judges the creates (splitting it would spread its invariants over helpers)
async def slow_start(items: Sequence[T], send: Callable[[T], Awaitable[bool]],
                     waiting: contextvars.ContextVar[Callable[[bool], None] | None] | None = None) -> int:
    """Send ``items`` in order, a window that grows by two with each accepted one (``send`` -> True).

    After the first refusal (``send`` -> False) nothing more is started; the creates already started finish.
    An exception from ``send`` (e.g. ``leader.NotLeader``: this replica lost the Lease) also stops the sending;
    it is raised once the started ones have finished, so no create is left running unowned (and a cancelled
    ``slow_start`` cancels them). Returns how many items were never sent.

    ``waiting``: a context variable each ``send`` runs with, set to a function that its callee calls with True
    while the item waits to be tried again (``kube.RETRY_WAIT``) and False when it is sent again; while some wait,
    up to ``accepted + 1`` more items may start in their place (see the module's docstring).
    """
    started = accepted = 0
    refused = False
    error: BaseException | None = None
    running: dict[asyncio.Task[bool], int] = {}  # task -> its item's index
    parked: set[int] = set()  # items waiting to be tried again (told through ``waiting``)
    # each task as it ends (its done callback); None when an item starts waiting (the window may have grown)
    finished: asyncio.Queue[asyncio.Task[bool] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def told(i: int) -> Callable[[bool], None]:
        def note(wait: bool) -> None:
            if wait:
                parked.add(i)
                finished.put_nowait(None)
            else:
                parked.discard(i)
        return note

    while True:
        while (not refused and error is None and started < len(items)
               and started < 2 * accepted + 1 + min(len(parked), accepted + 1)):
            ctx = None
            if waiting is not None:  # this create's own context: its ``waiting`` names its item
                ctx = contextvars.copy_context()
                ctx.run(waiting.set, told(started))
            task = loop.create_task(_settled(send(items[started])), context=ctx)
            task.add_done_callback(finished.put_nowait)
            running[task] = started
            started += 1
        if not running:
            return len(items) - started
        try:
            ended = [await finished.get()]
        except asyncio.CancelledError:  # the cycle is cancelled (the operator stops): so are its creates
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        while not finished.empty():  # every create that has ended by now, as asyncio.wait(FIRST_COMPLETED) gave
            ended.append(finished.get_nowait())
        # (not asyncio.wait: it hooks a callback onto every running task on each call, O(running) per answer, and
        # a 1,024-pod gang has hundreds of tasks waiting on the client's request slots at once)
        done = [t for t in ended if t is not None]
        for t in done:
            parked.discard(running.pop(t))
        for t in done:
            if t.cancelled():
                error = error or asyncio.CancelledError()
            elif isinstance(t.result(), BaseException):
                error = error or t.result()
            elif t.result():
                accepted += 1
            else:
                refused = True
        if error is not None and not running:
            raise error
