"""Status tells one story (issue 30, item 5), as tables over the pure status builder and its consistency rules.

- ``conditions.contradictions`` itself: each rule of the story, broken on purpose, is reported;
- scenarios through ``decide`` + ``status.next_status`` that once told two stories: a restart blocked by a spec
  change (it was ``Restarting`` with ``ChildrenCreated=True "all 2 pods of attempt 0 exist"``), a run that
  succeeded with its metrics never answering (``PROGRESS 0/100``), ``Ready=True`` next to
  ``MetricsAvailable=False``, ``Starting`` while pods are missing, waiting messages with running counters
  (a status rewritten every scan);
- the world-size predicate, the data's capability and the spec gate (``plan.world_size_edit``,
  ``contract.resumes_at_another_dp_degree``, ``status.spec_gate``): deferred on shards/synthetic, refused on hub data;
- the Events a status change carries (``status.pendingEvents``), each once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan import plan
from kubetitan import status as S
from kubetitan_core import contract
from kubetitan_core.api import Condition, LlamaPretrainSpec, LlamaPretrainStatus, RestartRecord
from kubetitan.decide import Action, decide
from kubetitan.observation import NodeObs, Observed, PodObs, Progress
from kubetitan.observation import tracking as T
from kubetitan.timestamps import iso
from kubetitan.observation.spec import spec_changes
from support.runs import condition

NOW = 2_000_000.0
NODES = {"n0": NodeObs("n0"), "n1": NodeObs("n1")}


def _spec(nodes: int = 2, **over: Any) -> LlamaPretrainSpec:
    raw: dict[str, Any] = {"resources": {"nodes": nodes, "gpusPerNode": 8}, "training": {"steps": 100}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v}
    return LlamaPretrainSpec.model_validate(raw)


def _pods(attempt: int = 0, n: int = 2, **kw: Any) -> tuple[PodObs, ...]:
    return tuple(PodObs(name=f"j-a{attempt}-{r}", attempt=attempt, rank=r, phase=kw.get("phase", "Running"),
                        node_name=f"n{r}", created=NOW - 50, running_since=NOW - 40,
                        **{k: v for k, v in kw.items() if k != "phase"}) for r in range(n))


def _status(attempt: int = 0, **kw: Any) -> LlamaPretrainStatus:
    return LlamaPretrainStatus(attempt=attempt, start_time=iso(NOW - 100), **kw)


def _step(spec: LlamaPretrainSpec, st: LlamaPretrainStatus, obs: Observed) -> LlamaPretrainStatus:
    new = S.next_status(spec, st, decide(spec, st, obs), obs)
    assert C.contradictions(new.phase, new.conditions, new.attempt) == [], [c.dump() for c in new.conditions]
    return new


TRAINING = Progress(step=20, start_step=0, last_checkpoint_step=10, last_progress_time=NOW - 1,
                    first_step_time=NOW - 30, metrics_available=True, metrics_ok_time=NOW)


# ------------------------------------------------------------------ the rules themselves
def _c(type_: str, status: str, reason: str = "R", message: str = "m") -> Condition:
    return Condition(type=type_, status=status, reason=reason, message=message)


@pytest.mark.parametrize(("phase", "conds", "attempt", "broken"), [
    ("Running", [_c(C.READY, "True"), _c(C.CHILDREN_CREATED, "True", message="all 2 pods of attempt 0 exist"),
                 _c(C.METRICS_AVAILABLE, "True")], 0, None),
    ("Starting", [_c(C.READY, "True"), _c(C.CHILDREN_CREATED, "True", message="attempt 0")], 0,
     "phase Starting but the conditions give Running"),
    ("Running", [_c(C.READY, "True"), _c(C.CHILDREN_CREATED, "True", message="attempt 0"),
                 _c(C.METRICS_AVAILABLE, "False")], 0, "Ready=True next to MetricsAvailable=False"),
    ("Restarting", [_c(C.RESTARTING, "True"), _c(C.CHILDREN_CREATED, "True", message="all 2 pods of attempt 0 exist")],
     1, "ChildrenCreated speaks of another attempt than 1"),
    ("Succeeded", [_c(C.SUCCEEDED, "True"), _c(C.FAILED, "True")], None, "Succeeded and Failed are both True"),
    ("Failed", [_c(C.FAILED, "True"), _c(C.RESTARTING, "True")], None, "a finished run has Restarting=True"),
    ("Pending", [_c(C.UNSCHEDULABLE, "False", message="2/2 pods cannot be scheduled for 136s")], None,
     "running counter"),
    ("Pending", [_c(C.READY, "False", message="attempt 1 starts in 7s (restart backoff)")], None, "running counter"),
    ("Restarting", [_c(C.RESTARTING, "True", message="no step progress for 40s (recorded once)")], None, None),
    ("Blocked", [_c(C.RESTARTING, "True", C.RESTART_BLOCKED)], None, None),
    ("Running", [_c(C.READY, "Unknown", C.PROGRESS_UNKNOWN)], None, None),
], ids=["consistent", "phase-not-derived", "ready-without-metrics", "children-of-an-older-attempt",
        "succeeded-and-failed", "finished-yet-restarting", "counter-for", "counter-in", "a-recorded-failure-may-quote-seconds",
        "blocked", "running-with-progress-unknown"])
def test_contradictions_name_each_broken_rule(phase, conds, attempt, broken) -> None:
    got = C.contradictions(phase, conds, attempt)
    if broken is None:
        assert got == []
    else:
        assert any(broken in g for g in got), got


# ------------------------------------------------------------------ scenarios that once told two stories
def test_a_restart_blocked_by_a_spec_change_is_blocked_not_restarting() -> None:
    """Attempt 0 fails while the spec holds an immutable-field change: the restart record is written (its Event says
    the next attempt cannot start, and why), then the status says Blocked: Restarting=True/RestartBlocked,
    ChildrenCreated=False about attempt 1 (not attempt 0's pods), one RestartBlocked Event, no "starting attempt 1"."""
    spec, block = _spec(), "changing model.flavor would make the run's checkpoints unusable; revert it"
    failed = replace(_pods()[1], phase="Failed", exit_code=1)
    obs = Observed(pods=(_pods()[0], failed), nodes=NODES, progress=TRAINING, now=NOW, spec_block=block,
                   spec_block_reason=C.IMMUTABLE_FIELD_CHANGED, ranks_seen=frozenset({0, 1}))
    st = _step(spec, _status(), obs)
    assert st.phase == "Restarting" and st.attempt == 1
    assert [(e.reason, "attempt 1 cannot start: changing model.flavor" in e.message) for e in st.pending_events] \
        == [("RestartContainerFailed", True), (C.IMMUTABLE_FIELD_CHANGED, False)]
    assert not any("starting attempt 1" in e.message for e in st.pending_events)
    st = st.model_copy(update={"pending_events": []})  # (the operator sent them)
    later = Observed(pods=(), nodes=NODES, now=NOW + 5, spec_block=block, spec_block_reason=C.IMMUTABLE_FIELD_CHANGED)
    st2 = _step(spec, st, later)
    assert st2.phase == "Blocked"
    assert condition(st2, C.RESTARTING) == ("True", C.RESTART_BLOCKED) and condition(st2, C.READY)[1] == C.RESTART_BLOCKED
    assert condition(st2, C.CHILDREN_CREATED) == ("False", C.RESTART_BLOCKED)
    assert C.find(st2.conditions, C.CHILDREN_CREATED).message == "0/2 pods of attempt 1 exist"
    assert condition(st2, C.SPEC_ACCEPTED) == ("False", C.IMMUTABLE_FIELD_CHANGED)
    assert [e.reason for e in st2.pending_events] == [C.RESTART_BLOCKED]
    assert block in st2.pending_events[0].message
    # the next scans: nothing new to say, so nothing to write and no Event again
    st3 = _step(spec, st2.model_copy(update={"pending_events": []}), replace(later, now=NOW + 60))
    assert st3.dump() == st2.model_copy(update={"pending_events": []}).dump()


def test_a_run_that_succeeded_with_metrics_never_answering_shows_the_step_it_reached() -> None:
    spec = _spec()
    done = (replace(_pods()[0], phase="Succeeded", exit_code=0), _pods()[1])
    obs = Observed(pods=done, nodes=NODES, now=NOW, ranks_seen=frozenset({0, 1}),
                   progress=Progress(metrics_available=False, metrics_error="GET http://x/metrics refused"))
    st = _step(spec, _status(), obs)
    assert st.phase == "Succeeded" and (st.training.step, st.training.progress) == (100, "100/100")


def test_a_run_whose_last_scrape_came_before_its_last_steps_shows_the_step_it_reached_once_succeeded() -> None:
    """The workers finished their count between two scrapes (the e2e fault run under CPU hogs saw 38 of 40)."""
    from kubetitan_core.api import TrainingStatus

    spec = _spec()
    done = (replace(_pods()[0], phase="Succeeded", exit_code=0), _pods()[1])
    obs = Observed(pods=done, nodes=NODES, now=NOW, ranks_seen=frozenset({0, 1}), progress=TRAINING,
                   training=TrainingStatus(step=98, total_steps=100))
    st = _step(spec, _status(), obs)
    assert st.phase == "Succeeded" and (st.training.step, st.training.progress) == (100, "100/100")


def test_ready_follows_the_metrics_it_rests_on() -> None:
    """Ready=True/Training only while rank 0 answers; the scrape failing flips it to Unknown/ProgressUnknown in the
    same status write that sets MetricsAvailable=False (phase Running: the pods run); answering again: True."""
    spec, st = _spec(), _status()
    ok = Observed(pods=_pods(), nodes=NODES, progress=TRAINING, now=NOW, ranks_seen=frozenset({0, 1}))
    st = _step(spec, st, ok)
    assert (st.phase, condition(st, C.READY), condition(st, C.METRICS_AVAILABLE)[0]) == ("Running", ("True", C.TRAINING), "True")
    down = replace(ok, now=NOW + 15, progress=replace(TRAINING, metrics_available=False, metrics_error="timed out"))
    st = _step(spec, st, down)
    assert (st.phase, condition(st, C.READY), condition(st, C.METRICS_AVAILABLE)[0]) == \
        ("Running", ("Unknown", C.PROGRESS_UNKNOWN), "False")
    st = _step(spec, st, replace(ok, now=NOW + 30))
    assert condition(st, C.READY) == ("True", C.TRAINING)


@pytest.mark.parametrize(("pods", "phase", "children"), [
    ((), "Pending", ("False", C.CREATING)),
    (_pods()[:1], "Pending", ("False", C.CREATING)),
    (_pods(phase="Pending"), "Starting", ("True", C.CHILDREN_OK)),
], ids=["no-pod", "one-of-two", "all-pods-exist"])
def test_starting_only_once_every_pod_of_the_attempt_exists(pods, phase, children) -> None:
    spec = _spec()
    st = _step(spec, _status(), Observed(pods=pods, nodes=NODES, now=NOW, ranks_seen=frozenset(p.rank for p in pods)))
    assert (st.phase, condition(st, C.CHILDREN_CREATED)) == (phase, children)


UNANSWERED = Progress(metrics_available=False, metrics_error="GET http://10.0.0.1:9090/metrics failed: refused")
ELASTIC = {"elastic": {"minNodes": 1, "shrinkAfterSeconds": 300}}


def _elastic_lost_node() -> Observed:
    """Attempt 0 of an elastic 2-node run trains; node n1 is gone and nothing else fits rank 1 (capacity 1)."""
    from kubetitan.observation import Capacity

    return Observed(pods=_pods(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=False,
                                                                           not_ready_since=NOW - 20)},
                    progress=TRAINING, now=NOW, ranks_seen=frozenset({0, 1}),
                    capacity=Capacity(schedulable=1, stable=1))


@pytest.mark.parametrize(("policy", "obs", "phase", "ready"), [
    # the whole gang exists but cannot be placed: waiting for nodes, not starting
    ({"unschedulableTimeoutSeconds": 600},
     Observed(pods=tuple(replace(p, phase="Pending", node_name=None, unschedulable_message="0/4 nodes are available")
                         for p in _pods()), now=NOW), "Pending", ("False", C.WAITING_FOR_NODES)),
    ({"unschedulableTimeoutSeconds": 10},
     Observed(pods=tuple(replace(p, phase="Pending", node_name=None, unschedulable_message="0/4 nodes are available")
                         for p in _pods()), now=NOW), "Pending", ("False", C.PODS_UNSCHEDULABLE)),
    # an elastic run whose node is lost waits shrinkAfterSeconds for a replacement: Pending, not Starting
    (ELASTIC, _elastic_lost_node(), "Pending", ("False", C.WAITING_FOR_REPLACEMENT)),
    # every pod runs, /metrics never answered: within startupTimeoutSeconds the workers may still be starting ...
    ({"startupTimeoutSeconds": 600}, Observed(pods=_pods(), nodes=NODES, progress=UNANSWERED, now=NOW,
                                              ranks_seen=frozenset({0, 1})), "Starting", ("False", C.METRICS_UNAVAILABLE)),
    # ... past it, whether they train is unknown: Running (the pods run), never Starting for life
    ({"startupTimeoutSeconds": 30}, Observed(pods=_pods(), nodes=NODES, progress=UNANSWERED, now=NOW,
                                             ranks_seen=frozenset({0, 1})), "Running", ("Unknown", C.PROGRESS_UNKNOWN)),
], ids=["unschedulable-within-its-timeout", "unschedulable-past-its-timeout", "elastic-waiting-for-a-node",
        "metrics-never-answered-while-starting", "metrics-never-answered-past-the-startup-timeout"])
def test_a_run_waiting_for_nodes_or_for_its_metrics_does_not_show_starting(policy, obs, phase, ready) -> None:
    spec = _spec(runPolicy=policy)
    st = _step(spec, _status(), obs)
    assert (st.phase, condition(st, C.READY)) == (phase, ready), C.find(st.conditions, C.READY)
    if ready[1] in (C.METRICS_UNAVAILABLE, C.PROGRESS_UNKNOWN):
        assert "refused" in (st.message or "")  # the scrape's own error, so the user can fix it


@pytest.mark.parametrize("obs", [
    Observed(pods=tuple(replace(p, phase="Pending", node_name=None, unschedulable_message="0/4 nodes are available")
                        for p in _pods()), now=NOW),
    Observed(pods=_pods()[:1] + (replace(_pods()[1], phase="Pending", waiting_reason="ContainerCreating",
                                         scheduled_since=NOW - 40),), nodes=NODES, now=NOW,
             ranks_seen=frozenset({0, 1})),
    Observed(pods=_pods(), nodes={"n0": NodeObs("n0"), "n1": NodeObs("n1", ready=None, not_ready_since=NOW - 10)},
             progress=TRAINING, now=NOW, ranks_seen=frozenset({0, 1})),
], ids=["unschedulable", "container-creating", "node-grace"])
def test_waiting_is_written_once_not_every_scan(obs) -> None:
    """A run that waits (unschedulable, a pod not running yet, a node in its grace) writes its status once: the
    next scans' statuses are equal (times in the conditions' lastTransitionTime, no "for 136s")."""
    spec = _spec(runPolicy={"unschedulableTimeoutSeconds": 10, "startupTimeoutSeconds": 600,
                            "nodeFailureGraceSeconds": 600})
    first = _step(spec, _status(), obs)
    again = _step(spec, first, replace(obs, now=obs.now + 7))
    assert again.dump() == first.dump()


def test_backoff_is_an_instant_not_a_countdown() -> None:
    spec = _spec(runPolicy={"backoffSeconds": 60})
    st = _status(1, restarts=[RestartRecord(attempt=0, cause="ContainerFailed", time=iso(NOW - 10), lost_steps=0)],
                 restart_count=1)
    a = _step(spec, st, Observed(now=NOW))
    b = _step(spec, a, Observed(now=NOW + 20))
    assert a.dump() == b.dump() and iso(NOW + 50) in (a.message or "")


# ------------------------------------------------------------------ world-size changes
@pytest.mark.parametrize(("before", "after", "want"), [
    ({}, {}, None),
    ({}, {"resources": {"nodes": 3, "gpusPerNode": 8}}, "resources.nodes 2 -> 3"),
    ({}, {"resources": {"nodes": 2, "gpusPerNode": 4}}, "resources.gpusPerNode 8 -> 4"),
    ({}, {"parallelism": {"tensorParallelDegree": 2}}, "data-parallel degree 16 -> 8"),
    ({"parallelism": {"dataParallelShardDegree": 16}}, {"parallelism": {"dataParallelShardDegree": -1}}, None),
    ({}, {"training": {"steps": 50}}, None),
], ids=["same", "nodes", "gpus-per-node", "tensor-parallel-keeps-world-changes-dp", "same-degree-spelled-otherwise",
        "not-a-world-size-field"])
def test_world_size_change(before, after, want) -> None:
    edit = plan.world_size_edit(_spec(**before), _spec(**after))
    got = edit.change if edit is not None else None
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got, got


SHARDS = {"source": "shards", "shards": {"path": "/data/c4"}}
MIXTURE = {"source": "mixture", "mixture": [{"shards": {"path": "/data/a"}, "weight": 3},
                                            {"shards": {"path": "/data/b"}, "weight": 1}]}
HUB = {"source": "huggingface", "huggingface": {"dataset": "allenai/c4"}}
HUB_MIXTURE = {"source": "mixture", "mixture": [{"shards": {"path": "/data/a"}, "weight": 3},
                                                {"huggingface": {"dataset": "allenai/c4"}, "weight": 1}]}
SYNTHETIC = {"source": "synthetic"}
NODES_3 = {"resources": {"nodes": 3}}
TP_2 = {"parallelism": {"tensorParallelDegree": 2}}  # the same world, half the data-parallel degree


@pytest.mark.parametrize(("source", "resumes"), [("synthetic", True), ("shards", True), ("mixture", True),
                                                 ("hub-mixture", False), ("huggingface", False)])
def test_which_data_resumes_at_another_data_parallel_degree(source, resumes) -> None:
    """The capability, one row per ``data.source`` (a new source must get its row: the list is the Literal's), and a
    mixture with a hub entry (that entry keeps a per-rank position)."""
    data = {"synthetic": SYNTHETIC, "shards": SHARDS, "mixture": MIXTURE, "hub-mixture": HUB_MIXTURE,
            "huggingface": HUB}[source]
    assert contract.resumes_at_another_dp_degree(_spec(data=data).data) is resumes
    assert set(LlamaPretrainSpec.model_fields["data"].annotation.model_fields["source"].annotation.__args__) == {
        "synthetic", "shards", "mixture", "huggingface"}


# applied (data, other edits), desired (data, other edits) -> the gate's reason (None: deferred) and a phrase
GATE_ROWS = [
    ("synthetic-nodes", SYNTHETIC, {}, SYNTHETIC, NODES_3, None, "changes the world size 16 -> 24"),
    ("shards-nodes", SHARDS, {}, SHARDS, NODES_3, None, "resources.nodes 2 -> 3"),
    ("mixture-nodes", MIXTURE, {}, MIXTURE, NODES_3, None, "data-parallel degree 16 -> 24"),
    ("shards-tensor-parallel", SHARDS, {}, SHARDS, TP_2, None, "data-parallel degree 16 -> 8"),
    ("hub-nodes", HUB, {}, HUB, NODES_3, C.WORLD_SIZE_CHANGE_REFUSED, "resources.nodes 2 -> 3"),
    ("hub-tensor-parallel", HUB, {}, HUB, TP_2, C.WORLD_SIZE_CHANGE_REFUSED, "data-parallel degree 16 -> 8"),
    ("hub-mixture-nodes", HUB_MIXTURE, {}, HUB_MIXTURE, NODES_3, C.WORLD_SIZE_CHANGE_REFUSED,
     "hub-streamed data (data.mixture[1].huggingface)"),
    # 4 nodes at tensor-parallel 2 keep the data-parallel degree 16: the per-rank positions still fit
    ("hub-more-nodes-same-degree", HUB, {}, HUB, {"resources": {"nodes": 4}, **TP_2}, None,
     "the data-parallel degree 16 -> 16"),
    # the checkpoint was written with the old data and is read with the new: both must resume at another degree
    ("hub-to-shards-and-nodes", HUB, {}, SHARDS, NODES_3, C.WORLD_SIZE_CHANGE_REFUSED, "resources.nodes 2 -> 3"),
    ("shards-to-hub-and-nodes", SHARDS, {}, HUB, NODES_3, C.WORLD_SIZE_CHANGE_REFUSED, "resources.nodes 2 -> 3"),
    ("hub-image-only", HUB, {}, HUB, {"resources": {"image": "example.com/trainer:2"}}, None,
     "resources.image changed"),
]


@pytest.mark.parametrize("row", GATE_ROWS, ids=[r[0] for r in GATE_ROWS])
def test_a_world_size_edit_is_deferred_unless_the_data_cannot_resume_at_another_degree(row) -> None:
    _id, data_then, then, data_now, now, reason, phrase = row
    applied = _spec(data=data_then, **then).model_dump(by_alias=True, exclude_none=True, mode="json")
    desired = _spec(data=data_now, **now)
    wire = desired.model_dump(by_alias=True, exclude_none=True, mode="json")
    block, got_reason, deferred = S.spec_gate(applied, desired, spec_changes(applied, wire))
    edit = plan.world_size_edit(LlamaPretrainSpec.model_validate(applied), desired)
    assert got_reason == reason
    if reason is None:
        assert block is None and phrase in deferred and "applied when the next attempt starts" in deferred, deferred
        assert edit is None or edit.allowed
    else:
        assert deferred is None and edit is not None and not edit.allowed and block == edit.refusal
        assert phrase in block and "hub-streamed data" in block, block
        assert "cannot resume at another data-parallel degree" in block, block
        assert "Revert the edit" in block and "kubetitan prepare-data" in block and "new LlamaPretrain" in block
        assert edit.path == "spec.resources.nodes" or "tensorParallelDegree" in edit.path, edit


def test_an_elastic_runs_node_edit_says_the_operator_keeps_sizing_it() -> None:
    """runPolicy.elastic: the next attempt's size is the running one's within the new bounds, not resources.nodes
    (decide.lifecycle.attempt_size), and the deferral says so instead of "at the new size"."""
    elastic = {"runPolicy": {"elastic": {"minNodes": 1}}}
    applied = _spec(data=SYNTHETIC, **elastic).model_dump(by_alias=True, exclude_none=True, mode="json")
    desired = _spec(3, data=SYNTHETIC, **elastic)
    wire = desired.model_dump(by_alias=True, exclude_none=True, mode="json")
    block, reason, deferred = S.spec_gate(applied, desired, spec_changes(applied, wire))
    assert block is None and reason is None
    assert "resources.nodes 2 -> 3" in deferred and "runPolicy.elastic sizes this run" in deferred, deferred
    assert "within minNodes..maxNodes (1..3 now)" in deferred and "at the new size" not in deferred, deferred


def test_an_attempt_of_an_older_operator_is_gated_by_its_data_as_written() -> None:
    """An applied spec the current model refuses (an older operator's): the changed field names the change, its data
    alone decides; data that cannot be read at all may be hub-streamed, so the edit is refused."""
    desired = _spec(3)
    wire = desired.model_dump(by_alias=True, exclude_none=True, mode="json")
    for data, reason in ((SYNTHETIC, None), (HUB, C.WORLD_SIZE_CHANGE_REFUSED),
                         ({"source": "parquet"}, C.WORLD_SIZE_CHANGE_REFUSED)):
        applied = {**_spec().model_dump(by_alias=True, exclude_none=True, mode="json"), "data": data,
                   "removedField": 1}
        block, got, deferred = S.spec_gate(applied, desired, spec_changes(applied, wire))
        assert got == reason, (data, block, deferred)
        assert "resources.nodes changed" in (block or deferred)


def test_a_live_gang_is_never_grown_by_the_spec() -> None:
    """The spec says 3 nodes, the running attempt was created with 2 and both its pods exist: nothing to create
    (it was: a pod a0-2 with --nnodes=3 joined the 2-node gang)."""
    d = decide(_spec(3), _status(), Observed(pods=_pods(), nodes=NODES, progress=TRAINING, now=NOW,
                                             ranks_seen=frozenset({0, 1}), attempt_nodes=2))
    assert d.action == Action.KEEP and d.ready, d
    # a rank of the attempt never seen (its create was refused) is created: the attempt's own rank, not the spec's
    d = decide(_spec(3), _status(), Observed(pods=_pods()[:1], nodes=NODES, now=NOW, ranks_seen=frozenset({0}),
                                             attempt_nodes=2))
    assert d.action == Action.CREATE and "rank 1 of attempt 0" in d.message, d


# ------------------------------------------------------------------ the Events a status change carries
def test_status_events_are_carried_once_per_change() -> None:
    """A refused edit's Warning comes with SpecAccepted turning False, once; the next scans carry none."""
    spec = _spec()
    obs = Observed(pods=_pods(), nodes=NODES, progress=TRAINING, now=NOW, ranks_seen=frozenset({0, 1}),
                   spec_block="resources.nodes 2 -> 3 ...: the edit is refused", spec_block_reason=C.WORLD_SIZE_CHANGE_REFUSED)
    st = _step(spec, _status(), obs)
    assert [(e.type, e.reason) for e in st.pending_events] == [("Warning", C.WORLD_SIZE_CHANGE_REFUSED)]
    assert st.phase == "Running" and condition(st, C.READY) == ("True", C.TRAINING)  # the live attempt goes on
    again = _step(spec, st.model_copy(update={"pending_events": []}), replace(obs, now=NOW + 10))
    assert again.pending_events == []
