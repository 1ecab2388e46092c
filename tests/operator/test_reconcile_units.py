"""Pure unit tests of the reconcile package's state: expectations (creates and deletes in flight), the frozen
snapshot and what it gives the decision, the run's memory (no API double, no event loop; milliseconds)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import MappingProxyType
from typing import Any

import pytest

from kubetitan_core import validation
from kubetitan_core.api import LlamaPretrainStatus
from kubetitan import conditions as C
from kubetitan import policy
from kubetitan.observation import ChildError, NodeObs, PodObs
from kubetitan.reconcile.expectations import ENSURED_SECONDS, Expectations
from kubetitan.reconcile.memory import CREATE_RETRY_CAP_SECONDS, CreateRefusals, Packed, RunMemory
from kubetitan.observation.read import parse, read_run
from kubetitan.observation.snapshot import Scrape, Snapshot, children_of, decision_inputs, nodes_of, pods_of
from support.fakes import FakeClock
from support.specs import cpu_spec, lpt

UID = "u-1"


def _exp() -> tuple[Expectations, FakeClock]:
    clock = FakeClock(100.0)
    return Expectations(clock=clock), clock


# ------------------------------------------------------------------ expectations
def test_a_delete_already_sent_is_not_sent_again_while_the_index_lags() -> None:
    """The cycle woken by the first pod's DELETED event still sees the second pod and decides to delete it again:
    the DELETE is not re-sent within ``ENSURED_SECONDS``, a force delete (grace 0) of a pod deleted gracefully
    still goes, and after the window a pod still shown is deleted again (a lost request)."""
    exp, clock = _exp()
    assert exp.to_delete(("a", "b"), (), None) == ["a", "b"]
    assert exp.to_delete(("b",), (), None) == []  # the index still shows b
    assert exp.to_delete(("b",), (), 0) == ["b"]  # its node died: forced out all the same
    assert exp.to_delete(("b",), (), 0) == []
    assert exp.to_delete(("b",), (), None) == []  # forced moments ago: a graceful delete adds nothing
    clock.now += ENSURED_SECONDS
    assert exp.to_delete(("a", "b"), ("b",), None) == ["a"]  # b is in the force list this cycle
    assert set(exp.deleted) == {"a"}  # b's expired record is dropped


@pytest.mark.parametrize(("after", "shown", "want_in_flight"), [
    (0.0, False, True),
    (ENSURED_SECONDS - 0.1, False, True),
    (ENSURED_SECONDS, False, False),
], ids=["just-created", "before-expiry", "expired"])
def test_a_create_counts_as_existing_until_it_expires(after: float, shown: bool, want_in_flight: bool) -> None:
    exp, clock = _exp()
    exp.creating(3)
    exp.expect_created(["r-a3-0", "r-config"], clock())
    clock.now += after
    assert exp.in_flight("r-a3-0", clock()) is want_in_flight
    assert exp.ever_created("r-config")
    assert exp.missing(3, {"r-config": shown}) == (() if want_in_flight else ("r-config",))


def test_another_attempts_creates_do_not_count() -> None:
    exp, clock = _exp()
    exp.creating(0)
    exp.expect_created(["r-config", "r-a0-0"], clock())
    exp.creating(1)
    assert not exp.ever_created("r-config") and not exp.in_flight("r-a0-0", clock())
    exp.creating(1)  # the same attempt: kept
    exp.expect_created(["r-a1-0"], clock())
    exp.creating(1)
    assert exp.in_flight("r-a1-0", clock())


def test_a_child_shown_and_then_gone_is_missing_at_once_and_not_after_it_is_created_again() -> None:
    exp, clock = _exp()
    exp.creating(0)
    exp.expect_created(["r-config", "r"], clock())
    assert exp.missing(0, {"r-config": True, "r": False}) == ()  # r: created moments ago, not shown yet
    assert exp.missing(0, {"r-config": False, "r": True}) == ("r-config",)  # shown once, now gone: deleted by hand
    exp.recreated(["r-config"], clock())
    assert exp.missing(0, {"r-config": False, "r": True}) == ()  # created again: not missing until shown
    clock.now += ENSURED_SECONDS
    assert exp.missing(0, {"r-config": False, "r": True}) == ("r-config",)


def test_missing_for_a_new_attempt_starts_over_and_forget_drops_everything() -> None:
    exp, clock = _exp()
    assert exp.missing(0, {"r-config": True}) == ()
    assert exp.missing(1, {"r-config": False}) == ("r-config",)  # a new attempt: nothing created for it
    exp.expect_created(["r-config"], clock())
    exp.to_delete(["p"], (), None)
    exp.forget()
    assert (exp.attempt, exp.created, exp.seen, exp.deleted) == (-1, {}, set(), {})


# ------------------------------------------------------------------ create refusals
def test_a_refused_create_backs_off_doubling_to_the_cap_and_a_success_resets_it() -> None:
    r = CreateRefusals()
    delays = [r.refused() for _ in range(12)]
    assert 0.25 <= delays[0] <= 0.5 and 0.5 <= delays[1] <= 1.0
    assert all(CREATE_RETRY_CAP_SECONDS / 2 <= d <= CREATE_RETRY_CAP_SECONDS for d in delays[8:])
    assert r.failures == 12 and r.backoff_left() > 0
    r.succeeded()
    assert r.failures == 0 and r.backoff_left() < 0
    r.attempt, r.errors = 2, (ChildError("Pod", "r-a2-0", "Forbidden", "quota"),)
    assert r.of(2) == r.errors and r.of(3) == ()


# ------------------------------------------------------------------ the snapshot
def _body(**status: object) -> dict:
    b = lpt("r", cpu_spec(), uid=UID)
    b["metadata"]["generation"] = 4
    b["status"] = {"kopf": {"progress": {}}, **status}
    return b


def _pod(rank: int, attempt: int = 0, node: str | None = "n1") -> PodObs:
    return PodObs(name=f"r-a{attempt}-{rank}", attempt=attempt, rank=rank, phase="Running", node_name=node)


def test_read_run_starts_from_the_watched_status_less_kopfs_bookkeeping() -> None:
    snap = read_run(RunMemory(), _body(attempt=2, phase="Running"), 50.0, None)
    assert (snap.namespace, snap.name, snap.uid, snap.generation, snap.now) == ("ml", "r", UID, 4, 50.0)
    assert snap.status.attempt == 2 and snap.attempt == 2 and not snap.status_written
    assert snap.status_raw == {"attempt": 2, "phase": "Running"}
    assert not snap.invalid and snap.errors == () and snap.desired["resources"]["nodes"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.now = 1.0  # type: ignore[misc]


def test_read_run_prefers_our_own_write_then_the_reread_status_to_the_watch() -> None:
    memory = RunMemory()
    memory.reread = {"attempt": 5}
    assert read_run(memory, _body(attempt=2), 0.0, None).attempt == 5
    written = read_run(memory, _body(), 0.0, None).status.model_copy(update={"attempt": 7})
    memory.written, memory.reread = written, None
    snap = read_run(memory, _body(attempt=2), 0.0, None)
    assert snap.attempt == 7 and snap.status_written and snap.status_raw == written.dump()


def test_the_parse_is_cached_while_the_spec_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = validation.parse
    monkeypatch.setattr(validation, "parse", lambda obj: calls.append(obj) or real(obj))
    memory = RunMemory()
    first = parse(memory, _body())
    again = parse(memory, _body(attempt=9))  # a status change: no new parse, an equal result
    assert len(calls) == 1 and again == first and again[0] is not first[0]
    b = _body()
    b["spec"]["training"]["steps"] = 7
    assert parse(memory, b)[0].spec.training.steps == 7 and len(calls) == 2
    assert parse(memory, b)[0].spec.training.steps == 7 and len(calls) == 2


def test_the_memory_keeps_the_parse_and_the_written_status_as_json_and_gives_back_equal_models() -> None:
    memory = RunMemory()
    lpt, _, _ = parse(memory, _body())
    status = read_run(memory, _body(attempt=3, phase="Running"), 0.0, None).status
    memory.written = status
    assert memory.memo.parsed is not None and isinstance(memory.memo.parsed[0].data, bytes)
    assert isinstance(memory.packed_written.data, bytes)
    assert memory.written == status and memory.written is not memory.written
    assert memory.written.dump() == status.dump() and memory.memo.parsed[0].get() == lpt


def test_a_model_whose_json_does_not_give_it_back_is_kept_as_it_is() -> None:
    status = LlamaPretrainStatus.model_construct(attempt=1.0)  # a float in an int field: its JSON does not validate
    with pytest.warns(UserWarning, match="serialized value may not be as expected"):
        packed = Packed.of(status)
    assert packed.data is status and packed.get() is status
    assert isinstance(Packed.of(LlamaPretrainStatus(attempt=1)).data, bytes)


def test_writing_an_unchanged_status_keeps_its_packed_json_and_a_change_replaces_it() -> None:
    memory = RunMemory()
    memory.written = LlamaPretrainStatus(attempt=1)
    first = memory.packed_written
    memory.written = LlamaPretrainStatus(attempt=1)  # a cycle that changed nothing: nothing packed again
    assert memory.packed_written is first
    memory.written = LlamaPretrainStatus(attempt=2)
    assert memory.packed_written is not first and memory.written.attempt == 2


@pytest.mark.parametrize(("spec_change", "attempt", "want_invalid", "want_live"), [
    ({}, None, False, False),
    ({"resources": {"nodes": 0}}, None, True, False),
    ({"resources": {"nodes": 0}}, 1, True, False),
], ids=["valid", "invalid-never-started", "unparsable-started"])
def test_invalid_and_refused_live(spec_change: dict, attempt: int | None, want_invalid: bool,
                                  want_live: bool) -> None:
    b = _body(**({"attempt": attempt} if attempt is not None else {}))
    b["spec"]["resources"].update(spec_change.get("resources", {}))
    snap = read_run(RunMemory(), b, 0.0, None)
    assert (snap.invalid, snap.refused_live) == (want_invalid, want_live)


def test_a_started_run_refused_by_the_policy_keeps_being_observed_and_blocks_the_next_attempt() -> None:
    b = _body(attempt=1)
    snap = read_run(RunMemory(), b, 0.0, policy.Policy(image_prefixes=("registry.example/only/",)))
    assert snap.errors and all(isinstance(e, policy.Violation) for e in snap.errors)
    assert snap.refused_live and not snap.invalid
    block, reason, _ = snap.spec_block()
    assert reason == C.POLICY_VIOLATION and block.startswith("refused by the admin policy")


def test_the_indexes_give_the_runs_pods_the_nodes_they_run_on_and_the_children_shown() -> None:
    index = {UID: [_pod(0), None, _pod(1, node="gone")], "other": [_pod(0)]}
    pods = pods_of(index, UID)
    assert [p.name for p in pods] == ["r-a0-0", "r-a0-1"] and pods_of(None, UID) == ()
    nodes = nodes_of({"n1": [NodeObs(name="n1", ready=True)]}, pods)
    assert isinstance(nodes, MappingProxyType) and list(nodes) == ["gone", "n1"]
    assert nodes["n1"].ready and not nodes["gone"].exists  # absent from the index: absent from the API
    shown = children_of(({UID: ["r-config"]}, {UID: []}), UID, "r")
    assert shown == frozenset({"r-config"}) and children_of(None, UID, "r") is None


def _observed_snapshot(**kw: object) -> Snapshot:
    memory = RunMemory()
    snap = read_run(memory, _body(attempt=1, startTime="2026-01-01T00:00:00Z"), 1000.0, None)
    applied = dict(snap.desired, training={**snap.desired["training"], "steps": 50})
    return dataclasses.replace(snap, pods=(_pod(0, 1), _pod(1, 1), _pod(0, 0)),
                               nodes=MappingProxyType({"n1": NodeObs(name="n1", ready=True)}),
                               applied_spec=applied, **kw)


def test_the_snapshot_gives_the_current_attempt_and_the_spec_it_was_created_from() -> None:
    snap = _observed_snapshot()
    assert [p.name for p in snap.current] == ["r-a1-0", "r-a1-1"] and snap.rank0.name == "r-a1-0"
    assert snap.attempt_spec("training", "steps") == 50 and snap.attempt_spec("resources", "nodes") == 2
    assert dataclasses.replace(snap, pods=()).attempt_spec("training", "steps") is None  # no live attempt


def test_decision_inputs_fold_the_read_into_the_observation() -> None:
    refusal = ChildError("Pod", "r-a1-1", "Forbidden", "quota")
    snap = _observed_snapshot(gate=(None, None, "data changed; applied when the next attempt starts"),
                              child_errors=(refusal,), missing=("r",),
                              scrape=Scrape(error="GET x failed", reason=C.SCRAPE_FAILED))
    obs = decision_inputs(snap, 120.0)
    assert obs.pods == snap.pods and obs.now == 1000.0 and obs.generation == 4
    assert obs.child_errors == (refusal,) and obs.missing_children == ("r",)
    assert obs.spec_deferred.startswith("data changed") and obs.spec_block is None
    assert obs.attempt_steps == 50 and obs.attempt_nodes == 2 and obs.hang_floor_seconds == 120.0
    assert obs.ranks_seen == frozenset({0, 1}) and obs.training is None
    assert obs.observation.metrics_error == "GET x failed"


def test_a_node_the_index_lacks_is_read_from_the_api_before_it_counts_as_missing() -> None:
    """The pod watch can deliver a pod bound to a node before the node watch delivers the node: such a node is read
    from the API server; only one that the API server does not have either is missing (no restart for a node that
    exists, even with nodeFailureGraceSeconds 0)."""
    from kubetitan.observation.pods import node_obs
    from kubetitan.observation.read import confirm_missing

    api = {"node-0": {"metadata": {"name": "node-0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}}
    asked: list[tuple] = []

    async def get(resource, ns, name):
        asked.append((resource, ns, name))
        return api.get(name)

    indexed = node_obs("node-2", api["node-0"])
    nodes = MappingProxyType({"node-0": node_obs("node-0", None), "node-1": node_obs("node-1", None),
                              "node-2": indexed})
    got = asyncio.run(confirm_missing(nodes, get))
    assert got["node-0"].exists and got["node-0"].ready is True
    assert not got["node-1"].exists
    assert got["node-2"] is indexed
    assert asked == [("nodes", None, "node-0"), ("nodes", None, "node-1")]  # the index's nodes are not read again
    all_there = MappingProxyType({"node-2": indexed})
    assert asyncio.run(confirm_missing(all_there, get)) is all_there and len(asked) == 2
