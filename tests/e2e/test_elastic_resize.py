"""End to end, elastic training (issue 27): the REAL operator (kopf, in-process) and the REAL trainer (launcher,
torchrun, torchtitan workers on CPU) against kmockx, every pod run by tests/e2e/kubelet.py on 3 "nodes".

A 3-node run with ``runPolicy.elastic {minNodes: 2}`` on synthetic data (the global sample stream), global batch 6
(gradient accumulation 2 at 3 nodes, 3 at 2). At its first checkpoint the node of rank 2 fails and never comes back
while the run waits: after ``shrinkAfterSeconds`` the operator ends the attempt (one restart record, cause
``Shrink``, 3 -> 2, no ``NodeFailure`` record) and attempt 1 trains on the 2 nodes left, resuming that checkpoint
at data-parallel degree 2. The node then returns: once it has been Ready for ``growCheckSeconds`` the operator plans
a grow, waits for attempt 1's next complete checkpoint, ends it (its pods save again on SIGTERM; the new gang waits
for that save) and attempt 2 trains on 3 nodes to the end (cause ``Grow``, 2 -> 3, no step lost). Every rank's
sample ledger shows each global sample trained exactly once, at the step its position says, across 3 -> 2 -> 3
(a step that a lost attempt trained past its checkpoint is trained again with the very same samples), and every
step trained the same number of tokens at both sizes.

Everything waits on status writes and files (rank 0's step log, the checkpoints); durations are printed, not
asserted (bench/elastic_loss.py measures them).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from common import complete_checkpoints, free_port, step_log
from support.specs import NS, e2e_elastic_spec, lpt
from support.windows import slack

from kmockx.harness import Operator, wait_for
from kubetitan import conditions as C

pytestmark = [pytest.mark.xdist_group("e2e"), pytest.mark.timeout(600)]

STEPS, INTERVAL, GLOBAL_BATCH = 60, 5, 6
"""rank 2's node fails at attempt 0's first checkpoint (step 5, seen in the checkpoint folder) with 55 steps left;
attempt 1 resumes there and must still train when the node's return is planned as a grow (growCheckSeconds, the
operator's 1 s resize interval, then its next checkpoint): 55 steps of 2 ranks with 3 micro-batches each, ~5 s here
(the windows each run prints: bench/results/suite/s16_windows_e2e_s3.txt.xz); a checkpoint every 5 steps, 12 saves."""
SHRINK_AFTER, GROW_CHECK = 2, 2
START = 300.0  # seconds allowed for a gang to reach its first step (torch imports on two busy cores)


def _of(c, name: str, attempt: int) -> list[str]:
    """The pod names of one attempt (an earlier attempt's may still be terminating)."""
    return [p for p in c.pod_names(NS, name) if f"-a{attempt}-" in p]


def ledger(ckpt: Path) -> list[tuple[int, int, int, int, int]]:
    """Every distinct (step, global position, source, window, epoch) any rank of any attempt trained, by position.
    A step trained again after a lost attempt is the same rows (the same samples at the same step): one row."""
    rows: set[tuple[int, ...]] = set()
    for f in (ckpt / "kubetitan" / "ledger").glob("rank-*.txt"):
        rows |= {tuple(int(v) for v in line.split()) for line in f.read_text().splitlines() if line.strip()}
    return sorted(rows, key=lambda r: (r[1], r[0]))


@pytest.mark.e2e_nodes(3, ledger=True)
def test_a_lost_node_shrinks_the_gang_and_its_return_grows_it_back_without_skipping_a_sample(e2e) -> None:
    c, k = e2e.cluster, e2e.kubelet
    name = "el"
    st = lambda: c.status(NS, name)  # noqa: E731
    op = Operator(c, namespaces=(NS,), scan_interval=0.2, scrape_interval=0.5)
    op.options.resize_min_interval_seconds = 1.0
    with op:
        c.apply(lpt(name, e2e_elastic_spec(e2e.ckpt, STEPS, INTERVAL, free_port(), GLOBAL_BATCH, {
            "shrinkAfterSeconds": SHRINK_AFTER, "growCheckSeconds": GROW_CHECK})))
        wait_for(lambda: len(c.pod_names(NS, name)) == 3 and st().get("nodes") == 3, 30, "attempt 0's 3 pods")

        # ---- the node of rank 2 fails at attempt 0's first checkpoint, and no node replaces it
        wait_for(lambda: complete_checkpoints(e2e.ckpt), START, "attempt 0's first checkpoint")
        lost = wait_for(lambda: k.proc(NS, f"{name}-a0-2").node, 10, "rank 2's node")
        k.fail_node(lost)
        slack("rank 2's node failed (attempt 0)", step_log(e2e.ckpt), STEPS, attempt=0)
        failed_at = time.monotonic()
        cond = wait_for(lambda: (x := c.condition(NS, name, C.READY)) and x["reason"] == C.WAITING_FOR_REPLACEMENT
                        and x, 30, "Ready=False/WaitingForReplacement")
        assert f"node {lost} of pod {name}-a0-2 is lost" in cond["message"], cond  # mid-save, or waiting for a node
        wait_for(lambda: st().get("resizeCount") == 1, 60, "the shrink")
        shrunk_at = time.monotonic()
        wait_for(lambda: _of(c, name, 1) == [f"{name}-a1-0", f"{name}-a1-1"], 60, "attempt 1's 2 pods")
        args = [p["spec"]["containers"][0]["args"] for p in c.pods(NS, name) if "-a1-" in p["metadata"]["name"]]
        assert len(args) == 2 and all("--nnodes=2" in a for a in args), args
        s = st()
        assert (s["attempt"], s["nodes"], s["restartCount"]) == (1, 2, 0), s
        full = c.condition(NS, name, C.FULL_SIZE)
        assert (full["status"], full["reason"]) == ("False", C.SHRUNK), full
        wait_for(lambda: any(r.get("attempt") == 1 for r in step_log(e2e.ckpt)), START, "attempt 1's first step")
        trained_again_at = time.monotonic()

        # ---- the node returns: attempt 1 grows back to 3 at its next checkpoint
        k.restore_node(lost)
        slack("the node back (attempt 1, the grow planned from here)", step_log(e2e.ckpt), STEPS, attempt=1)
        wait_for(lambda: st().get("resizeCount") == 2, 120, "the grow")
        slack("the grow decided (attempt 1)", step_log(e2e.ckpt), STEPS, attempt=1)
        grown_at = time.monotonic()
        wait_for(lambda: len(_of(c, name, 2)) == 3, 60, "attempt 2's 3 pods")
        wait_for(lambda: st().get("phase") == "Succeeded", START, "Succeeded")
    s = st()
    shrink, grow = s["restarts"]
    print(f"\nshrink {shrunk_at - failed_at:.1f}s after the node failed (shrinkAfterSeconds={SHRINK_AFTER}); "
          f"attempt 1 trained {trained_again_at - failed_at:.1f}s after it; grow {grown_at - trained_again_at:.1f}s "
          f"after attempt 1's first step; records: {shrink}, {grow}")
    assert (shrink["cause"], shrink["fromNodes"], shrink["toNodes"], shrink["attempt"]) == ("Shrink", 3, 2, 0), shrink
    assert (grow["cause"], grow["fromNodes"], grow["toNodes"], grow["attempt"]) == ("Grow", 2, 3, 1), grow
    assert grow["lostSteps"] == 0, grow  # the planned grow saved (SIGTERM) before the new gang started
    assert (s["attempt"], s["nodes"], s["restartCount"], s["resizeCount"]) == (2, 3, 0, 2), s
    assert c.condition(NS, name, C.FULL_SIZE)["status"] == "True"

    # ---- the step log: every attempt trains the global batch each step (6 samples of 32 tokens), at both sizes
    log = step_log(e2e.ckpt)
    assert {r["attempt"] for r in log} == {0, 1, 2}
    per_step = {b["tokens"] - a["tokens"] for a, b in zip(log, log[1:]) if b["step"] == a["step"] + 1}
    assert len(per_step) == 1, per_step
    assert max(r["step"] for r in log) == STEPS and STEPS in complete_checkpoints(e2e.ckpt)

    # ---- the ledger: each global sample once, at the step its position says, across 3 -> 2 -> 3
    rows = ledger(e2e.ckpt)
    positions = [r[1] for r in rows]
    assert positions == list(range(STEPS * GLOBAL_BATCH)), "a global sample was skipped or trained twice"
    assert all(step == pos // GLOBAL_BATCH + 1 for step, pos, *_ in rows), "a sample trained at another step"
    files = {f.name for f in (e2e.ckpt / "kubetitan" / "ledger").glob("rank-*.txt")}
    assert {"rank-0-of-3.txt", "rank-2-of-3.txt", "rank-0-of-2.txt", "rank-1-of-2.txt"} <= files, files
