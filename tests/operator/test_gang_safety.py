"""The real operator against kmockx (issue 30, items 2, 4, 5): a spec edit never touches a live gang, Events are
aggregated like a Kubernetes controller's, and an Event that belongs to a status change survives a SIGKILL.

- nodes 2 -> 3 mid-run: every pod of attempt 0 keeps its uid and config hash and no pod is added. On synthetic
  data the edit is deferred (SpecAccepted=True/DeferredToNextAttempt) and the attempt after a failure has 3
  consistent pods; on hub-streamed data it is refused with its reason (SpecAccepted=False/WorldSizeChangeRefused +
  one Warning Event), an attempt that then fails restarts into Blocked (its own phase, reason and Event), and
  reverting the edit starts attempt 1 with 2 consistent pods;
- a quota refusing a 256-pod gang: one FailedCreate Event counted per round, naming 256 pods and the API's
  message; one refused pod create per round (slow start), not 256;
- pod creates answered 429 with a Retry-After: retried after that wait, the gang complete, no duplicate create;
- the operator SIGKILLed after writing a restart into the status and before its Event: the next operator sends
  it, exactly once.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import aiohttp.web
import pytest

from kmockx import ApiError, merge_patch
from kmockx.harness import LPT, NS, Cluster, Operator, OperatorProcess, cpu_spec, lpt, wait_for
from kubetitan import conditions as C
from kubetitan_core.api import Condition

pytestmark = pytest.mark.xdist_group("operator-ha")


def _events(c: Cluster, name: str, reason: str | None = None) -> list[dict]:
    return [e for e in c.list("v1/events", NS) if (e.get("involvedObject") or {}).get("name") == name
            and (reason is None or e.get("reason") == reason)]


def _written_statuses(c: Cluster, name: str) -> list[dict]:
    """The run's status after each of the operator's status writes (its merge patches replayed in order)."""
    assert c.k is not None
    out, cur = [], {}
    for r in list(c.k):
        if r.method == "PATCH" and r.subresource == "status" and r.name == name and isinstance(r.data, dict):
            cur = merge_patch(cur, r.data.get("status") or {})
            out.append(copy.deepcopy(cur))
    return out


def _assert_one_story(c: Cluster, name: str) -> None:
    for st in _written_statuses(c, name):
        if "conditions" not in st:
            continue
        conds = [Condition.model_validate(x) for x in st["conditions"]]
        assert C.contradictions(st.get("phase"), conds, st.get("attempt")) == [], st


def _gang(c: Cluster, name: str) -> dict[str, tuple[str, str, list[str]]]:
    """Pod name -> (uid, config hash, args) of the run's pods."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["metadata"]["annotations"]["kubetitan.io/config-hash"],
                                    p["spec"]["containers"][0]["args"]) for p in c.pods(NS, name)}


HUB = {"source": "huggingface", "huggingface": {"dataset": "builtin", "streaming": False}}


@pytest.mark.parametrize("data", [{"source": "synthetic"}, HUB], ids=["synthetic-deferred", "hub-refused"])
def test_nodes_2_to_3_mid_run_never_touches_the_live_gang(cluster: Cluster, rank0, data: dict) -> None:
    """The same edit of a running 2-node gang, on data that resumes at another data-parallel degree (deferred: the
    next attempt has 3 pods) and on hub-streamed data (refused: the restart is Blocked until the edit is reverted).
    Either way attempt 0 is never changed or added to."""
    refused = data is HUB
    with Operator(cluster) as op:
        cluster.apply(lpt("ws", {**cpu_spec(nodes=2), "data": data}, metrics_port=rank0.port))
        wait_for(lambda: len(cluster.pod_names(NS, "ws")) == 2, 20, "2 pods")
        for r in range(2):
            cluster.run_pod(NS, f"ws-a0-{r}", f"node-{r}")
        rank0.step(10, checkpoint=10)
        wait_for(lambda: cluster.status(NS, "ws").get("phase") == "Running", 20, "Running")
        before = _gang(cluster, "ws")
        assert len({h for _u, h, _a in before.values()}) == 1 and all("--nnodes=2" in a for _u, _h, a in before.values())
        # 1) nodes only: invalid for 3 nodes (the shard degree is 4), and the API server's CEL rule on spec refuses
        # it (a change anywhere under spec re-checks the rules on spec: ratcheting, as kube-apiserver does)
        with pytest.raises(ApiError, match="422"):
            cluster.patch(LPT, NS, "ws", {"spec": {"resources": {"nodes": 3}}})
        # 2) a valid 3-node spec: deferred to the next attempt, or refused with the reason; never applied to attempt 0
        cluster.patch(LPT, NS, "ws", {"spec": {"resources": {"nodes": 3}, "parallelism": {"dataParallelShardDegree": 6}}})
        want = C.WORLD_SIZE_CHANGE_REFUSED if refused else C.DEFERRED_TO_NEXT_ATTEMPT
        cond = wait_for(lambda: (c := cluster.condition(NS, "ws", "SpecAccepted")) and c["reason"] == want and c,
                        20, f"SpecAccepted {want}")
        assert cond["status"] == ("False" if refused else "True") and "resources.nodes 2 -> 3" in cond["message"], cond
        if refused:
            assert "hub-streamed data" in cond["message"] and "Revert the edit" in cond["message"], cond
            assert "kubetitan prepare-data" in cond["message"] and "new LlamaPretrain" in cond["message"], cond
            ev = wait_for(lambda: _events(cluster, "ws", C.WORLD_SIZE_CHANGE_REFUSED), 20, "the refusal's Event")
            assert len(ev) == 1 and ev[0]["type"] == "Warning" and "resources.nodes 2 -> 3" in ev[0]["message"], ev
        else:
            assert "applied when the next attempt starts" in cond["message"], cond
        base = op.run_cycles("ws")
        wait_for(lambda: op.run_cycles("ws") >= base + 20, 30, "20 more cycles of the run")
        assert _gang(cluster, "ws") == before, "a pod of the live attempt was changed or added"
        assert not [r for r in list(cluster.k) if r.method.value == "POST" and r.resource and r.resource.plural == "pods"
                    and (r.data or {}).get("metadata", {}).get("name") == "ws-a0-2"], "a create of ws-a0-2 was sent"
        st = cluster.status(NS, "ws")
        assert st["phase"] == "Running" and cluster.condition(NS, "ws", "Ready")["status"] == "True", st
        assert len(_events(cluster, "ws", C.WORLD_SIZE_CHANGE_REFUSED)) == (1 if refused else 0)  # once, not per cycle
        # 3) attempt 0 fails while the edit stands
        cluster.terminate_pod(NS, "ws-a0-1", 1)
        if refused:  # the restart is Blocked (its own phase, reason and Event) until the edit is reverted
            _blocked_then_reverted(cluster)
        else:  # attempt 1 at the new size: 3 pods, one config
            wait_for(lambda: cluster.pod_names(NS, "ws") == ["ws-a1-0", "ws-a1-1", "ws-a1-2"], 30, "attempt 1's 3 pods")
            after = _gang(cluster, "ws")
            assert len({h for _u, h, _a in after.values()}) == 1 and all("--nnodes=3" in a for _u, _h, a in after.values())
            assert {h for _u, h, _a in after.values()} != {h for _u, h, _a in before.values()}
            wait_for(lambda: (cluster.condition(NS, "ws", "ChildrenCreated") or {}).get("message")
                     == "all 3 pods of attempt 1 exist", 20, "ChildrenCreated of attempt 1")
            wait_for(lambda: cluster.condition(NS, "ws", "SpecAccepted")["reason"] == C.SPEC_APPLIED, 20,
                     "the edit applied by attempt 1")
            assert cluster.status(NS, "ws")["phase"] == "Restarting"  # until attempt 1 trains
    _assert_one_story(cluster, "ws")


def _blocked_then_reverted(cluster: Cluster) -> None:
    wait_for(lambda: cluster.status(NS, "ws").get("phase") == "Blocked", 20, "phase Blocked")
    assert cluster.condition(NS, "ws", "Restarting")["reason"] == C.RESTART_BLOCKED
    children = cluster.condition(NS, "ws", "ChildrenCreated")
    assert children["status"] == "False" and "attempt 1" in children["message"], children
    restart = _events(cluster, "ws", "RestartContainerFailed")
    assert len(restart) == 1 and "attempt 1 cannot start" in restart[0]["message"], restart
    assert "starting attempt 1" not in restart[0]["message"]
    blocked = wait_for(lambda: _events(cluster, "ws", C.RESTART_BLOCKED), 20, "the RestartBlocked Event")
    assert len(blocked) == 1 and "resources.nodes 2 -> 3" in blocked[0]["message"], blocked
    assert not [n for n in cluster.pod_names(NS, "ws") if "-a1-" in n]
    # reverted: attempt 1 starts with 2 consistent pods
    cluster.patch(LPT, NS, "ws", {"spec": {"resources": {"nodes": 2}, "parallelism": {"dataParallelShardDegree": 4}}})
    wait_for(lambda: cluster.pod_names(NS, "ws") == ["ws-a1-0", "ws-a1-1"], 30, "attempt 1's 2 pods")
    after = _gang(cluster, "ws")
    assert len({h for _u, h, _a in after.values()}) == 1 and all("--nnodes=2" in a for _u, _h, a in after.values())
    wait_for(lambda: (cluster.condition(NS, "ws", "ChildrenCreated") or {}).get("message")
             == "all 2 pods of attempt 1 exist", 20, "ChildrenCreated of attempt 1")
    assert cluster.status(NS, "ws")["phase"] == "Restarting"  # until attempt 1 trains


QUOTA = 'pods "q-a0-0" is forbidden: exceeded quota: team-quota, requested: cpu=2, used: cpu=64, limited: cpu=64'


def test_a_quota_refusing_a_256_pod_gang_is_one_counted_event(cluster: Cluster) -> None:
    assert cluster.k is not None
    fault = cluster.k.inject(code=403, verbs="create", resource="pods", namespace=NS, message=QUOTA)
    with Operator(cluster):
        cluster.apply(lpt("q", cpu_spec(nodes=256)))
        ev = wait_for(lambda: (e := _events(cluster, "q", "FailedCreate")) and (e[0].get("count") or 0) >= 4 and e,
                      60, "4 refused create rounds counted on one Event")
        rounds = fault.hits
        events = _events(cluster, "q")
        assert len(events) <= 2, [(e["reason"], e["message"]) for e in events]
        assert len(ev) == 1 and ev[0]["type"] == "Warning", ev
        msg = ev[0]["message"]
        assert "256 pod(s) of attempt 0 are not created" in msg and "exceeded quota: team-quota" in msg, msg
        assert ev[0]["series"]["count"] == ev[0]["count"] and ev[0]["lastTimestamp"] >= ev[0]["firstTimestamp"]
        children = cluster.condition(NS, "q", "ChildrenCreated")
        assert children["status"] == "False" and children["reason"] == "Forbidden", children
        assert "0/256 pods of attempt 0 exist" in children["message"], children
        assert cluster.status(NS, "q")["phase"] == "Pending"
    posts = [r for r in list(cluster.k) if r.method.value == "POST" and r.resource and r.resource.plural == "pods"]
    # slow start: a refused batch of 1 ends the round, so one refused create per round, not 256
    assert len(posts) == fault.hits and rounds <= fault.hits <= ev[0]["count"] + 2, (len(posts), fault.hits)


def test_a_lifted_quota_is_noticed_at_its_watch_event_not_after_the_backoff(cluster: Cluster, monkeypatch) -> None:
    """A quota refuses the 2-pod gang; the create backoff is then 15-30 s (stretched here from 0.25-0.5 s, the
    first refusal's, so that only the watch can explain a prompt create). The quota is raised: its watch event ends
    the backoff and the pods are created within a few seconds, not after it."""
    import time

    from kubetitan.reconcile import memory

    assert cluster.k is not None
    monkeypatch.setattr(memory, "CREATE_RETRY_BASE_SECONDS", 30.0)
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "team-quota", "namespace": NS},
             "spec": {"hard": {"pods": "0"}}}
    cluster.call(cluster.k.put("v1/resourcequotas", quota))
    cluster.k.inject(code=403, verbs="create", resource="pods", namespace=NS, message=QUOTA)
    with Operator(cluster):
        cluster.apply(lpt("ql", cpu_spec(nodes=2)))
        wait_for(lambda: _events(cluster, "ql", "FailedCreate"), 20, "the refused round's Event")
        cluster.k.clear_faults()  # the admin raises the quota
        t0 = time.monotonic()
        cluster.patch("v1/resourcequotas", NS, "team-quota", {"spec": {"hard": {"pods": "10"}}})
        wait_for(lambda: cluster.pod_names(NS, "ql") == ["ql-a0-0", "ql-a0-1"], 10, "the 2 pods, before the backoff")
        took = time.monotonic() - t0
    assert took < 10, took  # the backoff was at least 15 s


def test_pod_creates_answered_429_wait_their_retry_after_and_the_gang_ends_complete_without_duplicates(
        cluster: Cluster, monkeypatch) -> None:
    """The first pod creates are answered 429 with ``Retry-After: 7``: each is sent again only after the client
    asked to wait those 7 s (recorded instead of slept), and the 8-pod gang ends with every pod, each POSTed
    until its one 201 and never again (no 409: no duplicate create)."""
    import kubetitan.kube as kube

    waits: list[tuple[str, float]] = []
    real_sleep = asyncio.sleep

    async def recorded(seconds: float, cause: str) -> None:
        waits.append((cause, seconds))
        await real_sleep(0)

    monkeypatch.setattr(kube, "_backoff_sleep", recorded)
    assert cluster.k is not None
    fault = cluster.k.inject(code=429, verbs="create", resource="pods", namespace=NS, count=3, retry_after=7)
    with Operator(cluster):
        cluster.apply(lpt("ra", cpu_spec(nodes=8)))
        wait_for(lambda: len(cluster.pod_names(NS, "ra")) == 8, 30, "8 pods")
        wait_for(lambda: cluster.status(NS, "ra").get("phase") == "Starting", 30, "phase Starting")
    assert fault.hits == 3
    after_429 = [w for cause, w in waits if cause == "429"]  # (a dropped keep-alive connection may retry too)
    assert len(after_429) == 3 and all(w == 7.0 for w in after_429), waits  # exactly the Retry-After
    posts = [e for e in cluster.k.log if e.verb == "create" and e.path.split("?")[0] == f"/api/v1/namespaces/{NS}/pods"]
    assert [e.code for e in posts].count(429) == 3 and [e.code for e in posts].count(201) == 8, posts
    assert len(posts) == 11, [str(e) for e in posts]  # 8 accepted + 3 refused: nothing sent twice, no 409
    assert sorted(cluster.pod_names(NS, "ra")) == [f"ra-a0-{r}" for r in range(8)]
    children = cluster.condition(NS, "ra", "ChildrenCreated")
    assert children is None or children["status"] == "True", children  # retried inside the client: no refusal


def test_the_restart_event_survives_an_operator_sigkill_between_status_and_event(cluster: Cluster) -> None:
    """The restart is written into the status (with its Event pending), the operator is SIGKILLed while the
    Event's create is in flight (held by the API double, then refused): the next operator sends it, exactly once,
    and clears the pending mark."""
    held, release = threading.Event(), asyncio.Event()

    async def hold_restart_event(request) -> None:
        res = request.resource
        if request.method.value == "POST" and res is not None and res.plural == "events" \
                and str((request.data or {}).get("reason", "")).startswith("Restart") and not held.is_set():
            held.set()
            await release.wait()
            raise aiohttp.web.HTTPServiceUnavailable()  # the operator is dead by now: never stored

    assert cluster.k is not None
    cluster.k.hooks.append(hold_restart_event)
    args = ("--namespace", NS, "--scan-interval", "0.2", "--scrape-interval", "0.1")
    first = OperatorProcess(cluster.kubeconfig, *args).start()
    try:
        cluster.apply(lpt("k", cpu_spec(nodes=2)))
        wait_for(lambda: len(cluster.pod_names(NS, "k")) == 2, 30, "2 pods")
        for r in range(2):
            cluster.run_pod(NS, f"k-a0-{r}", f"node-{r}")
        wait_for(lambda: cluster.status(NS, "k").get("observation", {}).get("ranksSeen") == [0, 1], 30, "both seen")
        cluster.terminate_pod(NS, "k-a0-1", 1)
        assert held.wait(30), "the restart Event was never sent"
        pending = cluster.status(NS, "k").get("pendingEvents") or []
        assert [e["reason"] for e in pending] == ["RestartContainerFailed"], pending  # written before the Event
        first.kill()
    finally:
        if first.proc is not None and first.proc.poll() is None:
            first.kill()
    cluster.k.hooks.clear()
    cluster.loop.call_soon_threadsafe(release.set)
    assert _events(cluster, "k", "RestartContainerFailed") == []
    with OperatorProcess(cluster.kubeconfig, *args):
        ev = wait_for(lambda: _events(cluster, "k", "RestartContainerFailed"), 30, "the restart Event, resent")
        wait_for(lambda: not cluster.status(NS, "k").get("pendingEvents"), 30, "the pending mark cleared")
        wait_for(lambda: {"k-a1-0", "k-a1-1"} <= set(cluster.pod_names(NS, "k")), 30, "attempt 1 goes on")
    ev = _events(cluster, "k", "RestartContainerFailed")
    assert len(ev) == 1 and ev[0].get("count") == 1, ev
    assert "Attempt 0 ended" in ev[0]["message"] and "starting attempt 1" in ev[0]["message"]
    assert cluster.status(NS, "k")["restartCount"] == 1


class _EventsApi:
    """The three calls the recorder makes, on a dict (a stand-in for the API server's Event store)."""

    def __init__(self) -> None:
        self.events: dict[str, dict] = {}
        self.writes = 0

    async def create(self, obj: dict) -> bool:
        self.writes += 1
        if obj["metadata"]["name"] in self.events:
            return False  # 409: it exists (kube.Client.create reads it and answers False)
        self.events[obj["metadata"]["name"]] = copy.deepcopy(obj)
        return True

    async def get(self, resource: str, ns: str, name: str) -> dict | None:
        return copy.deepcopy(self.events.get(name))

    async def patch(self, resource: str, ns: str, name: str, patch: dict) -> dict:
        self.writes += 1
        self.events[name] = merge_patch(self.events[name], patch)
        return self.events[name]


def test_the_recorder_counts_a_repeat_on_the_same_event_also_after_a_restart() -> None:
    """client-go's aggregation: the same (object, type, reason, message) is one Event whose count grows, also for a
    new recorder (an operator restart: its create meets 409, it reads the count and counts on); another message
    is another Event; a status change's Event is created once however often it is resent."""
    from kubetitan.events import Recorder

    run = {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
           "metadata": {"name": "r", "namespace": NS, "uid": "u-1"}}
    api, t = _EventsApi(), [1000.0]

    async def scenario() -> None:
        rec = Recorder(api, instance="op-1", clock=lambda: t[0])
        for _ in range(3):
            await rec.record(run, "Warning", "FailedCreate", "2 pod(s) of attempt 0 are not created: quota")
            t[0] += 10
        again = Recorder(api, instance="op-2", clock=lambda: t[0])  # a restarted operator
        await again.record(run, "Warning", "FailedCreate", "2 pod(s) of attempt 0 are not created: quota")
        await again.record(run, "Warning", "FailedCreate", "1 pod(s) of attempt 0 are not created: quota")
        for _ in range(2):
            assert await again.send_once(run, "Warning", "RestartContainerFailed", "Attempt 0 ended", "T1")

    asyncio.run(scenario())
    by_msg = {e["message"]: e for e in api.events.values()}
    assert len(api.events) == 3, list(by_msg)
    counted = by_msg["2 pod(s) of attempt 0 are not created: quota"]
    assert counted["count"] == 4 and counted["series"]["count"] == 4 and counted["involvedObject"]["uid"] == "u-1"
    assert counted["firstTimestamp"] < counted["lastTimestamp"] and counted["reportingComponent"] == "kubetitan-operator"
    assert by_msg["1 pod(s) of attempt 0 are not created: quota"]["count"] == 1
    assert by_msg["Attempt 0 ended"]["count"] == 1


def test_a_warning_about_a_state_is_not_counted_again_after_a_restart() -> None:
    """A spec warning (``UnknownInstanceType``) is sent once per change: a restarted operator sees the same spec, finds
    the Event it sent before and leaves its count alone (it was counted once per restart); within one process, a
    warning that went away and came back counts, and a new state is a new Event."""
    from kubetitan.events import Recorder

    run = {"apiVersion": "kubetitan.io/v1alpha1", "kind": "LlamaPretrain",
           "metadata": {"name": "r", "namespace": NS, "uid": "u-1"}}
    api, msg = _EventsApi(), "resources.instanceType p9.mega is not in the catalog"

    async def scenario() -> None:
        await Recorder(api, instance="op-1").record(run, "Warning", "UnknownInstanceType", msg, known=True)
        for restart in range(3):  # each restart reports the state it finds, once
            await Recorder(api, instance=f"op-{restart + 2}").record(run, "Warning", "UnknownInstanceType", msg,
                                                                     known=True)
        again = Recorder(api, instance="op-9")
        await again.record(run, "Warning", "UnknownInstanceType", msg, known=True)
        assert [e["count"] for e in api.events.values()] == [1]
        await again.record(run, "Warning", "UnknownInstanceType", msg, known=True)  # gone and back, this process
        await again.record(run, "Warning", "UnknownInstanceType", "another warning", known=True)

    asyncio.run(scenario())
    assert sorted(e["count"] for e in api.events.values()) == [1, 2]
