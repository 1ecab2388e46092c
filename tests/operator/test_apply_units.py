"""The create fan-out (``reconcile.apply.create_children``) against a recording stand-in client: the order of the
requests, slow-start batches of pods, a refusal stopping the round, an existing ConfigMap brought up to date; and
``create_attempt`` rendering and sending only the children not known to exist (no API double; milliseconds). What
the API double shows end to end is in test_gang_safety.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

from kubetitan import plan
from kubetitan.observation import PodObs
from kubetitan.discovery import PodGroupApi
from kubetitan.kube import ApiError
from kubetitan.reconcile.apply import create_attempt, create_children
from kubetitan.reconcile.memory import RunMemory
from kubetitan.observation.read import read_run
from support.specs import cpu_spec, lpt


class Recorder:
    """``create``/``patch`` as ``kube.Client`` has them: True when created, False when it exists (ours), an
    ``ApiError`` for the names in ``refuse``."""

    def __init__(self, existing: set[str] = frozenset(), refuse: set[str] = frozenset()) -> None:
        self.existing, self.refuse = set(existing), set(refuse)
        self.calls: list[tuple[str, str]] = []
        self.objects: dict[str, dict] = {}
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
        self.objects[name] = obj
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


# ------------------------------------------------------------------ create_attempt: what is rendered and sent
NODES = 8
CHILDREN = ("r-config", "r", *(f"r-a0-{i}" for i in range(NODES)))
ATTEMPT_ROUNDS = [
    # (id, pods the index shows, names created moments ago (in flight), ConfigMap/Service shown, the names sent)
    ("nothing-yet", (), (), (), CHILDREN),
    ("index-lags-behind-the-whole-gang", (), CHILDREN, (), ()),
    ("index-shows-part-the-rest-in-flight", (0, 1, 2), CHILDREN[:2] + CHILDREN[5:], ("r-config", "r"), ()),
    ("three-pods-lost", (0, 1, 2, 3, 4), ("r-config",), ("r-config", "r"), ("r-a0-5", "r-a0-6", "r-a0-7")),
    ("a-pod-of-the-live-gang-missing", (0, 1, 2, 3, 4, 5, 7), ("r-config",), ("r-config", "r"), ("r-a0-6",)),
    ("the-configmap-is-written-once-per-attempt", tuple(range(NODES)), (), ("r-config", "r"), ("r-config",)),
]


@pytest.mark.parametrize(("shown", "in_flight", "children_shown", "want"), [r[1:] for r in ATTEMPT_ROUNDS],
                         ids=[r[0] for r in ATTEMPT_ROUNDS])
def test_create_attempt_renders_and_sends_only_the_children_not_known_to_exist(
        monkeypatch: pytest.MonkeyPatch, shown: tuple[int, ...], in_flight: tuple[str, ...],
        children_shown: tuple[str, ...], want: tuple[str, ...]) -> None:
    """A cycle woken while the pod index lags behind the gang it just created renders no pod at all; otherwise the
    pods sent are rendered from at most two renders of ranks being sent (rank 0, and the gang's template), and each is
    the full render's pod of that rank."""
    memory = RunMemory()
    memory.expected.creating(0)
    memory.expected.expect_created(in_flight, memory.expected.now())
    snap = read_run(memory, lpt("r", cpu_spec(nodes=NODES), uid="u-1"), 1000.0, None)
    snap = dataclasses.replace(snap, pods=tuple(PodObs(name=f"r-a0-{r}", attempt=0, rank=r, phase="Running")
                                                  for r in shown), children_shown=frozenset(children_shown))
    rendered: list[int] = []
    real_pod = plan.pod
    monkeypatch.setattr(plan, "pod", lambda lpt_, attempt, rank, *a, **kw: rendered.append(rank) or real_pod(
        lpt_, attempt, rank, *a, **kw))
    client = Recorder()
    ctx = SimpleNamespace(client=client, options=SimpleNamespace(hang_floor_seconds=120.0, pod_groups="auto"),
                          pod_group_api=PodGroupApi(served=False, checked_at=float("inf")))
    status = snap.status.model_copy(update={"attempt": 0})
    done = asyncio.run(create_attempt(ctx, snap, memory, status, ()))  # type: ignore[arg-type]
    sent = tuple(name for verb, name in client.calls if verb == "create")
    assert sent == want and done.errors == ()
    sent_pods = [n for n in want if n.startswith("r-a0-")]
    assert {plan.pod_name("r", 0, r) for r in rendered} <= set(sent_pods) and len(rendered) <= 2
    assert bool(rendered) == bool(sent_pods)
    full = {c["metadata"]["name"]: c for c in plan.attempt_children(snap.lpt, 0, hang_floor_seconds=120.0)}
    assert all(client.objects[n] == full[n] for n in sent if n.startswith("r-a0-"))
    assert all(memory.expected.in_flight(n, memory.expected.now()) for n in want)


# ------------------------------------------------------------------ create_attempt: the attempt's PodGroup
class Served(Recorder):
    """``Recorder`` on a server whose discovery answers ``resources`` for scheduling.k8s.io/v1beta1."""

    def __init__(self, resources: frozenset[str] | None, **kw) -> None:
        super().__init__(**kw)
        self.resources, self.discovered = resources, 0

    async def api_resources(self, api_version: str) -> frozenset[str] | None:
        self.discovered += 1
        return self.resources


GROUP = frozenset({"podgroups", "podgroups/status"})
PG_ROUNDS = [
    # (id, discovery's answer, the spec's scheduling, pods the index shows (their PodGroup), the creates sent, asked)
    ("served-new-attempt", GROUP, {}, (), ("r-config", "r", "r-a0", "r-a0-0", "r-a0-1", "r-a0-2"), 1),
    ("not-served", None, {}, (), ("r-config", "r", "r-a0-0", "r-a0-1", "r-a0-2"), 1),
    ("opted-out-not-even-asked", GROUP, {"podGroup": "Disabled"}, (), ("r-config", "r", "r-a0-0", "r-a0-1",
                                                                        "r-a0-2"), 0),
    ("kueue-not-even-asked", GROUP, {"queueName": "q"}, (), ("r-config", "r", "r-a0-0", "r-a0-1", "r-a0-2"), 0),
    ("a-rank-of-a-grouped-gang-joins-it", GROUP, {}, ((0, "r-a0"), (2, "r-a0")), ("r-config", "r-a0", "r-a0-1"), 0),
    ("a-rank-of-an-ungrouped-gang-stays-out", GROUP, {}, ((0, None), (2, None)), ("r-config", "r-a0-1"), 0),
]


@pytest.mark.parametrize(("resources", "scheduling", "shown", "want", "asked"), [r[1:] for r in PG_ROUNDS],
                         ids=[r[0] for r in PG_ROUNDS])
def test_create_attempt_sends_the_pod_group_before_the_pods_and_a_live_gang_keeps_its_own(
        resources, scheduling, shown, want, asked) -> None:
    """A new attempt asks discovery (only when its spec allows a PodGroup) and sends the PodGroup before the pods; a
    rank created again in a live attempt follows the pods already there (the PodGroup they name is sent again with
    it), whatever the server says now: a pod naming a PodGroup that does not exist is never scheduled."""
    memory = RunMemory()
    snap = read_run(memory, lpt("r", {**cpu_spec(nodes=3), "scheduling": scheduling}, uid="u-1"), 1000.0, None)
    snap = dataclasses.replace(snap, pods=tuple(PodObs(name=f"r-a0-{r}", attempt=0, rank=r, phase="Running",
                                                       pod_group=g) for r, g in shown),
                               children_shown=frozenset({"r"}) if shown else frozenset())
    client = Served(resources)
    ctx = SimpleNamespace(client=client, options=SimpleNamespace(hang_floor_seconds=120.0, pod_groups="auto"),
                          pod_group_api=PodGroupApi())
    status = snap.status.model_copy(update={"attempt": 0})
    done = asyncio.run(create_attempt(ctx, snap, memory, status, ()))  # type: ignore[arg-type]
    assert tuple(name for verb, name in client.calls if verb == "create") == want and done.errors == ()
    assert client.discovered == asked
    grouped = "r-a0" in want
    for name in (n for n in want if n.startswith("r-a0-")):
        assert ("schedulingGroup" in client.objects[name]["spec"]) is grouped


def test_a_refused_pod_group_holds_the_pods_back_and_discovery_is_asked_again() -> None:
    memory = RunMemory()
    snap = read_run(memory, lpt("r", cpu_spec(nodes=2), uid="u-1"), 1000.0, None)
    client = Served(GROUP, refuse={"r-a0"})
    api = PodGroupApi()
    ctx = SimpleNamespace(client=client, options=SimpleNamespace(hang_floor_seconds=120.0, pod_groups="auto"), pod_group_api=api)
    done = asyncio.run(create_attempt(ctx, snap, memory, snap.status.model_copy(update={"attempt": 0}), ()))
    assert [(e.kind, e.name) for e in done.errors] == [("PodGroup", "r-a0")] and done.not_created == 2
    assert not any(n.startswith("r-a0-") for _, n in client.calls)
    assert api.served is True and api.checked_at == float("-inf")  # read again before the next round


def test_the_admins_switch_off_sends_no_pod_group_and_asks_nothing() -> None:
    memory = RunMemory()
    snap = read_run(memory, lpt("r", cpu_spec(nodes=2), uid="u-1"), 1000.0, None)
    client = Served(GROUP)
    ctx = SimpleNamespace(client=client, options=SimpleNamespace(hang_floor_seconds=120.0, pod_groups="disabled"),
                          pod_group_api=PodGroupApi())
    asyncio.run(create_attempt(ctx, snap, memory, snap.status.model_copy(update={"attempt": 0}), ()))
    assert [n for _, n in client.calls] == ["r-config", "r", "r-a0-0", "r-a0-1"] and client.discovered == 0


# ------------------------------------------------------------------ a large spec
ANNOTATIONS_LIMIT = 256 * 1024
"""The API server's limit on all annotations of an object together (bytes, ValidateAnnotationsSize)."""
CONFIG_MAP_LIMIT = 1024 * 1024
"""The API server's limit on a ConfigMap's data and binaryData together (bytes, ValidateConfigMap)."""


def test_a_363_kb_spec_fits_its_config_map_and_its_attempt_spec_is_read_back() -> None:
    """A valid spec of ~363 KB (360 env variables of 1 KB): the spec the attempt is created from goes into the
    ConfigMap's data (1 MiB), not into an annotation (256 KiB for all of them: such a ConfigMap was refused on
    every round), the pods mount only trainer.toml of it, and a new cycle reads the spec back from the
    ConfigMap; an older operator's annotation is still read, and dropped at the next write."""
    from kubetitan.observation.read import applied_spec_of

    spec = cpu_spec(nodes=2)
    spec["resources"]["env"] = [{"name": f"BIG_{i}", "value": "x" * 1000} for i in range(360)]
    memory = RunMemory()
    snap = read_run(memory, lpt("r", spec, uid="u-1"), 1000.0, None)
    assert len(json.dumps(snap.desired)) > 360_000
    client = Recorder(existing={"r-config"})  # an older attempt's ConfigMap: brought up to date (a patch)
    ctx = SimpleNamespace(client=client, options=SimpleNamespace(hang_floor_seconds=120.0, pod_groups="auto"),
                          pod_group_api=PodGroupApi(served=False, checked_at=float("inf")))
    done = asyncio.run(create_attempt(ctx, snap, memory, snap.status.model_copy(update={"attempt": 0}), ()))
    assert done.errors == () and done.created_pods == 2
    for name, obj in client.objects.items():
        annotations = (obj["metadata"].get("annotations") or {}).items()
        assert sum(len(k.encode()) + len(v.encode()) for k, v in annotations) <= ANNOTATIONS_LIMIT, name
    cm = client.objects["r-config"]
    assert sum(len(v.encode()) for v in cm["data"].values()) <= CONFIG_MAP_LIMIT
    assert applied_spec_of(cm) == snap.desired and memory.applied_spec == snap.desired
    (config,) = [v for v in client.objects["r-a0-0"]["spec"]["volumes"] if v["name"] == "config"]
    assert config["configMap"]["items"] == [{"key": "trainer.toml", "path": "trainer.toml"}]
    assert ("patch", "r-config") in client.calls
    legacy = {"metadata": {"annotations": {"kubetitan.io/applied-spec": json.dumps({"training": {"steps": 5}})}}}
    assert applied_spec_of(legacy) == {"training": {"steps": 5}}
