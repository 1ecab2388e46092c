"""The create fan-out (``reconcile.apply.create_children``) against a recording stand-in client: the order of the
requests, slow-start batches of pods, a refusal stopping the round, an existing ConfigMap brought up to date
(no API double; milliseconds). What the API double shows end to end is in test_gang_safety.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from kubetitan.kube import ApiError
from kubetitan.reconcile.apply import create_children


class Recorder:
    """``create``/``patch`` as ``kube.Client`` has them: True when created, False when it exists (ours), an
    ``ApiError`` for the names in ``refuse``."""

    def __init__(self, existing: set[str] = frozenset(), refuse: set[str] = frozenset()) -> None:
        self.existing, self.refuse = set(existing), set(refuse)
        self.calls: list[tuple[str, str]] = []
        self.batches: list[list[str]] = []
        self._open: list[str] = []

    async def create(self, obj: dict) -> bool:
        name = obj["metadata"]["name"]
        self._open.append(name)
        await asyncio.sleep(0)  # every request of one gather is in flight before any answers
        if self._open:
            self.batches.append(self._open)
            self._open = []
        self.calls.append(("create", name))
        if name in self.refuse:
            raw = json.dumps({"kind": "Status", "reason": "Forbidden", "message": "exceeded quota"}).encode()
            raise ApiError(403, "POST", f"/api/v1/namespaces/ml/pods/{name}", raw)
        return name not in self.existing

    async def patch(self, resource: str, ns: str, name: str, body: dict) -> None:
        self.calls.append(("patch", name))


def _obj(kind: str, name: str) -> dict:
    return {"kind": kind, "metadata": {"name": name, "namespace": "ml", "annotations": {"a": "1"}}, "data": {}}


def _gang(pods: int) -> list[dict]:
    return [_obj("ConfigMap", "r-config"), _obj("Service", "r")] + [_obj("Pod", f"r-a0-{i}") for i in range(pods)]


def test_the_config_map_goes_first_then_the_service_then_the_pods_in_doubling_batches() -> None:
    client = Recorder()
    done = asyncio.run(create_children(client, _gang(10)))
    assert done.errors == () and done.unsent == 0
    assert done.created == ("r-config", "r", *(f"r-a0-{i}" for i in range(10)))
    assert [len(b) for b in client.batches] == [1, 1, 1, 2, 4, 3]  # ConfigMap, Service, pods 1, 2, 4, the rest


def test_an_existing_config_map_is_ours_and_brought_up_to_date() -> None:
    client = Recorder(existing={"r-config", "r"})
    done = asyncio.run(create_children(client, _gang(1)))
    assert ("patch", "r-config") in client.calls and ("patch", "r") not in client.calls
    assert done.created == ("r-config", "r", "r-a0-0") and done.errors == ()


def test_a_refused_pod_batch_stops_the_round_and_counts_what_was_not_sent() -> None:
    client = Recorder(refuse={"r-a0-4"})
    done = asyncio.run(create_children(client, _gang(16)))
    assert [(e.kind, e.name, e.reason) for e in done.errors] == [("Pod", "r-a0-4", "Forbidden")]
    assert done.created == ("r-config", "r", "r-a0-0", "r-a0-1", "r-a0-2", "r-a0-3", "r-a0-5", "r-a0-6")
    assert done.unsent == 16 - 7  # batches 1, 2, 4 were sent; the 4th batch never went


@pytest.mark.parametrize("refused", ["r-config", "r"], ids=["configmap", "service"])
def test_pods_wait_for_a_refused_config_map_or_service(refused: str) -> None:
    client = Recorder(refuse={refused})
    done = asyncio.run(create_children(client, _gang(4)))
    assert [e.name for e in done.errors] == [refused] and done.unsent == 0
    assert not any(name.startswith("r-a0-") for _, name in client.calls)
    assert done.created == tuple(n for n in ("r-config", "r") if n != refused)
