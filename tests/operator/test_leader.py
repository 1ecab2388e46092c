"""kubetitan.leader: the Lease protocol and the fence, table-tested against an in-memory Lease API with
resourceVersion preconditions and a manual clock (no sleeps: each test drives ``_try_acquire_or_renew``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from typing import Any

import pytest

from kubetitan.kube import ApiError
from kubetitan.leader import LeaderElector, LeaseConfig, NotLeader
from support.fakes import FakeClock


class LeaseApi:
    """One Lease, stored as the API server stores it: resourceVersion bumped per write, PUT on a stale one is 409."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.rv = 0
        self.fail: set[str] = set()  # identities whose writes get 503

    async def get_lease(self, ns: str, name: str, timeout: float | None = None) -> dict[str, Any] | None:
        return copy.deepcopy(self.obj)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        if (lease["spec"].get("holderIdentity") or "") in self.fail:
            raise ApiError(503, "PUT", "/leases")
        self.rv += 1
        self.obj = copy.deepcopy(lease)
        self.obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.obj)

    async def create_lease(self, ns: str, lease: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self.obj is not None:
            raise ApiError(409, "POST", "/leases")
        return self._store(lease)

    async def update_lease(self, ns: str, name: str, lease: dict[str, Any], timeout: float | None = None
                           ) -> dict[str, Any]:
        if self.obj is None:
            raise ApiError(404, "PUT", "/leases")
        if (lease.get("metadata") or {}).get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "PUT", "/leases")
        return self._store(lease)


CFG = dict(namespace="kt", name="lock", lease_duration=15.0, renew_deadline=10.0, retry_period=2.0)


def _elector(api: LeaseApi, clock: FakeClock, identity: str) -> LeaderElector:
    return LeaderElector(LeaseConfig(identity=identity, **CFG), api, clock=clock, wall=lambda: 1.7e9)


def _try(e: LeaderElector) -> bool:
    ok = asyncio.run(e._try_acquire_or_renew())
    if ok:
        e._leading.set()  # what run() does after a successful acquisition
    return ok


@pytest.mark.parametrize(("kw", "want"), [
    ({}, []),
    ({"lease_duration": 10.0, "renew_deadline": 10.0}, ["must be longer than the renew deadline"]),
    ({"renew_deadline": 2.0, "retry_period": 2.0}, ["must be longer than 1.2 x the retry period"]),
    ({"retry_period": 0.0}, ["--leader-elect-retry-period is 0.0"]),
    ({"namespace": ""}, ["no namespace for the Lease"]),
], ids=["defaults", "deadline-not-shorter", "deadline-vs-retry", "zero-retry", "no-namespace"])
def test_lease_config_problems(kw: dict[str, Any], want: list[str]) -> None:
    problems = LeaseConfig(**{**CFG, **kw}).problems()
    assert len(problems) == len(want) and all(w in p for w, p in zip(want, problems, strict=True)), problems


def _released(api: LeaseApi) -> None:
    """The Lease as a stopped operator leaves it (empty holder, 1 s): the next candidate takes it at once."""
    asyncio.run(api.create_lease("kt", {"metadata": {"name": "lock"}, "spec": {
        "holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": 3}}))


def test_first_candidate_takes_a_released_lease_at_once_and_the_second_stands_by() -> None:
    api, clock = LeaseApi(), FakeClock(1000.0)
    _released(api)
    a, b = _elector(api, clock, "a"), _elector(api, clock, "b")
    assert _try(a) and a.leading and api.obj["spec"]["holderIdentity"] == "a"
    assert api.obj["spec"]["leaseTransitions"] == 4 and api.obj["spec"]["leaseDurationSeconds"] == 15
    assert not _try(b) and not b.leading
    clock.now += 14.9  # not yet expired by b's own clock (it first saw the record at 1000)
    assert not _try(b)


def test_a_candidate_that_creates_the_lease_acts_a_lease_duration_after_it_found_none() -> None:
    """No Lease: a creates it and holds it (b stands by), but writes nothing until 15 s after it found none (a holder
    whose Lease was deleted may be inside its fence until then); a renews meanwhile."""
    api, clock = LeaseApi(), FakeClock(1000.0)
    a, b = _elector(api, clock, "a"), _elector(api, clock, "b")
    assert _try(a) and api.obj["spec"]["holderIdentity"] == "a" and api.obj["spec"]["leaseTransitions"] == 0
    assert not a.leading
    with pytest.raises(NotLeader):
        a.check()
    assert not _try(b) and not b.leading
    clock.now += 8.0
    assert _try(a) and not a.leading  # renewed on the fast path, still waiting
    clock.now += 6.9
    assert not a.leading
    clock.now += 0.1  # 15 s after a found no Lease
    assert a.leading


@pytest.mark.parametrize("holder_notices_first", [True, False], ids=["renewal-gets-404", "reads-the-new-holder"])
def test_a_deleted_lease_the_holder_steps_down_and_the_new_creator_waits(holder_notices_first: bool) -> None:
    """The Lease is deleted under its holder a. Whoever creates it next acts only 15 s after it found it absent; a
    steps down as soon as it finds its Lease gone (404 on its renewal) or held by another (b created it first),
    however far its renew deadline is."""
    api, clock = LeaseApi(), FakeClock(1000.0)
    _released(api)
    a, b = _elector(api, clock, "a"), _elector(api, clock, "b")
    assert _try(a) and a.leading and not _try(b)
    clock.now += 2.0
    api.obj = None  # kubectl delete lease
    if holder_notices_first:
        assert not _try(a) and not a.leading  # the renewal's 404: a stepped down at once (its deadline is 8 s away)
        with pytest.raises(NotLeader):
            a.check()
        clock.now += 0.5
        assert _try(b) and not b.leading  # b found no Lease and created it: waits until 1017.0
    else:
        assert _try(b) and not b.leading  # b found no Lease (at 1002.0) and created it
        assert a.leading  # a has not noticed yet: its fence (opened by its renewal at 1000) bounds it
        assert not _try(a) and not a.leading  # its renewal's 409, then the read names b: stepped down at once
    assert api.obj["spec"]["holderIdentity"] == "b"
    for _ in range(7):
        clock.now += 2.0
        assert _try(b) and not a.leading and not _try(a)
    assert not b.leading  # 1016.0 (or 1016.5): still inside the 15 s since b found no Lease at 1002.0 (or 1002.5)
    clock.now += 1.0
    assert b.leading and not a.leading


@pytest.mark.parametrize("ending", ["renewals-fail", "lease-deleted"])
def test_a_write_in_flight_outlasts_the_renew_deadline_while_renewed_and_is_abandoned_when_the_lease_may_go(
        ending: str) -> None:
    """``hold``: a write sent within the fence runs on while renewals succeed (4 s against a 1.6 s lease: a slow
    admission webhook), each renewal moving the expiry on. Once the renewals fail, the write in flight is abandoned
    (``NotLeader``) by the expiry of the last renewal sent at the latest; once the Lease is found deleted, at the next
    renewal. Real time (the elector's own loop runs): terms 1.6/1.0/0.2 s, long enough that an event loop stalled for
    a few tenths of a second by a loaded machine still renews in time (with 0.4/0.25/0.05 s a stall under two CPU
    hogs made the first write's renewals miss their deadline, and the product rightly abandoned it)."""
    api = LeaseApi()
    _released(api)
    e = LeaderElector(LeaseConfig(namespace="kt", name="lock", identity="a", lease_duration=1.6, renew_deadline=1.0,
                                  retry_period=0.2), api)

    async def main() -> None:
        election = asyncio.create_task(e.run())
        try:
            await e.wait()
            e.check()
            rv = api.rv
            assert await e.hold(asyncio.sleep(4.0, "stored")) == "stored"
            assert api.rv - rv >= 5, "renewed while the write was in flight"
            e.check()
            in_flight = asyncio.create_task(e.hold(asyncio.sleep(30)))
            await asyncio.sleep(0)
            if ending == "renewals-fail":
                api.fail.add("a")
                t0, want, limit = time.monotonic(), "no renewal succeeded for 1 s", 1.6
            else:
                api.obj = None
                t0, want, limit = time.monotonic(), "the Lease was deleted", 0.2 * 2
            with pytest.raises(NotLeader, match="abandoned a write in flight") as err:
                await in_flight
            assert want in str(err.value)
            assert time.monotonic() - t0 < limit + 0.3  # (scheduling slack on a loaded machine)
            assert not e.leading
        finally:
            election.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await election

    asyncio.run(main())


def test_takeover_after_expiry_counts_a_transition_and_fences_the_old_leader() -> None:
    api, clock = LeaseApi(), FakeClock(1000.0)
    _released(api)
    a, b = _elector(api, clock, "a"), _elector(api, clock, "b")
    assert _try(a)
    assert not _try(b)  # b observes a's record now
    api.fail.add("a")  # a's renewals fail from here on
    clock.now += 9.9
    assert a.leading and not _try(a)  # the renewal fails, but a may still write until its deadline
    a.check()
    clock.now += 0.2  # 10.1 s after a's last good renewal was sent: its fence is closed
    assert not a.leading
    with pytest.raises(NotLeader):
        a.check()
    assert not _try(b)  # 10.1 s < 15 s since b saw the record change
    clock.now += 5.0
    assert _try(b) and b.leading
    assert api.obj["spec"]["holderIdentity"] == "b" and api.obj["spec"]["leaseTransitions"] == 5


def test_a_renewal_keeps_acquire_time_and_transitions_and_moves_the_fence() -> None:
    api, clock = LeaseApi(), FakeClock(1000.0)
    a = _elector(api, clock, "a")
    assert _try(a)
    acquired = api.obj["spec"]["acquireTime"]
    clock.now += 8.0
    assert _try(a)  # the fast path: one PUT on the resourceVersion it wrote
    assert api.obj["spec"]["acquireTime"] == acquired and api.obj["spec"]["leaseTransitions"] == 0
    clock.now += 9.0  # 17 s after the first renewal, 9 s after the second
    assert a.leading


def test_two_candidates_racing_for_an_expired_lease_one_wins_by_resource_version() -> None:
    api, clock = LeaseApi(), FakeClock(1000.0)
    old, b, c = _elector(api, clock, "old"), _elector(api, clock, "b"), _elector(api, clock, "c")
    assert _try(old)
    assert not _try(b) and not _try(c)
    clock.now += 16.0
    lease_b, lease_c = asyncio.run(api.get_lease("kt", "lock")), asyncio.run(api.get_lease("kt", "lock"))
    assert lease_b == lease_c
    assert _try(b)
    # c read the same record before b's write: its update carries a stale resourceVersion and gets 409
    stale = {**lease_c, "spec": {**lease_c["spec"], "holderIdentity": "c"}}
    with pytest.raises(ApiError) as e:
        asyncio.run(api.update_lease("kt", "lock", stale))
    assert e.value.status == 409
    assert not _try(c)  # and its next try sees b's fresh record: held, not expired
    assert api.obj["spec"]["holderIdentity"] == "b"


def test_release_empties_the_holder_so_a_standby_takes_over_at_once() -> None:
    api, clock = LeaseApi(), FakeClock(1000.0)
    a, b = _elector(api, clock, "a"), _elector(api, clock, "b")
    assert _try(a) and not _try(b)
    asyncio.run(a.release())
    assert not a.leading and api.obj["spec"]["holderIdentity"] == "" and api.obj["spec"]["leaseDurationSeconds"] == 1
    assert _try(b) and api.obj["spec"]["leaseTransitions"] == 1


def test_the_api_double_serves_leases_with_resource_version_conflicts() -> None:
    """kmockx stores a coordination.k8s.io/v1 Lease like kube-apiserver: created once (409 AlreadyExists after),
    updated only on the current resourceVersion (409 Conflict on a stale one), through the operator's own client."""
    from kmockx.harness import RELEASE_NS, Cluster
    from kubetitan.kube import Client, load_config

    async def scenario(client: Client) -> None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "lock", "namespace": RELEASE_NS},
                "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0}}
        first = await client.create_lease(RELEASE_NS, body)
        with pytest.raises(ApiError) as e:
            await client.create_lease(RELEASE_NS, body)
        assert e.value.status == 409 and e.value.api_reason == "AlreadyExists"
        second = await client.update_lease(RELEASE_NS, "lock", {**first, "spec": {**first["spec"], "holderIdentity": "b"}})
        assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
        with pytest.raises(ApiError) as e:  # c read ``first`` too: its update is refused
            await client.update_lease(RELEASE_NS, "lock", {**first, "spec": {**first["spec"], "holderIdentity": "c"}})
        assert e.value.status == 409 and e.value.api_reason == "Conflict"
        got = await client.get_lease(RELEASE_NS, "lock")
        assert got is not None and got["spec"]["holderIdentity"] == "b"
        await client.aclose()

    with Cluster() as c:
        asyncio.run(scenario(Client(load_config(c.kubeconfig))))  # the chart's RBAC: the operator's own identity
