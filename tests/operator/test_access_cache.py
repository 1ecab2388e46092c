"""kubetitan.access_cache and the webhook's SubjectAccessReview plumbing, with a fake clock and a fake API client
(no sleeps): what is cached for how long, what never is, the bound, the key, and that the reviews of one request
go out together. tests/operator/test_webhook.py checks the same against the API double (a revoked grant honoured
until its TTL ends, then refused; userInfo's uid and extra in every review)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from kubetitan import webhook
from kubetitan.access_cache import AccessCache, CacheConfig, key
from kubetitan.admission import Access
from support.fakes import FakeClock

SECRET = Access("get", "", "secrets", "ml", "wandb")
PVC = Access("get", "", "persistentvolumeclaims", "ml", "ckpt")
ALICE = {"username": "alice", "groups": ["system:authenticated", "team-a"], "uid": "u-1",
         "extra": {"scopes": ["training"]}}


class FakeApi:
    """Answers SubjectAccessReviews from ``grants`` (set of (username, resource, name)); records each review sent;
    ``fail`` raises instead; ``gate``, when set, holds every review until it is released."""

    def __init__(self) -> None:
        self.grants: set[tuple[str, str, str]] = set()
        self.sent: list[dict[str, Any]] = []
        self.fail: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0
        self.fenced: list[bool] = []

    async def _call(self, group: str, resource: str, verb: str, method: str, path: str, body: Any = None,
                    fenced: bool = True, **_: Any) -> dict[str, Any]:
        assert (group, resource, verb, method, path) == (
            "authorization.k8s.io", "subjectaccessreviews", "create", "POST", webhook.SAR_PATH)
        self.sent.append(body["spec"])
        self.fenced.append(fenced)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail is not None:
                raise self.fail
            attrs = body["spec"]["resourceAttributes"]
            ok = (body["spec"]["user"], attrs["resource"], attrs.get("name")) in self.grants
            return {"status": {"allowed": ok, **({} if ok else {"reason": "no RBAC policy matched"})}}
        finally:
            self.in_flight -= 1


@dataclasses.dataclass
class Ctx:
    client: FakeApi
    access_cache: Any = None


def _setup(**config: Any) -> tuple[Ctx, webhook.WebhookOptions, FakeClock]:
    clock = FakeClock(1000.0)
    opts = webhook.WebhookOptions(access_cache=CacheConfig(**config), clock=clock)
    return Ctx(FakeApi()), opts, clock


def _ask(ctx: Ctx, opts: webhook.WebhookOptions, *checks: Access, user: dict[str, Any] = ALICE) -> dict[Access, Any]:
    return asyncio.run(webhook.answers_for(ctx, opts, list(checks), user))


def test_an_allowed_answer_is_reused_until_its_ttl_and_a_revoked_grant_is_refused_after_it() -> None:
    ctx, opts, clock = _setup(allowed_seconds=30, denied_seconds=5)
    ctx.client.grants.add(("alice", "secrets", "wandb"))
    assert _ask(ctx, opts, SECRET) == {SECRET: True}
    ctx.client.grants.clear()  # the admin revokes it
    clock.now += 29.9
    assert _ask(ctx, opts, SECRET) == {SECRET: True}  # the documented staleness: still honoured from the cache
    assert len(ctx.client.sent) == 1
    clock.now += 0.1
    assert _ask(ctx, opts, SECRET) == {SECRET: "no RBAC policy matched"}  # the TTL is over: asked again, refused
    assert len(ctx.client.sent) == 2


def test_a_denied_answer_is_reused_for_the_shorter_denied_ttl() -> None:
    ctx, opts, clock = _setup(allowed_seconds=30, denied_seconds=5)
    assert _ask(ctx, opts, SECRET) == {SECRET: "no RBAC policy matched"}
    ctx.client.grants.add(("alice", "secrets", "wandb"))  # granted now
    clock.now += 4.9
    assert _ask(ctx, opts, SECRET)[SECRET] != True  # noqa: E712 - still the cached refusal
    clock.now += 0.1
    assert _ask(ctx, opts, SECRET) == {SECRET: True}
    assert len(ctx.client.sent) == 2


@pytest.mark.parametrize("config", [dict(allowed_seconds=0, denied_seconds=0), dict(max_entries=0)],
                         ids=["ttls-0", "size-0"])
def test_a_cache_turned_off_asks_every_time(config: dict[str, Any]) -> None:
    ctx, opts, _ = _setup(**config)
    ctx.client.grants.add(("alice", "secrets", "wandb"))
    for _ in range(3):
        assert _ask(ctx, opts, SECRET) == {SECRET: True}
    assert len(ctx.client.sent) == 3


def test_a_failed_review_refuses_and_is_never_cached() -> None:
    ctx, opts, _ = _setup()
    ctx.client.fail = RuntimeError("connection reset")
    (answer,) = _ask(ctx, opts, SECRET).values()
    assert answer == "the SubjectAccessReview failed: connection reset"
    ctx.client.fail = None
    ctx.client.grants.add(("alice", "secrets", "wandb"))
    assert _ask(ctx, opts, SECRET) == {SECRET: True}  # asked again at once
    assert len(ctx.client.sent) == 2


def test_the_cache_is_bounded_and_drops_the_least_recently_used_first() -> None:
    clock = FakeClock(1000.0)
    cache = AccessCache(CacheConfig(max_entries=3), clock)
    keys = [key(Access("get", "", "secrets", "ml", f"s{i}"), ALICE) for i in range(4)]
    for k in keys[:3]:
        cache.store(k, True)
    assert cache.lookup(keys[0]) is True  # used: s1 is now the least recently used
    cache.store(keys[3], True)
    assert len(cache) == 3
    assert cache.lookup(keys[1]) is None and all(cache.lookup(k) is True for k in (keys[0], keys[2], keys[3]))
    clock.now += CacheConfig().allowed_seconds
    assert all(cache.lookup(k) is None for k in keys) and len(cache) == 0  # expired entries are dropped


USER_CHANGES = {
    "username": {"username": "bob"}, "groups": {"groups": ["system:authenticated"]}, "uid": {"uid": "u-2"},
    "extra": {"extra": {"scopes": ["admin"]}}, "no-extra": {"extra": {}},
}
ACCESS_CHANGES = {"verb": {"verb": "list"}, "group": {"group": "x.io"}, "resource": {"resource": "configmaps"},
                  "namespace": {"namespace": "other"}, "name": {"name": "other"}}


@pytest.mark.parametrize("change", list(USER_CHANGES.values()) + list(ACCESS_CHANGES.values()),
                         ids=[f"user-{k}" for k in USER_CHANGES] + [f"access-{k}" for k in ACCESS_CHANGES])
def test_the_key_holds_everything_the_answer_depends_on(change: dict[str, Any]) -> None:
    base = key(SECRET, ALICE)
    if set(change) <= set(ACCESS_CHANGES):
        assert key(dataclasses.replace(SECRET, **change), ALICE) != base
    else:
        assert key(SECRET, {**ALICE, **change}) != base
    # the order of groups and of extra keys does not matter (the API server's authorizer ignores it too)
    assert key(SECRET, {**ALICE, "groups": list(reversed(ALICE["groups"]))}) == base


def test_the_reviews_of_one_request_go_out_together_and_identical_ones_once() -> None:
    ctx, opts, _ = _setup()
    ctx.client.grants |= {("alice", "secrets", "wandb"), ("alice", "persistentvolumeclaims", "ckpt")}

    async def scenario() -> list[dict[Access, Any]]:
        ctx.client.gate = asyncio.Event()
        first = asyncio.create_task(webhook.answers_for(ctx, opts, [SECRET, PVC], ALICE))
        second = asyncio.create_task(webhook.answers_for(ctx, opts, [SECRET, PVC], ALICE))  # the same, meanwhile
        while ctx.client.in_flight < 2:
            await asyncio.sleep(0)
        ctx.client.gate.set()
        return [await first, await second]

    assert asyncio.run(scenario()) == [{SECRET: True, PVC: True}] * 2
    assert ctx.client.most_in_flight == 2  # both of the first request's reviews were in flight at once
    assert len(ctx.client.sent) == 2  # the second request waited for them instead of asking again
    assert ctx.client.fenced == [False, False]  # a standby replica answers admission requests too


def test_a_waiter_asks_again_when_the_first_asker_is_cancelled() -> None:
    """The first request for a key is cancelled (its client timed out) while a second waits on its review: the second
    sends its own review and gets its answer, not the first one's CancelledError."""
    ctx, opts, _ = _setup()
    ctx.client.grants.add(("alice", "secrets", "wandb"))

    async def scenario() -> dict[Access, Any]:
        ctx.client.gate = asyncio.Event()
        first = asyncio.create_task(webhook.answers_for(ctx, opts, [SECRET], ALICE))
        while ctx.client.in_flight < 1:
            await asyncio.sleep(0)
        second = asyncio.create_task(webhook.answers_for(ctx, opts, [SECRET], ALICE))
        while ctx.access_cache.hits < 1:  # the second waits on the first's review
            await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        ctx.client.gate.set()
        return await second

    assert asyncio.run(scenario()) == {SECRET: True}
    assert len(ctx.client.sent) == 2  # the first's review (cancelled) and the second's own


def test_each_review_carries_the_requests_uid_and_extra() -> None:
    ctx, opts, _ = _setup()
    _ask(ctx, opts, SECRET)
    (spec,) = ctx.client.sent
    assert (spec["user"], spec["groups"], spec["uid"], spec["extra"]) == (
        "alice", ["system:authenticated", "team-a"], "u-1", {"scopes": ["training"]})
    assert spec["resourceAttributes"] == {"verb": "get", "group": "", "resource": "secrets", "namespace": "ml",
                                          "name": "wandb"}
