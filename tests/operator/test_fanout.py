"""kubetitan.fanout.slow_start: the gang's create fan-out (each accepted create admits two more, no barrier).

The sends are fakes that finish when the test says so (asyncio Events), so every check is about which creates
had started at that point, never about time.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable

import pytest

from kubetitan.fanout import slow_start


WAITING: contextvars.ContextVar = contextvars.ContextVar("test_fanout_waiting", default=None)
"""Stands for ``kube.RETRY_WAIT``: how a fake create tells slow_start it waits to be tried again."""


class Sends:
    """Fake creates: ``answer(i, ok)`` finishes create ``i``; ``started`` lists the ones begun, in order;
    ``wait(i, True)`` / ``wait(i, False)``: create ``i`` starts / stops waiting out a Retry-After."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.gates: dict[int, asyncio.Future[bool]] = {}
        self.notes: dict[int, Callable[[bool], None]] = {}

    async def __call__(self, i: int) -> bool:
        self.started.append(i)
        self.gates[i] = asyncio.get_running_loop().create_future()
        if WAITING.get() is not None:
            self.notes[i] = WAITING.get()
        return await self.gates[i]

    async def wait(self, i: int, waiting: bool) -> None:
        self.notes[i](waiting)
        await self.settle()

    async def settle(self) -> None:
        """Let slow_start react to what was answered (it starts new sends before it waits again)."""
        for _ in range(5):
            await asyncio.sleep(0)

    def answer(self, i: int, ok: bool = True, error: BaseException | None = None) -> None:
        if error is not None:
            self.gates[i].set_exception(error)
        else:
            self.gates[i].set_result(ok)

    async def step(self, *accepted: int) -> None:
        """Accept these creates, then let slow_start react."""
        for i in accepted:
            self.answer(i)
        await self.settle()


def _play(n: int, script: Callable[[Sends, asyncio.Task[int]], Awaitable[None]], told: bool = False) -> None:
    """Run ``slow_start`` over ``n`` fake creates and ``script`` against it, once its first sends have started
    (``told``: the creates tell it when they wait to be tried again)."""
    async def main() -> None:
        s = Sends()
        task = asyncio.create_task(slow_start(list(range(n)), s, waiting=WAITING if told else None))
        await s.settle()
        await script(s, task)

    asyncio.run(main())


def test_each_accepted_create_admits_two_more_like_the_batches_1_2_4() -> None:
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        assert s.started == [0]  # one create first: a refusing quota costs one request
        await s.step(0)
        assert s.started == [0, 1, 2]
        await s.step(1, 2)
        assert s.started == [0, 1, 2, 3, 4, 5, 6]  # after k accepted, 2k + 1 started (batches 1, 2, 4)
        await s.step(*range(3, 7))
        assert s.started == list(range(10))
        for i in range(7, 10):
            s.answer(i)
        assert await task == 0

    _play(10, script)


def test_a_slow_create_holds_back_only_itself() -> None:
    """A create waiting out a Retry-After does not stop the next ones (the batch version waited for it)."""
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        await s.step(0)
        await s.step(2)  # 1 is still waiting (its 429's Retry-After)
        assert s.started == [0, 1, 2, 3, 4]
        await s.step(3, 4)
        assert s.started == list(range(8))  # 4 accepted -> all 8 started; 1 still not answered
        for i in (1, 5, 6, 7):
            s.answer(i)
        assert await task == 0

    _play(8, script)


def test_a_create_told_to_come_back_later_lends_its_place_to_the_next_one() -> None:
    """A create waiting out a Retry-After has no verdict yet: its place goes to the next create, at most k + 1 places
    after k accepted. The probe told to wait lets one more go, never two before the first acceptance (a server
    throttling everything gets two creates, not the gang); a throttled create among the first no longer stalls the
    gang for its Retry-After."""
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        assert s.started == [0]
        await s.wait(0, True)  # the probe is answered 429: one more create goes in its place
        assert s.started == [0, 1]
        await s.wait(1, True)  # throttled too: nothing more before an acceptance
        assert s.started == [0, 1]
        await s.wait(1, False)
        await s.step(1)  # 1 accepted, 0 still waiting: 2k + 1 = 3, plus 1 lent place
        assert s.started == [0, 1, 2, 3]
        await s.wait(2, True)
        await s.wait(3, True)  # three waiting, k = 1: at most k + 1 = 2 lent
        assert s.started == [0, 1, 2, 3, 4]
        await s.step(4)  # k = 2: 5 + min(3, 3)
        assert s.started == list(range(8))
        for i in (0, 2, 3):
            await s.wait(i, False)  # sent again: the lent places are not taken back from creates already started
        assert s.started == list(range(8))
        await s.step(0, 2, 3)  # k = 5: all ten started
        assert s.started == list(range(10))
        for i in range(5, 10):
            s.answer(i)
        assert await task == 0

    _play(10, script, told=True)


def test_a_refusal_stops_the_sending_and_the_started_ones_finish() -> None:
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        await s.step(0)
        s.answer(1, ok=False)  # refused (a quota): nothing more starts
        await s.settle()
        assert s.started == [0, 1, 2]
        assert not task.done()  # 2 is still in flight: waited for
        s.answer(2)
        assert await task == 97  # never sent
        assert s.started == [0, 1, 2]

    _play(100, script)


def test_an_error_is_raised_after_the_started_ones_finish() -> None:
    """E.g. leader.NotLeader from the fence: nothing more is sent, nothing is left running, the error goes up."""
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        await s.step(0)
        s.answer(1, error=RuntimeError("lost the Lease"))
        await s.settle()
        assert not task.done() and s.started == [0, 1, 2]
        s.answer(2)
        with pytest.raises(RuntimeError, match="lost the Lease"):
            await task
        assert s.started == [0, 1, 2]

    _play(10, script)


def test_no_create_task_ends_with_an_exception_for_kopf_to_raise_again() -> None:
    """While the operator stops, kopf re-raises the exception of every task of the loop that ends
    (``kopf._core.reactor.running.run_tasks``), even one slow_start has handled: a create that failed on the closed
    client (``kube.ClientClosed``) crashed the operator's exit (tests/operator/test_webhook.py, session 19). The error
    still reaches slow_start's caller; the tasks themselves end with a result."""
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        before = asyncio.all_tasks()
        await s.step(0)
        creates = asyncio.all_tasks() - before - {task}
        s.answer(1, error=RuntimeError("the client is closed (the operator is stopping)"))
        s.answer(2)
        with pytest.raises(RuntimeError, match="the client is closed"):
            await task
        assert len(creates) == 2 and all(t.done() and not t.cancelled() and t.exception() is None for t in creates)

    _play(10, script)


def test_gather_runs_every_write_to_its_end_then_raises_the_first_error_and_leaves_no_failed_task() -> None:
    from kubetitan.fanout import gather

    async def main() -> None:
        ended: list[str] = []

        async def write(name: str, gate: asyncio.Future) -> str:
            try:
                return await gate
            finally:
                ended.append(name)

        loop = asyncio.get_running_loop()
        gates = [loop.create_future() for _ in range(3)]
        before = asyncio.all_tasks()
        job = asyncio.create_task(gather(*(write(str(i), g) for i, g in enumerate(gates))))
        for _ in range(3):
            await asyncio.sleep(0)
        tasks = asyncio.all_tasks() - before - {job}
        gates[0].set_exception(RuntimeError("the client is closed"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not job.done()  # the others still run: nothing is left unowned
        gates[1].set_result("b")
        gates[2].set_result("c")
        with pytest.raises(RuntimeError, match="the client is closed"):
            await job
        assert sorted(ended) == ["0", "1", "2"]
        assert len(tasks) == 3 and all(t.done() and not t.cancelled() and t.exception() is None for t in tasks)
        assert await gather(asyncio.sleep(0, "x"), asyncio.sleep(0, "y")) == ["x", "y"]

    asyncio.run(main())


def test_cancelling_it_cancels_the_creates_in_flight() -> None:
    async def script(s: Sends, task: asyncio.Task[int]) -> None:
        await s.step(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(s.gates[i].cancelled() for i in (1, 2))

    _play(10, script)


def test_nothing_to_send() -> None:
    async def main() -> None:
        s = Sends()
        assert await slow_start([], s) == 0 and s.started == []

    asyncio.run(main())
