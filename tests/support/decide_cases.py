"""The table cases of the restart decision (``kubetitan.decide``), shared by its policies' test files.

Each case is (id, spec, status, observed, want action, want reason, want cause, the rest of the decision): the rest
is the whole Decision as a dict (every field but the message, which ``message_has`` checks), built from the Decision
defaults plus what the case names, so a rule that starts deleting, forcing or requeueing something else fails the
diff. A case lives in the test file of the policy whose rule decides it (tests/operator/test_decide_<policy>.py);
each file checks that every rule of its policy decides at least one of its cases."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from kubetitan import conditions as C
from kubetitan_core.api import Condition, LlamaPretrainSpec, LlamaPretrainStatus, RestartRecord
from kubetitan.decide import RULES, Action, Decision, decide
from kubetitan.observation import NodeObs, Observed, PodObs, Progress
from kubetitan.status import next_status
from kubetitan.timestamps import iso

NOW = 1_000_000.0


def spec(**run_policy: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "runPolicy": run_policy})


def steps_spec(steps: int, **run_policy: Any) -> LlamaPretrainSpec:
    return LlamaPretrainSpec.model_validate({"resources": {"nodes": 2}, "training": {"steps": steps},
                                             "runPolicy": run_policy})


def status(attempt: int | None = 0, restarts: list[RestartRecord] = (), conds: list[Condition] = (),
           **kw: Any) -> LlamaPretrainStatus:
    return LlamaPretrainStatus(attempt=attempt, restarts=list(restarts), restart_count=len(restarts),
                               conditions=list(conds), start_time=iso(NOW - 100), **kw)


def pod(rank: int, attempt: int = 0, phase: str = "Running", **kw: Any) -> PodObs:
    return PodObs(name=f"j-a{attempt}-{rank}", attempt=attempt, rank=rank, phase=phase,
                  node_name=kw.pop("node_name", f"n{rank}"), created=NOW - 50, running_since=NOW - 40, **kw)


def gang(attempt: int = 0, over: dict[int, dict[str, Any]] | None = None) -> tuple[PodObs, ...]:
    return tuple(replace(pod(r, attempt), **(over or {}).get(r, {})) for r in range(2))


def rec(attempt: int, cause: str = "ContainerFailed", ago: float = 5.0, node: str | None = None,
        resumed: int = 0, lost: int | None = None) -> RestartRecord:
    return RestartRecord(attempt=attempt, cause=cause, time=iso(NOW - ago), node_name=node,
                         resumed_from_step=resumed, lost_steps=lost)


def ip_rec(generation: int, node: str, ago: float = 50.0, attempt: int = 0) -> RestartRecord:
    return RestartRecord(attempt=attempt, mode="InPlace", generation=generation, cause="ContainerFailed",
                         time=iso(NOW - ago), node_name=node, resumed_from_step=10, lost_steps=4, downtime_seconds=2.0)


TRAINING = Progress(step=20, start_step=0, last_checkpoint_step=10, last_progress_time=NOW - 1, first_step_time=NOW - 30,
                    metrics_available=True, metrics_ok_time=NOW)
IN_PLACE = Progress(step=12, start_step=10, last_checkpoint_step=10, last_progress_time=NOW - 1, first_step_time=NOW - 2,
                    metrics_available=True, metrics_ok_time=NOW, generation=1, generation_start_time=NOW - 5,
                    previous_generation_step=14, restart_exit_code=137, restart_node_rank=1)
"""Rank 0's workers of generation 1 train (rank 1's worker was SIGKILLed at step 14; resumed from 10)."""
SCRAPED_NO_STEP = Progress(metrics_available=True, metrics_ok_time=NOW)
UNREACHABLE = Progress(metrics_available=False, metrics_error="GET http://10.0.0.1:9090/metrics timed out")
SEEN = frozenset({0, 1})
ok_nodes = {"n0": NodeObs("n0"), "n1": NodeObs("n1")}

RESTART_ALL = {"delete": ("j-a0-0", "j-a0-1")}


def _want(action: Action, reason: str, cause: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    size = 2 if action == Action.CREATE else None  # a create names the attempt's size: every case's spec has 2 nodes
    want = {**asdict(Decision(action, reason, cause=cause, nodes=size)),
            **{k: v for k, v in extra.items() if k != "message_has"}}
    want.pop("message")
    if "rule" not in extra:
        want.pop("rule")
    return want


def check_decision(spec_: LlamaPretrainSpec, status_: LlamaPretrainStatus, obs: Observed, action: Action, reason: str,
                   cause: str | None, extra: dict[str, Any]) -> None:
    """One table case: the whole decision is what the case says."""
    d = decide(spec_, status_, obs)
    want = _want(action, reason, cause, extra)
    got = {k: v for k, v in asdict(d).items() if k in want}
    assert got == want, d.message
    if "message_has" in extra:
        assert extra["message_has"] in d.message, d.message


def check_story(spec_: LlamaPretrainSpec, status_: LlamaPretrainStatus, obs: Observed) -> None:
    """The case's decision, turned into the status: the phase is the conditions' phase, no condition contradicts
    another, ChildrenCreated speaks of the current attempt, no waiting message carries a running counter
    (``conditions.contradictions``)."""
    new = next_status(spec_, status_, decide(spec_, status_, obs), obs)
    assert C.contradictions(new.phase, new.conditions, new.attempt) == [], [c.dump() for c in new.conditions]


def rules_fired(module: Any, cases: list[tuple[Any, ...]]) -> set[str]:
    """The rules of ``module`` (a policy of ``kubetitan.decide``) that decide none of ``cases`` (empty: every one
    decides at least one)."""
    mine = {r.__name__ for r in RULES if r.__module__ == module.__name__}
    assert mine, f"{module.__name__} has no rule in decide.RULES"
    return mine - {decide(c[1], c[2], c[3]).rule for c in cases}


def policy_table_tests(module: Any, cases: list[tuple[Any, ...]]) -> tuple[Any, Any, Any]:
    """The three tests every policy's table file runs over its ``cases`` (``(id, spec, status, observed, action,
    reason, cause, extra)``): each decision is what its case says; each decision's status tells one story; each rule
    of ``module`` decides at least one case. A file binds them to ``test_*`` names for pytest to collect."""
    import pytest

    ids = [c[0] for c in cases]

    @pytest.mark.parametrize(("spec_", "status_", "obs", "action", "reason", "cause", "extra"),
                             [c[1:] for c in cases], ids=ids)
    def test_decide(spec_, status_, obs, action, reason, cause, extra) -> None:
        check_decision(spec_, status_, obs, action, reason, cause, extra)

    @pytest.mark.parametrize(("spec_", "status_", "obs"), [c[1:4] for c in cases], ids=ids)
    def test_every_decision_leads_to_a_status_that_tells_one_story(spec_, status_, obs) -> None:
        check_story(spec_, status_, obs)

    def test_every_rule_has_a_case() -> None:
        assert not rules_fired(module, cases), rules_fired(module, cases)

    test_every_rule_has_a_case.__doc__ = f"Each rule of ``{module.__name__}`` decides at least one case here."
    return test_decide, test_every_decision_leads_to_a_status_that_tells_one_story, test_every_rule_has_a_case
