"""End to end, a world-size edit mid-run (issue 30, item 2): the REAL operator (kopf, in-process) and the REAL
trainer (launcher, torchrun, torchtitan workers on CPU) against kmockx, every pod run by tests/e2e/kubelet.py.

A 2-node run on synthetic data (the global sample stream: it resumes at any data-parallel degree) is edited to 3
nodes as soon as attempt 0 exists. The edit is deferred (``SpecAccepted=True/DeferredToNextAttempt``): attempt 0
trains on with its 2 pods, the same uids and config hash, and no pod is added to it. A rank of attempt 0 is killed
at its first checkpoint; attempt 1 has exactly 3 pods with one config hash and ``--nnodes=3``, resumes that
checkpoint at data-parallel degree 3 (DCP reshards the model and optimizer, the data position is global), and the
run succeeds. On hub-streamed data the same edit is refused instead (tests/operator/test_gang_safety.py).

Everything waits on status writes, conditions and files (the checkpoint's metadata, the trainers' hold files).
"""

from __future__ import annotations

import pytest
from common import complete_checkpoints, free_port, step_log
from support import hold
from support.specs import NS, e2e_spec, lpt

from kmockx.harness import LPT, Operator, wait_for
from kubetitan import conditions as C

pytestmark = [pytest.mark.xdist_group("e2e"), pytest.mark.timeout(600)]

STEPS, INTERVAL = 20, 10
"""A checkpoint every 10 steps. The trainers are held (``support.hold``) after step 11, where attempt 0 is killed
(its step-10 checkpoint complete, no later one), and after step 12, attempt 1's second step, until the operator has
scraped the step it resumed from (its restart record's ``resumedFromStep`` is settled from that scrape: an attempt
1 that finished between two 0.5 s scrapes would leave the record at the operator's first guess). Until now 80 steps,
so that neither action needed a hold: ~70 steps (3-4 s) after each."""
OPERATOR = {"namespaces": (NS,), "scan_interval": 0.2, "scrape_interval": 0.5}
START = 300.0  # seconds allowed for a gang to reach its first step (torch imports on two busy cores)


def _gang(c, name: str) -> dict[str, tuple[str, str, list[str]]]:
    """Pod name -> (uid, config hash, args) of the run's pods."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["annotations"]["kubetitan.io/config-hash"],
                                    p["spec"]["containers"][0]["args"]) for p in c.pods(NS, name)}


def _pods_created(c) -> set[str]:
    """Every pod name the operator sent a create for."""
    return {str((r.data or {}).get("metadata", {}).get("name")) for r in list(c.k)
            if r.method.value == "POST" and r.resource and r.resource.plural == "pods"}


@pytest.mark.e2e_nodes(3)
def test_nodes_2_to_3_mid_run_applies_at_the_next_attempt_which_resumes_at_the_new_size(e2e) -> None:
    c, k = e2e.cluster, e2e.kubelet
    name = "ws"
    st = lambda: c.status(NS, name)  # noqa: E731
    held = e2e.ckpt.parent / "held"
    k.env.update(hold.env(held, INTERVAL + 1, INTERVAL + 2))
    running = lambda: st().get("phase") != "Failed"  # noqa: E731
    with Operator(c, **OPERATOR):
        c.apply(lpt(name, e2e_spec(e2e.ckpt, STEPS, INTERVAL, free_port(), maxInPlaceRestarts=0)))
        wait_for(lambda: len(c.pod_names(NS, name)) == 2 and st().get("attempt") == 0, 30, "attempt 0's 2 pods")
        before = _gang(c, name)
        assert len({h for _u, h, _a in before.values()}) == 1 and all("--nnodes=2" in a for _u, _h, a in before.values())

        # ---- the edit, while attempt 0 starts: deferred, attempt 0 untouched
        c.patch(LPT, NS, name, {"spec": {"resources": {"nodes": 3}, "parallelism": {"dataParallelShardDegree": 3}}})
        cond = wait_for(lambda: (x := c.condition(NS, name, C.SPEC_ACCEPTED)) and x["reason"]
                        == C.DEFERRED_TO_NEXT_ATTEMPT and x, 30, "SpecAccepted=True/DeferredToNextAttempt")
        assert cond["status"] == "True" and "resources.nodes 2 -> 3" in cond["message"], cond
        assert "applied when the next attempt starts" in cond["message"], cond
        hold.wait_held(held, INTERVAL + 1, ranks=2, alive=running, timeout=START)  # past the first checkpoint
        assert max(complete_checkpoints(e2e.ckpt)) == INTERVAL, complete_checkpoints(e2e.ckpt)
        assert _gang(c, name) == before, "a pod of the live attempt was changed or added"
        assert st()["attempt"] == 0 and st()["phase"] in ("Starting", "Running"), st()

        # ---- a rank of attempt 0 dies: attempt 1 is the 3-node gang
        k.kill(NS, f"{name}-a0-1")
        hold.go(held, INTERVAL + 1)  # rank 0 goes on into a collective its dead peer never joins
        wait_for(lambda: st().get("restartCount") == 1, 60, "the restart after the kill")
        left = complete_checkpoints(e2e.ckpt)  # what attempt 0 left (attempt 1 has not trained yet)
        assert {p for p in _pods_created(c) if "-a0-" in p} == {f"{name}-a0-0", f"{name}-a0-1"}, "a pod added to attempt 0"
        wait_for(lambda: c.pod_names(NS, name) == [f"{name}-a1-0", f"{name}-a1-1", f"{name}-a1-2"], 60,
                 "attempt 1's 3 pods")
        after = _gang(c, name)
        hashes = {h for _u, h, _a in after.values()}
        assert len(hashes) == 1 and hashes != {h for _u, h, _a in before.values()}, (hashes, before)
        assert all("--nnodes=3" in a for _u, _h, a in after.values()), after
        hold.wait_held(held, INTERVAL + 2, ranks=3, alive=running, timeout=START)
        wait_for(lambda: (st().get("restarts") or [{}])[0].get("resumedFromStep") == max(left), 30,
                 "the restart record's resumedFromStep from the operator's scrape of attempt 1")
        hold.go(held, INTERVAL + 2)

        # ---- attempt 1 resumes attempt 0's newest checkpoint at data-parallel degree 3 and finishes the run
        wait_for(lambda: st().get("phase") == "Succeeded", START, "Succeeded")
    s = st()
    rec = s["restarts"][0]
    assert rec["cause"] == "ContainerFailed" and "137" in rec["message"] and rec["nodeName"] and rec["attempt"] == 0, rec
    assert rec["resumedFromStep"] > 0 and rec["resumedFromStep"] == max(left), (rec, left)
    assert s["attempt"] == 1 and s["restartCount"] == 1 and s["training"]["step"] == STEPS, s
    assert c.condition(NS, name, C.SPEC_ACCEPTED)["reason"] == C.SPEC_APPLIED
    log = step_log(e2e.ckpt)
    by_attempt = [r for r in log if r["attempt"] == 0], [r for r in log if r["attempt"] == 1]
    assert by_attempt[1][0]["step"] == rec["resumedFromStep"] + 1 and by_attempt[1][-1]["step"] == STEPS, by_attempt[1]
    # each step of attempt 1 trains the global batch of 3 data-parallel ranks: 3/2 of attempt 0's tokens a step
    per_step = [{b["tokens"] - a["tokens"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1}
                for recs in by_attempt]
    assert per_step[0] and per_step[1] and {3 * t for t in per_step[0]} == {2 * t for t in per_step[1]}, per_step
    assert STEPS in complete_checkpoints(e2e.ckpt)
