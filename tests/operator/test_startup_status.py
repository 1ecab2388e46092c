"""status.training.startup and status.restarts[].startup: the trainer's start-up anatomy (rank 0's
kubetitan_trainer_startup_phase_seconds) reaches the status, and the restart record it follows."""

from __future__ import annotations

from kubetitan_core import contract
from kubetitan import status as S
from kubetitan_core.api import StartupPhases
from kubetitan.decide import Action, Decision
from kubetitan.observation import tracking as T
from kubetitan.observation.scrape import parse_metrics

from support.decide_cases import NOW, gang, ip_rec, ok_nodes, rec, spec, status

PHASES = {"process_start": 0.26, "preflight": 0.31, "imports": 0.52, "process_group_init": 0.004, "model_init": 0.7,
          "checkpoint_load": 3.25, "first_step_compile": 2.98, "first_step": 1.29}


def exposition(generation: int, attempt: int = 0, step: int = 11) -> str:
    lines = [f"# HELP {contract.M_STARTUP_PHASE_SECONDS} phases (seconds).", f"# TYPE {contract.M_STARTUP_PHASE_SECONDS} gauge"]
    lines += [f'{contract.M_STARTUP_PHASE_SECONDS}{{phase="{p}"}} {v}' for p, v in PHASES.items()]
    lines += [f"# TYPE {contract.M_STARTUP_SECONDS} gauge", f"{contract.M_STARTUP_SECONDS} {sum(PHASES.values())}",
              f"# TYPE {contract.M_RESTART_GENERATION} gauge", f"{contract.M_RESTART_GENERATION} {generation}",
              f"# TYPE {contract.M_STEP} gauge", f"{contract.M_STEP} {step}",
              f"# TYPE {contract.M_ATTEMPT} gauge", f"{contract.M_ATTEMPT} {attempt}"]
    return "\n".join(lines) + "\n"


def test_every_phase_of_the_scrape_reaches_status_training_startup():
    m = parse_metrics(exposition(generation=1))
    t = S.training_status(spec(), m, NOW, None)
    assert t.startup == StartupPhases(generation=1, total_seconds=round(sum(PHASES.values()), 3),
                                      **{f"{p}_seconds": v for p, v in PHASES.items()})
    assert list(contract.STARTUP_PHASES) == list(PHASES)
    # before the workers' first step the trainer exports no phases: no (stale) start-up in the status
    assert S.training_status(spec(), {contract.M_STEP: 3.0}, NOW, t).startup is None


def _next(st, m, attempt=0):
    o = T.track(None, attempt, NOW, metrics=m, pods=gang(attempt))
    obs = T.observed(o, pods=gang(attempt), nodes=ok_nodes, now=NOW,
                     training=S.training_status(spec(), m, NOW, st.training))
    return S.next_status(spec(), st, Decision(Action.KEEP), obs)


def test_the_in_place_record_gets_the_start_up_of_its_generation_only():
    m1 = parse_metrics(exposition(generation=1))
    st = _next(status(restarts=[ip_rec(2, "n1")]), m1)  # the record is generation 2's: not this start-up
    assert st.restarts[0].startup is None and st.training.startup.generation == 1
    st = _next(status(restarts=[ip_rec(1, "n1")]), m1)
    r = st.restarts[0]
    assert r.startup is not None and r.startup.checkpoint_load_seconds == 3.25 and r.startup.generation == 1
    # kept as it was when the next generation's numbers arrive
    again = _next(st, parse_metrics(exposition(generation=1)).copy() | {f"{contract.M_STARTUP_PHASE_SECONDS}/imports": 9.0})
    assert again.restarts[0].startup.imports_seconds == 0.52


def test_a_recreated_gang_s_record_gets_the_new_attempt_s_first_start_up():
    st = _next(status(attempt=1, restarts=[rec(0)]), parse_metrics(exposition(generation=0, attempt=1)), attempt=1)
    assert st.restarts[0].startup is not None and st.restarts[0].startup.generation == 0
    # an in-place generation of the new attempt is not the start-up that followed the re-creation
    st = _next(status(attempt=1, restarts=[rec(0)]), parse_metrics(exposition(generation=1, attempt=1)), attempt=1)
    assert st.restarts[0].startup is None
