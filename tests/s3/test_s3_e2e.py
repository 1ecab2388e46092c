"""End to end with checkpoints in S3: the real operator (kopf, in-process) and the e2e kubelet (tests/e2e/kubelet.py,
every pod's command run as local processes) run a 2-node CPU LlamaPretrain whose checkpoints go to a bucket on the
tests' S3 server; a rank is killed, the next attempt resumes from the bucket, and the restart record says the step
it resumed from. A second run, started alongside the first, names a bucket that does not exist: it fails with the
configuration exit code and a condition that names the bucket, without restarts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kmockx.harness import Cluster, Operator, free_port, wait_for
from kubetitan.timestamps import parse_time
from kubetitan.policy import Policy
from kubetitan_trainer import storage

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))  # the e2e kubelet and its builders (no package there)
from common import NS, e2e_spec, lpt, step_log  # noqa: E402
from support import hold  # noqa: E402
from kubelet import Kubelet  # noqa: E402

pytestmark = [pytest.mark.xdist_group("e2e"), pytest.mark.timeout(900)]

STEPS, INTERVAL = 20, 10
"""rank 1 is killed while the trainers are held (``support.hold``) after step 12, two steps past attempt 0's first
checkpoint (so attempt 1 replays two steps), once the operator has scraped that checkpoint; attempt 1 is held after
step 13, its first new step, until the operator has settled the restart record from its scrapes. Until now 80 steps,
so that the kill had 60-70 steps (3 s or more) to land in, and attempt 1 trained long enough to be scraped."""
START = 300.0


def _s3_spec(scratch: Path, endpoint: str, uri: str, steps: int) -> dict:
    spec = e2e_spec(scratch, steps, INTERVAL, free_port(), maxInPlaceRestarts=0)
    spec["checkpoint"]["storage"] = {"s3": {"uri": uri, "endpoint": endpoint, "forcePathStyle": True}}
    return spec


def _operator(c: Cluster, endpoint: str) -> Operator:
    op = Operator(c, namespaces=(NS,), scan_interval=0.2, scrape_interval=0.5)
    # the tests' server speaks http: the admin allows exactly it (policy.s3EndpointPrefixes)
    op.options.policy = Policy(s3_endpoint_prefixes=("https://", endpoint))
    return op


def test_gang_killed_resumes_from_s3_and_a_missing_bucket_fails_with_a_condition(s3_server, bucket, s3_env,
                                                                                 tmp_path):
    ep = s3_server.endpoint
    uri = f"s3://{bucket}/e2e/run"
    store = storage.S3Store(storage.S3Settings(uri=uri, endpoint=ep, force_path_style=True))
    scratch = tmp_path / "scratch"

    def complete() -> list[int]:
        return sorted(int(n[5:]) for n, done in store.entries() if done)

    def st(name: str) -> dict:
        return c.status(NS, name)

    held = tmp_path / "held"
    running = lambda: st(name).get("phase") != "Failed"  # noqa: E731
    with Cluster() as c, Kubelet(c, tmp_path / "kubelet", nodes=2) as k:
        k.env.update(hold.env(held, INTERVAL + 2, INTERVAL + 3))
        op = _operator(c, ep).__enter__()
        try:
            name, bad = "s3run", "missing"
            c.apply(lpt(name, _s3_spec(scratch, ep, uri, STEPS)))
            # the run whose bucket does not exist starts alongside (checked at the end): its gang's start overlaps
            # the first run's instead of following its end
            c.apply(lpt(bad, _s3_spec(tmp_path / "scratch-bad", ep, "s3://no-such-bucket-e2e/run", 4)))
            # attempt 0 trains past its first S3 checkpoint
            hold.wait_held(held, INTERVAL + 2, ranks=2, alive=running, timeout=START)
            wait_for(lambda: ((st(name).get("training") or {}).get("lastCheckpointStep") or 0) >= INTERVAL
                     and st(name).get("attempt") == 0, START, "attempt 0's first checkpoint in S3")
            assert not (scratch / "checkpoint").exists(), "checkpoints went to the bucket, not the scratch folder"
            k.kill(NS, f"{name}-a0-1")
            hold.go(held, INTERVAL + 2)  # rank 0 goes on into a collective its dead peer never joins
            wait_for(lambda: st(name).get("restartCount") == 1, 60, "restart after the kill")
            left = complete()  # what attempt 0 left in the bucket (attempt 1's pods do not exist yet)
            hold.wait_held(held, INTERVAL + 3, ranks=2, alive=running, timeout=START)
            wait_for(lambda: len(st(name).get("restarts") or []) > 0
                     and st(name)["restarts"][0].get("downtimeSeconds") is not None, START,
                     "restart 0 settled (attempt 1's first step)")
            hold.go(held, INTERVAL + 3)
            rec = st(name)["restarts"][0]
            assert rec["cause"] == "ContainerFailed" and "137" in rec["message"] and rec["nodeName"], rec
            assert left and rec["resumedFromStep"] == max(left) and max(left) % INTERVAL == 0, (rec, left)
            log = step_log(scratch)
            j = next(i for i, r in enumerate(log) if r["attempt"] == 1)
            first, last_old = log[j], log[j - 1]
            assert first["step"] == rec["resumedFromStep"] + 1, "attempt 1 did not resume from the bucket's newest step"
            # lost = trained by attempt 0 and trained again: at most one checkpoint interval (+ the step in flight);
            # the record (from the operator's last scrape of attempt 0) never overstates it. Downtime ends with
            # attempt 1's first TRAINED step, not with its checkpoint load. (The gang-kill checks that were
            # tests/e2e/test_faults.py's first fault, on a claim, before its run dropped that gang start.)
            lost = last_old["step"] - rec["resumedFromStep"]
            assert 0 <= lost <= INTERVAL + 1, (rec, lost)
            assert rec["lostSteps"] is not None and 0 <= rec["lostSteps"] <= lost, (rec, lost)
            assert abs(parse_time(rec["time"]) + rec["downtimeSeconds"] - first["time"]) < 1.0, (rec, first)
            wait_for(lambda: st(name).get("phase") == "Succeeded", START, "the run succeeded")
            assert complete()[-1] == STEPS
            # a replayed step has the loss it had before the kill (the state came back from S3)
            losses: dict[int, set[float]] = {}
            for r in step_log(scratch):
                losses.setdefault(r["step"], set()).add(r["loss"])
            assert all(len(v) == 1 for v in losses.values()), losses

            # ---- a bucket that does not exist: exit 2, a condition naming it, no restart
            wait_for(lambda: st(bad).get("phase") == "Failed", START, "the missing-bucket run failed")
            s = st(bad)
            text = " ".join(f"{x.get('reason')}: {x.get('message')}" for x in s.get("conditions") or [])
            assert "no-such-bucket-e2e" in text and "create the bucket" in text, s
            assert s.get("restartCount", 0) == 0, s
        finally:
            op.stop()
        assert not k.errors, f"the e2e kubelet failed: {k.errors!r}"
