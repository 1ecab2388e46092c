"""Failed checkpoint saves as the operator shows them: the ``CheckpointSaveFailing`` condition from the trainer's
failed-saves counts (``conditions.checkpoint_save_failing``, a table over the pure function), and one scrape path:
rank 0's exposition text -> ``observation.scrape.parse_metrics`` -> ``scraped.check`` -> ``observation.tracking.track``
-> ``decide`` -> ``status.next_status``, with one Warning Event per episode, none again after an operator restart."""

from __future__ import annotations

from typing import Any

import pytest

from kubetitan import conditions as C
from kubetitan import scraped
from kubetitan import status as S
from kubetitan.decide import decide
from kubetitan.observation import NodeObs, PodObs
from kubetitan.observation import scrape as observe
from kubetitan.observation import tracking
from kubetitan.timestamps import iso
from kubetitan_core import contract as M
from kubetitan_core.api import AttemptObservation, LlamaPretrainSpec, LlamaPretrainStatus

NOW = 2_000_000.0


def _obs(**kw: Any) -> AttemptObservation:
    return AttemptObservation(attempt=0, **kw)


@pytest.mark.parametrize(("observed", "want"), [
    (None, None),
    (_obs(), None),  # a trainer without the gauges, or not scraped yet: the condition stays as it is
    (_obs(saves_failed_in_a_row=0, saves_failed=0, max_failed_saves=3),
     ("False", C.CHECKPOINT_SAVED, "no checkpoint save has failed")),
    (_obs(saves_failed_in_a_row=0, saves_failed=2, max_failed_saves=3),
     ("False", C.CHECKPOINT_SAVED, "a checkpoint save completed after the failed ones (2 failed in this worker "
                                   "generation)")),
    (_obs(saves_failed_in_a_row=1, saves_failed=1, max_failed_saves=3, last_failed_save_step=40,
          last_save_error="ENOSPC"),
     ("True", C.CHECKPOINT_SAVE_FAILED, "1 checkpoint save(s) in a row failed, the last at step 40 (ENOSPC); 2 more in "
      "a row end the attempt with exit code 6 (spec.checkpoint.maxFailedSaves=3); training goes on and saves again at "
      "the next interval. Check that the checkpoint storage is reachable from the pods and accepts writes (space, "
      "credentials)")),
    (_obs(saves_failed_in_a_row=3, saves_failed=4, max_failed_saves=3, last_failed_save_step=60,
          last_save_error="S3Exception"),
     ("True", C.CHECKPOINT_SAVE_FAILED, "3 checkpoint save(s) in a row failed, the last at step 60 (S3Exception); that "
      "is spec.checkpoint.maxFailedSaves=3: the attempt ends with exit code 6 and the run resumes from the newest "
      "complete checkpoint. Check that the checkpoint storage is reachable from the pods and accepts writes (space, "
      "credentials)")),
    (_obs(saves_failed_in_a_row=2),  # no budget, step or error reported: the spec's budget, nothing made up
     ("True", C.CHECKPOINT_SAVE_FAILED, "2 checkpoint save(s) in a row failed, the last at an unreported step; 3 more "
      "in a row end the attempt with exit code 6 (spec.checkpoint.maxFailedSaves=5); training goes on and saves again "
      "at the next interval. Check that the checkpoint storage is reachable from the pods and accepts writes (space, "
      "credentials)")),
], ids=["no-observation", "not-reported", "none-failed", "recovered", "first-failure", "budget-spent",
        "spec-budget"])
def test_the_condition_follows_the_failed_saves_in_a_row(observed, want) -> None:
    assert C.checkpoint_save_failing(observed, spec_budget=5) == want


# ------------------------------------------------------------------ the scrape path
SPEC = LlamaPretrainSpec.model_validate({"resources": {"nodes": 1, "gpusPerNode": 8}, "training": {"steps": 100},
                                         "checkpoint": {"storage": {"hostPath": "/ck"}, "maxFailedSaves": 3}})
PODS = (PodObs(name="j-a0-0", attempt=0, rank=0, phase="Running", node_name="n0", created=NOW - 500,
               running_since=NOW - 490),)


def _exposition(step: int, in_a_row: int, total: int, failed_step: int, error: str | None) -> str:
    lines = [f"{M.M_ATTEMPT} 0", f"{M.M_STEP} {step}", f"{M.M_LAST_STEP_TIMESTAMP} {NOW}",
             f"{M.M_FIRST_STEP_TIMESTAMP} {NOW - 400}", f"{M.M_LAST_CHECKPOINT_STEP} 10",
             f"{M.M_CHECKPOINT_SAVES_FAILED} {total}", f"{M.M_CHECKPOINT_SAVES_FAILED_IN_A_ROW} {in_a_row}",
             f"{M.M_CHECKPOINT_MAX_FAILED_SAVES} 3", f"{M.M_CHECKPOINT_LAST_FAILED_SAVE_STEP} {failed_step}"]
    if error is not None:
        lines.append(f'{M.M_CHECKPOINT_SAVE_FAILURE}{{error="{error}"}} 1')
    return "\n".join(lines) + "\n"


def _cycle(status: LlamaPretrainStatus, text: str, now: float) -> LlamaPretrainStatus:
    kept, refused = scraped.check(observe.parse_metrics(text), attempt=0, prev=status.observation, now=now,
                                  bounds=scraped.SpecBounds.of(SPEC))
    assert refused == []
    seen = tracking.track(status.observation, 0, now, metrics=kept, pods=PODS, nodes={"n0": NodeObs("n0")})
    obs = tracking.observed(seen, pods=PODS, nodes={"n0": NodeObs("n0")}, now=now,
                     training=S.training_status(SPEC, kept, now, status.training))
    new = S.next_status(SPEC, status, decide(SPEC, status, obs), obs)
    return S.load(new.dump())  # as the API holds it: what a restarted operator reads


def test_failing_saves_reach_the_condition_with_one_event_per_episode() -> None:
    st = LlamaPretrainStatus(attempt=0, start_time=iso(NOW - 600))
    st = _cycle(st, _exposition(20, 0, 0, -1, None), NOW)
    assert C.find(st.conditions, C.CHECKPOINT_SAVE_FAILING).status == "False"
    st.pending_events = []
    st = _cycle(st, _exposition(22, 1, 1, 22, "ENOSPC"), NOW + 10)
    c = C.find(st.conditions, C.CHECKPOINT_SAVE_FAILING)
    assert (c.status, c.reason) == ("True", C.CHECKPOINT_SAVE_FAILED) and "the last at step 22 (ENOSPC); 2 more" in \
        c.message, c.message
    assert [(e.type, e.reason, e.message) for e in st.pending_events] == [("Warning", C.CHECKPOINT_SAVE_FAILED,
                                                                           c.message)]
    st.pending_events = []  # sent
    st = _cycle(st, _exposition(24, 2, 2, 24, "ENOSPC"), NOW + 20)  # the same episode: counted, no second Event
    assert "2 checkpoint save(s) in a row failed" in C.find(st.conditions, C.CHECKPOINT_SAVE_FAILING).message
    assert st.pending_events == []
    st = _cycle(st, _exposition(24, 2, 2, 24, "ENOSPC"), NOW + 25)  # a restarted operator: same state, no Event
    assert st.pending_events == []
    st = _cycle(st, _exposition(26, 0, 2, 24, None), NOW + 30)  # a save completed
    c = C.find(st.conditions, C.CHECKPOINT_SAVE_FAILING)
    assert (c.status, c.reason) == ("False", C.CHECKPOINT_SAVED) and st.pending_events == []
    assert st.observation.last_save_error is None and st.training.step == 26
    st = _cycle(st, _exposition(28, 1, 3, 28, "S3Exception"), NOW + 40)  # a new episode: a new Event
    assert [e.reason for e in st.pending_events] == [C.CHECKPOINT_SAVE_FAILED]


def test_an_error_label_that_is_not_a_name_never_reaches_the_status() -> None:
    kept, _ = scraped.check(observe.parse_metrics(_exposition(22, 1, 1, 22, "no space; rm -rf")), attempt=0, prev=None,
                            now=NOW)
    assert not any(k.startswith(M.M_CHECKPOINT_SAVE_FAILURE + "/") for k in kept)
    assert tracking.track(None, 0, NOW, metrics=kept).last_save_error is None
