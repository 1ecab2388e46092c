"""The launchers' protocol over their shared rendezvous store, torch-free.

An in-place restart's launchers talk through the agents' TCPStore (hosted by node rank 0's launcher): each posts the
worker failure that ended a generation (:func:`post_failure`), every launcher reads the one that began the next
(:func:`earliest_failure`), and the same gang restarts without a new rendezvous round by counting its agents on one
key (:func:`rejoin`; the first count is also the announcement a healthy peer sees, :func:`rejoin_announced`).

``store`` is anything with the four calls of torch's ``Store`` used here: ``set(key, value)``, ``get(key) -> bytes``,
``check([key]) -> bool`` and ``add(key, n) -> int`` (tests use a dict-backed one)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

from kubetitan_core.contract import ExitCode
from kubetitan_core.contract.failure import FailureReport
from kubetitan_trainer.launch.failures import exit_code, first_failure

log = logging.getLogger("kubetitan.launch")


class Store(Protocol):
    """The calls of ``torch.distributed.Store`` the protocol uses."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, amount: int) -> int: ...


FAILURE_KEY = "kubetitan/failure/{generation}/{node_rank}"
"""Rendezvous-store key under which a launcher posts the worker failure that ended ``generation``."""


def post_failure(store: Store, generation: int, node_rank: int, failures: dict, hang_report: FailureReport | None = None) -> None:
    """Post this pod's first worker failure (exit code, node rank, time) for rank 0's next generation; a hang the
    watchdog stopped (``hang_report``, :meth:`~kubetitan_trainer.launch.agent.InPlaceAgent._stop_hung`) is posted as that instead. A hang with
    no stopped worker names no node (node rank -1, seen by ``seen_by``): in a gang every rank's step stands still
    together, every watchdog fires within a tick of the others, and which one was first says nothing of where the
    hang is (the operator's "same node twice in a row" escalation must not count it)."""
    if hang_report is not None:
        rec = dataclasses.replace(hang_report, node_rank=node_rank if hang_report.stopped else -1, seen_by=node_rank)
    else:
        rank, first = first_failure(failures)
        rec = FailureReport(exit_code=exit_code(first), node_rank=node_rank, local_rank=rank, time=time.time())
    try:
        store.set(FAILURE_KEY.format(generation=generation, node_rank=node_rank), rec.to_json())
    except Exception as e:  # noqa: BLE001 - the restart goes on without the report; the operator says Unknown
        log.warning("Could not post the worker failure to the rendezvous store: %s", e)


def failure_order(f: FailureReport) -> tuple:
    """Sort key of posted failures, the one that began the generation first: a hang whose launcher found its
    worker stopped (state T: it is the hung one; the others' workers only waited for it in a collective, and
    crash when the watchdog kills it: SIGABRT from NCCL, signal 9 or 15), then any code but the generic 1 (a
    peer's collective fails with 1 the moment the first worker dies), then the earliest."""
    stopped_hang = f.exit_code == ExitCode.HANG and f.stopped
    return (not stopped_hang, f.exit_code == ExitCode.FAILED, f.time)


def earliest_failure(store: Store, generation: int, nnodes: int) -> FailureReport | None:
    """The failure that began ``generation``, of those the pods posted (:func:`failure_order`). The others are
    usually its collateral (seen here with 0.1 s monitor intervals: a SIGKILLed worker lost to its peer's 1)."""
    found = []
    for r in range(nnodes):
        key = FAILURE_KEY.format(generation=generation, node_rank=r)
        try:
            if store.check([key]) and (report := FailureReport.from_json(store.get(key))) is not None:
                found.append(report)
        except Exception as e:  # noqa: BLE001 - as above
            log.warning("Could not read %s from the rendezvous store: %s", key, e)
    return min(found, key=failure_order) if found else None


REJOIN_KEY = "kubetitan/rejoin/{generation}"
"""Rendezvous-store counter of the agents that have stopped their workers for ``generation`` (see :func:`rejoin`)."""


def rejoin(store: Store, generation: int, nnodes: int, timeout: float, poll: float = 0.01, clock=time.monotonic,
           sleep=time.sleep) -> None:
    """Wait until every node's agent has stopped its workers for ``generation``, then return (no new round).

    An in-place restart keeps the gang: the same pods, node ranks and world size (min = max nodes), so torch's
    c10d rendezvous round (exit the old round, join the next, complete it: several polls of its shared state,
    measured 0.5-2.8 s on this repository's 2-core machine) only re-establishes what is already known. Instead
    each agent adds 1 to one counter in the agents' store (the first add is also the announcement that the peers'
    ``num_nodes_waiting`` reports (:func:`rejoin_announced`), so their healthy workers restart) and waits for the count
    to reach ``nnodes``, polling every ``poll`` s. The previous rank assignment, store and master address stay.
    Raises TimeoutError after ``timeout`` s (a peer's launcher is gone: its pod fails and the operator re-creates
    the gang)."""
    key = REJOIN_KEY.format(generation=generation)
    count = store.add(key, 1)
    deadline = clock() + timeout
    while count < nnodes:
        if clock() > deadline:
            raise TimeoutError(f"only {count} of {nnodes} nodes rejoined for worker generation {generation} within "
                               f"{timeout:.0f} s (a peer's launcher is gone?)")
        sleep(poll)
        count = store.add(key, 0)


def rejoin_announced(store: Store, generation: int) -> bool:
    """Whether some agent has announced ``generation`` (its first :func:`rejoin` count): this agent's healthy
    workers must then restart too."""
    return bool(store.check([REJOIN_KEY.format(generation=generation)]))
