"""API discovery of PodGroups (``kubetitan.discovery``) and the once-only deletion of ended attempts' PodGroups
(``Expectations.pod_groups_to_delete``), with a fake client and a fake clock."""

from __future__ import annotations

import asyncio

import aiohttp

from kubetitan.discovery import PodGroupApi
from kubetitan.kube import ApiError
from kubetitan.reconcile.expectations import Expectations


class FakeClient:
    def __init__(self, *answers) -> None:
        self.answers, self.asked = list(answers), 0

    async def api_resources(self, api_version: str):
        assert api_version == "scheduling.k8s.io/v1beta1"
        self.asked += 1
        a = self.answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a


def _run(api: PodGroupApi, client: FakeClient) -> bool:
    return asyncio.run(api.check(client))


def test_the_answer_is_kept_until_it_is_old_or_a_pod_group_is_refused() -> None:
    now = [0.0]
    api = PodGroupApi(recheck_seconds=300, clock=lambda: now[0])
    client = FakeClient(frozenset({"podgroups", "podgroups/status", "workloads"}), None, frozenset({"podgroups"}))
    assert _run(api, client) is True and client.asked == 1
    now[0] = 299.0
    assert _run(api, client) is True and client.asked == 1  # fresh: not asked again
    now[0] = 300.0
    assert _run(api, client) is False and client.asked == 2  # 404: the group version is gone
    api.forget()
    assert _run(api, client) is True and client.asked == 3  # after a refusal: asked at once


def test_a_failed_read_keeps_the_last_answer_and_is_tried_again() -> None:
    api = PodGroupApi(clock=lambda: 0.0)
    client = FakeClient(aiohttp.ClientConnectionError("refused"), frozenset({"podgroups"}),
                        ApiError(500, "GET", "/apis/scheduling.k8s.io/v1beta1"))
    assert _run(api, client) is False  # never read: not served
    assert _run(api, client) is True and client.asked == 2
    api.forget()
    assert _run(api, client) is True and client.asked == 3  # the 500 keeps the last answer


def test_a_group_version_without_podgroups_is_not_served() -> None:
    assert _run(PodGroupApi(), FakeClient(frozenset({"workloads", "priorityclasses"}))) is False


def test_each_ended_attempts_pod_group_is_deleted_once() -> None:
    exp = Expectations()
    assert exp.pod_groups_to_delete(["r-a0"]) == ["r-a0"]
    assert exp.pod_groups_to_delete(["r-a0"]) == ["r-a0"]  # the DELETE failed: asked again
    exp.pod_group_deleted("r-a0")
    assert exp.pod_groups_to_delete(["r-a0", "r-a1"]) == ["r-a1"]
    exp.pod_group_deleted("r-a1")
    assert exp.pod_groups_to_delete(["r-a1"]) == []
    assert exp.pod_groups_deleted == {"r-a1"}  # r-a0 no longer listed (its pods are gone): forgotten
    exp.forget()
    assert exp.pod_groups_to_delete(["r-a1"]) == ["r-a1"]  # a new term reads again (one DELETE more at most)
