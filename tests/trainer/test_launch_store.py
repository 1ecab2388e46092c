"""The launchers' rendezvous-store protocol (``kubetitan_trainer.launch.store``) over an in-memory store, without
torch: a gang's generation ends, every launcher posts its failure, reads the one that began the next generation and
rejoins on one counter. The in-place agent (``launch.agent``) drives these calls; tests/e2e/test_inplace.py runs
them on torch's TCPStore. Pure; well under a second."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from kubetitan_core.contract import ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_trainer.launch import store as rdzv_store
from support.memstore import MemStore


def failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    """A worker failure in torch elastic's ``ProcessFailure`` shape."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message="")


class Counted(MemStore):
    """Sets ``counted`` at the first count of a rejoin."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = threading.Event()

    def add(self, key: str, amount: int) -> int:
        value = super().add(key, amount)
        if amount:
            self.counted.set()
        return value


def test_a_three_node_gang_ends_a_generation_agrees_on_its_failure_and_rejoins() -> None:
    store, generation, nnodes = Counted(), 4, 3
    assert rdzv_store.earliest_failure(store, generation, nnodes) is None
    assert not rdzv_store.rejoin_announced(store, generation + 1)
    # node 0's worker died of the broken collective (generic 1) after node 2's was SIGKILLed: the kill is the cause
    rdzv_store.post_failure(store, generation, 0, {1: failure(1, 101), 0: failure(1, 102)})
    rdzv_store.post_failure(store, generation, 2, {0: failure(-9, 100)})
    got = rdzv_store.earliest_failure(store, generation, nnodes)
    assert (got.exit_code, got.node_rank, got.local_rank) == (137, 2, 0)
    assert rdzv_store.earliest_failure(store, generation + 1, nnodes) is None  # the next generation failed nowhere

    done: list[int] = []

    def join(node: int) -> None:
        rdzv_store.rejoin(store, generation + 1, nnodes, timeout=60.0, poll=0.001)
        done.append(node)

    threads = [threading.Thread(target=join, args=(n,)) for n in range(nnodes - 1)]
    threads[0].start()
    # the first count is the announcement that a healthy peer's agent sees (then it restarts its own workers)
    assert store.counted.wait(60)
    assert rdzv_store.rejoin_announced(store, generation + 1)
    assert not done  # it waits for the others
    threads[1].start()
    join(nnodes - 1)  # the last node's count completes the round: every one returns
    for t in threads:
        t.join(60)
    assert sorted(done) == [0, 1, 2]


def test_a_hang_names_its_node_only_when_its_worker_was_stopped_and_beats_the_crashes_it_caused() -> None:
    store = MemStore()
    hang = FailureReport(exit_code=int(ExitCode.HANG), node_rank=0, time=5.0, stopped=True)
    rdzv_store.post_failure(store, 0, 1, {0: failure(-6, 4)})  # a peer's NCCL abort, seen first
    rdzv_store.post_failure(store, 0, 0, {}, hang)
    got = rdzv_store.earliest_failure(store, 0, 2)
    assert (got.exit_code, got.node_rank, got.seen_by) == (int(ExitCode.HANG), 0, 0)


def test_a_rejoin_without_every_peer_times_out_naming_the_count() -> None:
    store, now = MemStore(), [0.0]
    rdzv_store.rejoin(store, 1, 1, timeout=5.0)  # a gang of one is complete at once
    with pytest.raises(TimeoutError, match="only 1 of 2 nodes rejoined for worker generation 2 within 5 s"):
        rdzv_store.rejoin(store, 2, 2, timeout=5.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + 1))


class Broken(MemStore):
    def set(self, key, value):
        raise ConnectionError("store gone")

    def check(self, keys):
        raise ConnectionError("store gone")


def test_a_store_that_fails_costs_the_report_never_the_restart(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kubetitan.launch"):
        rdzv_store.post_failure(Broken(), 0, 0, {0: failure(1, 1)})
        assert rdzv_store.earliest_failure(Broken(), 0, 2) is None
    assert "Could not post the worker failure to the rendezvous store: store gone" in caplog.text
    assert "Could not read kubetitan/failure/0/1 from the rendezvous store: store gone" in caplog.text
