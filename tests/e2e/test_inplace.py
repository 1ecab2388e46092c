"""End to end, two-level recovery: the REAL operator (kopf, in-process) and the REAL trainer (the launcher with
in-place restarts on, torchrun's agent with a c10d rendezvous, torchtitan workers) against kmockx, with
tests/e2e/kubelet.py running every pod as local processes (2 "nodes" x 1 process, the test model on CPU).

One run goes through the three paths in order (every gang start imports torch on a two-core machine):

attempt 0, generation 0  rank 1's WORKER is SIGKILLed (its launcher lives on) -> the launchers restart every
                         rank's workers in place: same pods (names and uids), generation 1 resumes from the
                         newest checkpoint, one record with mode InPlace
attempt 0, generation 1  the same pod's worker is killed again -> the node failed in place twice in a row: the
                         operator re-creates the gang (record mode Recreate)
attempt 1                rank 1's node goes NotReady -> Recreate (NodeFailure), as without in-place restarts
attempt 2                rank 1's worker is frozen (SIGSTOP) -> its launcher's watchdog applies the Auto hang rule
                         to the workers' step heartbeats, long before hangTimeoutSeconds (120): the operator runs
                         with --hang-floor-seconds 5 and passes it on, so Auto is max(10 x median step, 5 s); the
                         gang restarts in place (record InPlace, cause Hang, same pods). Then rank 0's own worker is
                         frozen (its /metrics with it): its launcher sees it the same way, in place again. Auto is
                         the rule in force for this whole run (the steps are far below 12 s), so the run also shows
                         it raising no false Hang through the restarts above.
then                     the run is deleted mid-training: the finalizer is released and every pod and process is
                         gone, with no ConfigMap or Service left.

Everything waits on status writes and rank 0's step log (each record carries its attempt and generation).
"""

from __future__ import annotations

import json

import pytest
from common import complete_checkpoints, free_port, step_log
from support.specs import NS, e2e_spec, lpt
from support.windows import slack

from kmockx.harness import CMS, LPT, PODS, SVCS, Operator, wait_for
from kubetitan.timestamps import parse_time

pytestmark = [pytest.mark.xdist_group("e2e"), pytest.mark.timeout(900)]

STEPS, INTERVAL = 400, 4
OPERATOR = {"namespaces": (NS,), "scan_interval": 0.2, "scrape_interval": 0.5, "hang_floor_seconds": 5.0}
HANG_TIMEOUT = 120
START = 300.0  # seconds allowed for a gang to reach its first step (torch imports on two busy cores)


def _uids(c, name: str) -> dict[str, str]:
    """Name -> uid of the run's live pods: a re-created attempt's pods may still be terminating (a rank stopping
    on SIGTERM waits for its gang's checkpoint save) when the next attempt has trained its first step."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.pods(NS, name)
            if not p["metadata"].get("deletionTimestamp")}


def _log_reaches(ckpt, attempt: int, generation: int, step: int, timeout: float = START) -> None:
    wait_for(lambda: any(r["attempt"] == attempt and r.get("generation") == generation and r["step"] >= step
                         for r in step_log(ckpt)), timeout,
             f"rank 0's step log: attempt {attempt} generation {generation} at step >= {step}")


def _settled(c, name: str, index: int) -> dict:
    """Restart record ``index`` once the next attempt or generation trained its first step."""
    wait_for(lambda: len(c.status(NS, name).get("restarts") or []) > index
             and c.status(NS, name)["restarts"][index].get("downtimeSeconds") is not None, START,
             f"restart {index} settled (the first step after it)")
    return c.status(NS, name)["restarts"][index]


@pytest.mark.e2e_nodes(4)  # spare nodes: attempt 2's ranks land on two nodes while the lost one is down and attempt
# 1's survivor still terminates (the double's scheduler spreads by pod count; a GPU pod would need a node of its own)
def test_worker_failure_restarts_in_place_then_escalates_and_a_lost_node_recreates(e2e) -> None:
    c, k = e2e.cluster, e2e.kubelet
    name = "inplace"
    with Operator(c, **OPERATOR):
        c.apply(lpt(name, e2e_spec(e2e.ckpt, STEPS, INTERVAL, free_port(), maxInPlaceRestarts=3,
                                    hangTimeoutSeconds=HANG_TIMEOUT)))
        _log_reaches(e2e.ckpt, 0, 0, INTERVAL + 1)
        wait_for(lambda: c.step(NS, name) >= INTERVAL + 1, 60, "the operator saw the first checkpoint interval")
        pods = _uids(c, name)
        assert sorted(pods) == [f"{name}-a0-0", f"{name}-a0-1"]
        node1 = c.get(PODS, NS, f"{name}-a0-1")["spec"]["nodeName"]

        # ---- a worker dies on a healthy node: every rank's workers restart in place
        killed_at_step = step_log(e2e.ckpt)[-1]["step"]
        assert k.kill_workers(NS, f"{name}-a0-1"), "no worker process to kill"
        # the checkpoints complete when the worker died (generation 1 saves the same steps again once it has trained
        # past them: by the time the restart is settled, a step the kill cut off may be complete, saved after it)
        complete_at_kill = complete_checkpoints(e2e.ckpt)
        slack("worker kill (attempt 0, generation 0)", step_log(e2e.ckpt), STEPS, attempt=0)
        rec = _settled(c, name, 0)
        assert rec["mode"] == "InPlace" and rec["attempt"] == 0 and rec["generation"] == 1, rec
        assert rec["cause"] == "ContainerFailed" and "signal 9" in rec["message"] and rec["nodeName"] == node1, rec
        st = c.status(NS, name)
        assert st["attempt"] == 0 and st["restartCount"] == 1
        assert _uids(c, name) == pods, "the pods were re-created: an in-place restart keeps them"
        deletes = [str(x) for x in c.k.log if x.verb == "delete" and "/pods" in x.path]
        assert not deletes, f"a pod was deleted during an in-place restart: {deletes}"
        log = step_log(e2e.ckpt)
        gen1 = [r for r in log if r["attempt"] == 0 and r.get("generation") == 1]
        assert gen1[0]["step"] == rec["resumedFromStep"] + 1, (rec, gen1[:2])
        # the newest complete checkpoint, or the restore tier's newer step when the kill cut that step's DCP save
        # off (the tier is written before it): the start-up record says which
        source = next(json.loads(x)["checkpoint_source"] for x in (e2e.ckpt / "kubetitan" / "startup.jsonl")
                      .read_text().splitlines() if json.loads(x)["attempt"] == 0 and json.loads(x)["generation"] == 1)
        assert rec["resumedFromStep"] % INTERVAL == 0 and rec["resumedFromStep"] >= max(
            [s for s in complete_at_kill if s <= killed_at_step], default=0), (rec, complete_at_kill)
        assert rec["resumedFromStep"] in set(complete_at_kill) | set(complete_checkpoints(e2e.ckpt)) or (
            source == "restore_tier"), (rec, source)
        # lost = trained by generation 0 after that checkpoint: at most one interval (+ the step in flight)
        last_gen0 = max(r["step"] for r in log if r["attempt"] == 0 and r.get("generation") == 0)
        assert last_gen0 >= killed_at_step and 0 <= last_gen0 - rec["resumedFromStep"] <= INTERVAL + 1, (rec, last_gen0)
        assert rec["lostSteps"] is not None and abs(rec["lostSteps"] - (last_gen0 - rec["resumedFromStep"])) <= 1
        # downtime ends with generation 1's first trained step
        assert abs(parse_time(rec["time"]) + rec["downtimeSeconds"] - gen1[0]["time"]) < 1.0, (rec, gen1[0])

        # ---- the same pod's worker fails again: the node failed in place twice -> re-create the gang
        _log_reaches(e2e.ckpt, 0, 1, rec["resumedFromStep"] + 2)
        assert k.kill_workers(NS, f"{name}-a0-1")
        slack("worker kill (attempt 0, generation 1)", step_log(e2e.ckpt), STEPS, attempt=0)
        wait_for(lambda: c.status(NS, name).get("restartCount") == 2, START, "the second failure recorded")
        rec2 = c.status(NS, name)["restarts"][1]
        assert rec2["mode"] == "Recreate" and rec2["attempt"] == 0 and "failed in place twice in a row" in rec2["message"], rec2
        assert rec2["cause"] == "ContainerFailed"
        _settled(c, name, 1)
        assert sorted(_uids(c, name)) == [f"{name}-a1-0", f"{name}-a1-1"]
        _log_reaches(e2e.ckpt, 1, 0, 1)

        # ---- a NotReady node re-creates the gang, in-place restarts or not
        victim = f"{name}-a1-1"
        node = c.get(PODS, NS, victim)["spec"]["nodeName"]
        k.fail_node(node)
        slack("node failure (attempt 1)", step_log(e2e.ckpt), STEPS, attempt=1)
        wait_for(lambda: c.status(NS, name).get("restartCount") == 3, 60, "node failure restart")
        rec3 = c.status(NS, name)["restarts"][2]
        assert rec3["mode"] == "Recreate" and rec3["cause"] == "NodeFailure" and rec3["nodeName"] == node, rec3
        wait_for(lambda: c.get(PODS, NS, victim) is None, 30, "the dead node's pod force-deleted")
        k.crash_node_processes(node)
        _settled(c, name, 2)
        k.restore_node(node)
        assert sorted(_uids(c, name)) == [f"{name}-a2-0", f"{name}-a2-1"]
        assert node not in {c.get(PODS, NS, p)["spec"]["nodeName"] for p in _uids(c, name)}
        assert [r["mode"] for r in c.status(NS, name)["restarts"]] == ["InPlace", "Recreate", "Recreate"]

        # ---- a frozen worker: its launcher's watchdog applies the Auto hang rule to its step heartbeats (max(10 x
        # median step, the 5 s floor) long before hangTimeoutSeconds) and every rank's workers restart in place
        pods2 = _uids(c, name)
        node_of = {p: c.get(PODS, NS, p)["spec"]["nodeName"] for p in pods2}
        assert len(set(node_of.values())) == 2, node_of  # else the second hang is its node's second: escalation
        _log_reaches(e2e.ckpt, 2, 0, c.status(NS, name)["restarts"][2]["resumedFromStep"] + 6)  # Auto needs 5 steps
        assert k.freeze(NS, f"{name}-a2-1"), "no worker process to freeze"
        slack("rank 1 frozen (attempt 2)", step_log(e2e.ckpt), STEPS, attempt=2)
        rec4 = _settled(c, name, 3)
        assert (rec4["mode"], rec4["cause"], rec4["attempt"], rec4.get("generation")) == ("InPlace", "Hang", 2, 1), rec4
        assert rec4["nodeName"] == node_of[f"{name}-a2-1"] and "exit code 7" in rec4["message"], rec4
        assert _uids(c, name) == pods2, "a hang on a healthy node re-created the pods"

        # ---- rank 0's own worker frozen: its /metrics freezes with it, so the operator has no evidence; its
        # launcher's watchdog does (the heartbeat file, no network) and the gang restarts in place again
        _log_reaches(e2e.ckpt, 2, 1, rec4["resumedFromStep"] + 6)
        assert k.freeze(NS, f"{name}-a2-0"), "no worker process to freeze"
        slack("rank 0 frozen (attempt 2)", step_log(e2e.ckpt), STEPS, attempt=2)
        rec5 = _settled(c, name, 4)
        assert (rec5["mode"], rec5["cause"], rec5["attempt"], rec5.get("generation")) == ("InPlace", "Hang", 2, 2), rec5
        assert rec5["nodeName"] == node_of[f"{name}-a2-0"], rec5
        assert _uids(c, name) == pods2
        assert [r["cause"] for r in c.status(NS, name)["restarts"]] == ["ContainerFailed", "ContainerFailed", "NodeFailure",
                                                                 "Hang", "Hang"], "a false Hang before a freeze"
        _log_reaches(e2e.ckpt, 2, 2, rec5["resumedFromStep"] + 2)

        # ---- the run deleted mid-training (it has 400 steps): the finalizer is released, every pod and process
        # goes, and nothing of the run is left (once its own scenario in test_faults.py: one gang start less)
        assert len(k.live_processes()) >= 4  # 2 launchers + 2 workers
        c.delete(LPT, NS, name)
        slack("run deleted (attempt 2)", step_log(e2e.ckpt), STEPS, attempt=2)
        wait_for(lambda: c.lpt(NS, name) is None, 30, "the LlamaPretrain deleted (finalizer released)")
        wait_for(lambda: not c.pod_names(NS, name) and not k.live_processes(), 60, "pods and processes gone")
    assert not c.list(CMS, NS) and not c.list(SVCS, NS)
