"""The restart decision as a whole (``kubetitan.decide``: its rules in order, each in one policy module), the status
it leads to (``kubetitan.status``), and the conditions helpers. The table cases of each policy are in
tests/operator/test_decide_<policy>.py (failure, elastic, liveness, lifecycle)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan_core import contract
from kubetitan_core.api import Condition, LlamaPretrainSpec
from kubetitan.decide import RULES, decide
from kubetitan.decide import elastic, failure, lifecycle, liveness
from kubetitan.observation import NodeObs, Observed, PodObs, Progress
from kubetitan.observation import tracking as T
from kubetitan.status import next_status
from kubetitan import status as S
from support.runs import condition
from support.decide_cases import NOW, TRAINING, gang, ok_nodes, pod, spec, status


def test_restart_status_records_history_and_conditions() -> None:
    s = spec()
    st = status()
    obs = Observed(pods=gang(over={1: {"phase": "Failed", "exit_code": 1}}), nodes=ok_nodes, progress=TRAINING,
                   now=NOW, generation=3)
    new = next_status(s, st, decide(s, st, obs), obs)
    assert (new.attempt, new.restart_count, new.phase) == (1, 1, "Restarting")
    r = new.restarts[0]
    assert (r.attempt, r.cause, r.resumed_from_step, r.lost_steps) == (0, "ContainerFailed", 10, 10)
    assert C.is_true(new.conditions, C.RESTARTING) and not C.is_true(new.conditions, C.READY)
    assert all(c.observed_generation == 3 for c in new.conditions)
    # next attempt trains: Restarting flips off, downtime is filled from the first step
    obs2 = Observed(pods=gang(1), nodes=ok_nodes, now=NOW + 20, generation=3,
                    progress=Progress(step=11, start_step=10, last_progress_time=NOW + 19, first_step_time=NOW + 15))
    newer = next_status(s, new, decide(s, new, obs2), obs2)
    assert newer.phase == "Running" and not C.is_true(newer.conditions, C.RESTARTING)
    assert newer.restarts[0].downtime_seconds == 15.0
    assert (newer.restarts[0].resumed_from_step, newer.restarts[0].lost_steps) == (10, 10)  # as guessed


@pytest.mark.parametrize(("old_status", "new_status", "reason", "changed", "keeps_time"), [
    (None, "True", "A", True, False),
    ("True", "True", "A", False, True),
    ("True", "True", "B", True, True),
    ("True", "False", "A", True, False),
], ids=["new", "same", "reason-only", "flip"])
def test_set_condition_keeps_transition_time_unless_status_flips(old_status, new_status, reason, changed,
                                                                  keeps_time) -> None:
    conds = [] if old_status is None else [Condition(type="Ready", status=old_status, reason="A", message="m",
                                                     last_transition_time="T0", observed_generation=1)]
    assert C.set_condition(conds, "Ready", new_status, reason, "m", "T1", 1) is changed
    assert conds[0].last_transition_time == ("T0" if keeps_time else "T1")


@pytest.mark.parametrize(("conds", "phase"), [
    ((), "Pending"),
    (((C.CHILDREN_CREATED, "False", C.CREATING),), "Pending"),
    (((C.CHILDREN_CREATED, "True", C.CHILDREN_OK),), "Starting"),
    (((C.READY, "True", C.TRAINING), (C.CHILDREN_CREATED, "True", C.CHILDREN_OK)), "Running"),
    (((C.READY, "Unknown", C.PROGRESS_UNKNOWN), (C.CHILDREN_CREATED, "True", C.CHILDREN_OK)), "Running"),
    (((C.RESTARTING, "True", C.RESTARTED),), "Restarting"),
    (((C.RESTARTING, "True", C.RESTART_BLOCKED),), "Blocked"),
    (((C.SUSPENDED, "True", C.SUSPENDED_BY_USER), (C.RESTARTING, "True", C.RESTART_BLOCKED)), "Suspended"),
    (((C.SUCCEEDED, "True", C.COMPLETED), (C.READY, "True", C.TRAINING)), "Succeeded"),
    (((C.FAILED, "True", C.CONFIG_ERROR),), "Failed"),
], ids=["nothing", "pods-missing", "starting", "running", "running-progress-unknown", "restarting", "blocked",
        "suspended-wins", "succeeded", "failed"])
def test_derive_phase(conds, phase) -> None:
    assert C.derive_phase([Condition(type=t, status=st, reason=r) for t, st, r in conds]) == phase


@pytest.mark.parametrize(("scrape", "want"), [
    ({}, ("Unknown", C.NOT_SCRAPED)),
    ({"metrics": {contract.M_STEP: 3.0}}, ("True", C.SCRAPED)),
    ({"scrape_error": "GET http://10.0.0.1:9090/metrics timed out after 3s"}, ("False", C.SCRAPE_FAILED)),
], ids=["not-scraped", "answered", "unreachable"])
def test_metrics_available_condition(scrape, want) -> None:
    s, st = spec(), status()
    o = T.track(None, 0, NOW, pods=gang(), **scrape)
    obs = T.observed(o, pods=gang(), nodes=ok_nodes, now=NOW)
    new = S.next_status(s, st, decide(s, st, obs), obs)
    assert condition(new, C.METRICS_AVAILABLE) == want
    assert new.restart_count == 0 and new.observation == o


def test_a_large_gang_is_decided_in_time_linear_in_its_pods() -> None:
    """The decision reads each pod's rank a bounded number of times: a 512-pod gang training, every rank seen (the
    check for a rank that disappeared built the set of the gang's ranks once per rank seen: 262,144 reads a
    cycle, every cycle of a 1,024-pod gang's creation)."""
    reads = [0]

    class Counted(PodObs):
        def __getattribute__(self, name: str) -> Any:
            if name == "rank":
                reads[0] += 1
            return object.__getattribute__(self, name)

    n = 512
    gang = tuple(Counted(**asdict(pod(r))) for r in range(n))
    sp = LlamaPretrainSpec.model_validate({"resources": {"nodes": n}})
    nodes = {f"n{r}": NodeObs(f"n{r}") for r in range(n)}
    d = decide(sp, status(), Observed(pods=gang, nodes=nodes, progress=TRAINING, ranks_seen=frozenset(range(n)),
                                      now=NOW))
    assert d.reason == C.TRAINING, d.message
    assert reads[0] < 20 * n, reads[0]


def test_every_rule_is_one_policys() -> None:
    """Each rule of ``decide.RULES`` lives in one of the four policy modules, whose test file holds its cases."""
    policies = {m.__name__ for m in (failure, elastic, liveness, lifecycle)}
    assert {r.__name__: r.__module__ for r in RULES if r.__module__ not in policies} == {}
