"""One writer: two ``kubetitan operator --leader-elect`` processes against kmockx (the strict API double).

The double serves ``coordination.k8s.io/v1`` Leases like any object (PUT with a stale resourceVersion is 409
Conflict), logs every request with its User-Agent (each replica names its identity there) and injects faults
per User-Agent, so one replica's renewals can fail while the other's succeed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kmockx.harness import NS, RELEASE_NS, Cluster, OperatorProcess, cpu_spec, lpt, wait_for

pytestmark = pytest.mark.xdist_group("operator-ha")

LEASES = "coordination.k8s.io/v1/leases"
LEASE = "kubetitan-test"
DURATION, DEADLINE, RETRY = 3.0, 2.0, 0.5
"""Short terms (the defaults are 15/10/2 s); the same ratios matter: deadline < duration, deadline > 1.2 x retry."""
WRITES = ("create", "update", "patch", "delete")


def _args(identity: str) -> tuple[str, ...]:
    return ("--namespace", NS, "--scan-interval", "0.2", "--leader-elect", "--leader-elect-identity", identity,
            "--leader-elect-resource-name", LEASE, "--leader-elect-resource-namespace", RELEASE_NS,
            "--leader-elect-lease-duration", str(DURATION), "--leader-elect-renew-deadline", str(DEADLINE),
            "--leader-elect-retry-period", str(RETRY))


def _lease(c: Cluster) -> dict[str, Any]:
    return (c.get(LEASES, RELEASE_NS, LEASE) or {}).get("spec") or {}


def _holder(c: Cluster) -> str:
    return _lease(c).get("holderIdentity") or ""


def _writes(c: Cluster, identity: str, after: float = float("-inf")) -> list[str]:
    """Every write request (not the Lease's own) the replica sent, answered after ``after`` (monotonic)."""
    return [str(e) for e in list(c.k.log) if e.verb in WRITES and f"({identity})" in e.agent
            and "/leases" not in e.path and e.time > after]


def _requests(c: Cluster, verb: str, plural: str, identity: str | None = None) -> list[str]:
    """Object names of every ``verb`` request on ``plural`` that succeeded (by one replica, or any)."""
    out = []
    for e in list(c.k.log):
        path = e.path.split("?")[0]
        if e.verb != verb or e.code >= 300 or f"/{plural}" not in path or (identity and f"({identity})" not in e.agent):
            continue
        out.append(path.rsplit("/", 1)[1] if verb != "create" else path)
    return out


def _pod_creates(c: Cluster) -> list[str]:
    return [(r.data or {}).get("metadata", {}).get("name", "") for r in list(c.k)
            if r.method is not None and r.method.value == "POST" and r.resource is not None
            and r.resource.plural == "pods"]


def test_a_replica_that_cannot_renew_stops_writing_and_the_other_acts_once(cluster: Cluster) -> None:
    logs: list[OperatorProcess] = []
    try:
        _split_brain_then_hand_back(cluster, logs)
    except Exception as e:  # an assertion or an API error of the test's own calls: say what each replica did
        raise AssertionError(f"{type(e).__name__}: {e}\n" + "\n".join(f"--- replica {i}:\n{op.log_text()[-3000:]}"
                                                   for i, op in enumerate(logs))) from None


def _split_brain_then_hand_back(cluster: Cluster, logs: list[OperatorProcess]) -> None:
    with OperatorProcess(cluster.kubeconfig, *_args("replica-a")) as a:
        logs.append(a)
        wait_for(lambda: _holder(cluster) == "replica-a", 15, "replica A holds the Lease")
        with OperatorProcess(cluster.kubeconfig, *_args("replica-b")) as b:
            logs.append(b)
            cluster.apply(lpt("ha", cpu_spec(nodes=2)))
            wait_for(lambda: cluster.pod_names(NS, "ha") == ["ha-a0-0", "ha-a0-1"], 15, "attempt 0 by A")
            for r in range(2):
                cluster.run_pod(NS, f"ha-a0-{r}", f"node-{r}")
            wait_for(lambda: (cluster.status(NS, "ha").get("observation") or {}).get("ranksSeen") == [0, 1], 15,
                     "A's status of attempt 0")
            assert _holder(cluster) == "replica-a" and not _writes(cluster, "replica-b"), \
                "the standby watches but never writes"

            # A's renewals fail (503 for A's Lease updates only); A goes on running, and its watches still work
            fault = cluster.k.inject(code=503, resource="leases", verbs={"update"}, agent="(replica-a)")
            fenced_at = time.monotonic() + DEADLINE  # A's last good renewal was sent before now: its fence closes by then
            wait_for(lambda: _holder(cluster) == "replica-b", 4 * DURATION, "replica B takes the Lease over")
            took_over = time.monotonic()
            assert took_over >= fenced_at, "B took over before A's renew deadline had passed"
            assert _lease(cluster).get("leaseTransitions") == 1

            # one pod failure: B restarts the gang once (A, still running and watching, does nothing)
            cluster.terminate_pod(NS, "ha-a0-1", 1)
            wait_for(lambda: cluster.pod_names(NS, "ha") == ["ha-a1-0", "ha-a1-1"], 20, "B restarted to attempt 1")
            wait_for(lambda: ("Warning", "RestartContainerFailed") in cluster.events(NS, "ha"), 10, "the restart Event")
            for r in range(2):
                cluster.run_pod(NS, f"ha-a1-{r}", f"node-{r}")
            wait_for(lambda: (cluster.status(NS, "ha").get("observation") or {}).get("ranksSeen") == [0, 1]
                     and cluster.status(NS, "ha").get("attempt") == 1, 15, "B's status of attempt 1")
            late = _writes(cluster, "replica-a", after=fenced_at)
            assert not late, f"replica A wrote after its renew deadline: {late}"
            assert fault.hits > 0
            assert "Lost the leader Lease" in a.log_text(), "A says it stepped down"

            # A -> B -> A: B stops (it releases the Lease on SIGTERM); A takes over at once and re-reads the run
            cluster.k.clear_faults()
            b.stop()
        wait_for(lambda: _holder(cluster) == "replica-a", 4 * DURATION, "replica A takes the Lease back")
        assert _lease(cluster).get("leaseTransitions") == 2
        cluster.terminate_pod(NS, "ha-a1-1", 0, "Completed")
        cluster.terminate_pod(NS, "ha-a1-0", 0, "Completed")
        wait_for(lambda: cluster.status(NS, "ha").get("phase") == "Succeeded", 20, "Succeeded under A")
        wait_for(lambda: ("Normal", "Completed") in cluster.events(NS, "ha"), 10, "the Completed Event")

    # every pod created once and deleted at most once, the restart by B, the attempt-1 pods never deleted
    assert sorted(_pod_creates(cluster)) == ["ha-a0-0", "ha-a0-1", "ha-a1-0", "ha-a1-1"]
    deleted = _requests(cluster, "delete", "pods")
    assert sorted(deleted) == sorted(set(deleted)) and not [n for n in deleted if n.startswith("ha-a1-")], deleted
    assert {n for n in deleted} <= set(_requests(cluster, "delete", "pods", "replica-b")), deleted
    assert cluster.events(NS, "ha") == [("Normal", "Completed"), ("Warning", "RestartContainerFailed")], \
        cluster.events(NS, "ha")
    st = cluster.status(NS, "ha")
    assert (st["restartCount"], st["attempt"]) == (1, 1)


# ------------------------------------------------------------------ the Lease deleted under two replicas
ROUNDS = 20
FAST = dict(lease_duration=1.0, renew_deadline=0.6, retry_period=0.1)
"""Terms short enough for 20 hand-overs in ~30 s; the margin between deadline and duration (0.4 s) is the fence's
slack, and the holder that finds its Lease gone steps down within one retry period of the deletion."""


class _Replica:
    """One candidate as the operator wires it: a ``LeaderElector`` over the operator's client, the client fenced by
    it, and a worker that writes (creates a ConfigMap named by its identity, term and a counter) whenever it leads."""

    def __init__(self, cluster: Cluster, identity: str) -> None:
        from kubetitan.kube import Client, load_config
        from kubetitan.leader import LeaderElector, LeaseConfig

        self.identity = identity
        self.client = Client(load_config(cluster.kubeconfig), user_agent=f"kubetitan-test ({identity})")
        self.elector = LeaderElector(LeaseConfig(namespace=RELEASE_NS, name=LEASE, identity=identity, **FAST),
                                     self.client)
        self.client.fence = self.elector
        self.tasks: list[Any] = []

    async def work(self) -> None:
        from kubetitan.leader import NotLeader

        seq = 0
        while True:
            term = await self.elector.wait()
            seq += 1
            cm = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"w-{self.identity}-{term}-{seq}", "namespace": NS}}
            try:
                await self.client.create(cm)
            except NotLeader:
                pass

    def start(self) -> None:
        import asyncio

        self.tasks = [asyncio.create_task(self.elector.run()), asyncio.create_task(self.work())]

    async def stop(self) -> None:
        import asyncio
        import contextlib

        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.client.aclose()


def _epochs(c: Cluster) -> list[str]:
    """The writer epoch (identity-term) of every write the server stored, in the order it stored them."""
    return [e.name.rsplit("-", 1)[0][2:] for e in list(c.k.log)
            if e.verb == "create" and e.code < 300 and e.name.startswith("w-")]


def _interleaved(epochs: list[str]) -> list[str]:
    """Epochs with a write stored after another epoch's write: two replicas writing in the same period."""
    blocks = [e for i, e in enumerate(epochs) if i == 0 or epochs[i - 1] != e]
    seen: set[str] = set()
    out = []
    for b in blocks:
        if b in seen:
            out.append(b)
        seen.add(b)
    return out


def test_deleting_the_lease_under_two_replicas_never_gives_two_writers(cluster: Cluster) -> None:
    """Each round the Lease is deleted under its holder (the double refuses the holder's Lease creates, so the
    standby is the one that creates it again): the standby must not write until the old holder's fence has closed,
    and the old holder steps down when it finds its Lease gone. Over 20 hand-overs, the writes the server stored
    come in one block per leader term: no write of a term is stored after a write of a later one."""
    import asyncio

    async def scenario() -> list[str]:
        reps = {i: _Replica(cluster, i) for i in ("replica-a", "replica-b")}
        for r in reps.values():
            r.start()

        async def until(pred: Any, what: str, timeout: float = 10.0) -> Any:
            deadline = time.monotonic() + timeout
            while not (got := pred()):
                assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
                await asyncio.sleep(0.01)
            return got

        def wrote(ident: str) -> bool:
            term = reps[ident].elector.term
            return reps[ident].elector.leading and f"{ident}-{term}" in _epochs(cluster)

        try:
            holder = await until(lambda: next((i for i in reps if wrote(i)), None), "a first leader's write")
            for rnd in range(ROUNDS):
                other = next(i for i in reps if i != holder)
                fault = cluster.k.inject(code=503, resource="leases", verbs={"create"}, agent=f"({holder})")
                await asyncio.to_thread(cluster.delete, LEASES, RELEASE_NS, LEASE)
                await until(lambda: _holder(cluster) == other and wrote(other), f"round {rnd}: {other} writes")
                cluster.k.faults.remove(fault)
                holder = other
        finally:
            for r in reps.values():
                await r.stop()
        return _epochs(cluster)

    epochs = asyncio.run(scenario())
    blocks = [e for i, e in enumerate(epochs) if i == 0 or epochs[i - 1] != e]
    assert not _interleaved(epochs), f"writes of one term stored after another term's: {_interleaved(epochs)}; " \
                                     f"the order of terms: {blocks[:40]}"
    assert len(blocks) >= ROUNDS + 1, blocks  # one term per hand-over, each with its writes


# ------------------------------------------------------------------ a write slower than the Lease
def test_a_pod_create_slower_than_the_lease_succeeds_under_leader_election(cluster: Cluster) -> None:
    """Every pod create takes 20 s (a slow admission webhook: the double holds each pod POST 20 s before it stores it)
    under leader election with 3/2/0.5 s terms. The create is sent within the fence and runs on while the operator
    keeps renewing its Lease: one POST, answered 201, the pod counted as created (no FailedCreate, ChildrenCreated
    True), and the Lease never changed hands. (Cutting each write's timeout to the Lease's remaining seconds sent the
    create again and again and never saw one succeed.)"""
    from kmockx.harness import Operator
    from kubetitan.leader import LeaseConfig

    slow = cluster.k.inject(code=0, delay=20.0, resource="pods", verbs={"create"})
    lease = LeaseConfig(namespace=RELEASE_NS, name=LEASE, identity="replica-a", lease_duration=DURATION,
                        renew_deadline=DEADLINE, retry_period=RETRY)
    with Operator(cluster, namespaces=(NS,), leader=lease):
        cluster.apply(lpt("slow", cpu_spec(nodes=1)))
        wait_for(lambda: (cluster.condition(NS, "slow", "ChildrenCreated") or {}).get("status") == "True"
                 and "Creating" not in str(cluster.status(NS, "slow").get("conditions")), 45,
                 "the pod created (a 20 s create) and the status saying so")
        renewals_during = [e for e in list(cluster.k.log) if e.verb == "update" and "/leases/" in e.path]
        held = _lease(cluster)
    posts = [e for e in list(cluster.k.log) if e.verb == "create" and e.path.endswith("/pods")]
    assert [e.code for e in posts] == [201] and slow.hits == 1, [str(e) for e in posts]
    assert len(renewals_during) >= int(20 / RETRY) // 2, "the Lease was renewed while the create was in flight"
    assert held.get("holderIdentity") == "replica-a" and held.get("leaseTransitions") == 0, held
    assert ("Warning", "FailedCreate") not in cluster.events(NS, "slow"), cluster.events(NS, "slow")
