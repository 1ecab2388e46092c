"""kubetitan.webhook_guard without a server: the callers' budget of SubjectAccessReviews on a fake clock, its memory
bound, the review size limit and the names of a client certificate. End to end (the operator's webhook, kmockx as
the API server, reviews posted straight to the port): tests/operator/test_webhook.py."""

from __future__ import annotations

from kubetitan import admission
from support.fakes import FakeClock
from kubetitan.webhook_guard import (API_SERVER_MAX_BODY_BYTES, MAX_REVIEW_BYTES, RateConfig, RateLimiter,
                                     cert_names)


def test_a_caller_over_its_budget_is_refused_until_its_bucket_refills() -> None:
    clock = FakeClock(100.0)
    rl = RateLimiter(RateConfig(user_per_second=10, user_burst=100, source_per_second=50, source_burst=500), clock)
    assert rl.charge("10.0.0.9", "eve", 64) is None
    refusal = rl.charge("10.0.0.9", "eve", 64)  # 36 left of her 100
    assert refusal is not None and refusal.who == "user 'eve' from 10.0.0.9"
    assert refusal.retry_after == (64 - 36) / 10
    assert str(refusal) == ("user 'eve' from 10.0.0.9 may have 10 SubjectAccessReviews a second asked for it "
                            "(bursts of 100); retry in 2.8 s")
    assert rl.charge("10.0.0.9", "bob", 64) is None  # another user of the same source: her own bucket
    clock.now += 3
    assert rl.charge("10.0.0.9", "eve", 64) is None  # refilled
    # the source's bucket: full again after 3 s (500), less eve's 64; a refused charge takes nothing
    for user in ("u1", "u2", "u3", "u4", "u5", "u6"):
        assert rl.charge("10.0.0.9", user, 64) is None
    assert rl.charge("10.0.0.9", "u7", 64).who == "source 10.0.0.9"
    assert rl.charge("10.0.0.9", "u7", 52) is None  # exactly what is left
    assert rl.charge("10.0.0.7", "u7", 64) is None  # another source
    assert rl.charge("10.0.0.9", "eve", 0) is None  # nothing asked: nothing charged, never refused


def test_the_buckets_are_bounded() -> None:
    clock = FakeClock(100.0)
    rl = RateLimiter(RateConfig(max_callers=50), clock)
    for i in range(10_000):
        rl.charge(f"10.0.0.{i % 40}", f"user-{i}", 1)
    assert len(rl.users) == 50 and len(rl.sources) == 40  # 40 sources, the 50 newest (source, user) pairs


def test_a_burst_below_one_reviews_cap_is_a_configuration_error() -> None:
    assert RateConfig().problems(admission.MAX_ACCESS_CHECKS) == []
    assert RateConfig(user_burst=10, source_per_second=0).problems(64) == [
        "--webhook-rate-user-burst must be at least 64, the access checks one review may need (got 10)",
        "--webhook-rate-source-per-second must be > 0 (got 0)"]


def test_an_update_of_the_largest_object_the_api_server_admits_is_read() -> None:
    assert API_SERVER_MAX_BODY_BYTES == 3 * 1024 * 1024
    assert MAX_REVIEW_BYTES > 2 * API_SERVER_MAX_BODY_BYTES


def test_the_names_of_a_client_certificate() -> None:
    peer = {"subject": ((("organizationName", "system:masters"),), (("commonName", "kube-apiserver"),)),
            "subjectAltName": (("DNS", "apiserver.internal"), ("IP Address", "10.0.0.1"))}
    assert cert_names(peer) == ("kube-apiserver", "apiserver.internal")
    assert cert_names(None) == ()
