"""kubetitan.compat, the operator's one shim over kopf's internals: the kopf internals it depends on are as declared
(a kopf upgrade that moves them fails here, naming them), and the objects kopf hands the operator's handlers have
lost ``metadata.managedFields`` and kept everything else."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import inspect
from typing import Any

import pytest

from kmockx.harness import NS, PODS, Cluster, Operator, cpu_spec, lpt, wait_for
from kubetitan import compat, handlers, plan

pytestmark = pytest.mark.xdist_group("operator-kmock")

MANAGED = [{"manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "v1",
            "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:team": {}}}, "f:spec": {".": {}}}}]


def _resolve(symbol: str) -> Any:
    module, _, qualname = symbol.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)  # the function kopf ships, under the shim's wrapper once installed


@pytest.mark.parametrize("up", compat.UPSTREAM, ids=lambda u: u.symbol)
def test_the_kopf_internals_the_shim_depends_on_are_as_declared(up: compat.Upstream) -> None:
    fix = f"kopf changed {up.symbol} ({up.why}): re-check kubetitan/compat.py's watch transform against it"
    obj = _resolve(up.symbol)
    if up.params is not None:
        assert tuple(inspect.signature(obj).parameters) == up.params, fix
    source = inspect.getsource(obj)
    for text in up.contains:
        assert text in source, f"{fix} (its source no longer contains {text!r})"


def test_the_installed_kopf_is_the_version_the_shim_was_checked_against() -> None:
    assert importlib.metadata.version("kopf") == compat.KOPF_VERSION, (
        "kopf is not the version kubetitan/compat.py was checked against: re-check the shim against the new kopf "
        "(tests/operator/test_compat.py), then update compat.KOPF_VERSION")


@pytest.mark.parametrize(("obj", "want"), [
    ({"metadata": {"name": "a", "uid": "u", "resourceVersion": "7", "generation": 2, "labels": {"l": "1"},
                   "annotations": {"a": "1"}, "ownerReferences": [{"uid": "o"}], "finalizers": ["f"],
                   "managedFields": MANAGED}, "spec": {"x": 1}, "status": {"phase": "Running"}},
     {"metadata": {"name": "a", "uid": "u", "resourceVersion": "7", "generation": 2, "labels": {"l": "1"},
                   "annotations": {"a": "1"}, "ownerReferences": [{"uid": "o"}], "finalizers": ["f"]},
      "spec": {"x": 1}, "status": {"phase": "Running"}}),
    ({"metadata": {"name": "a"}}, {"metadata": {"name": "a"}}),  # nothing to drop
    ({"metadata": {"resourceVersion": "9"}}, {"metadata": {"resourceVersion": "9"}}),  # a BOOKMARK's object
    ({"code": 410, "status": "Failure"}, {"code": 410, "status": "Failure"}),  # an ERROR's Status: no metadata
    ({"metadata": None}, {"metadata": None}),
    (None, None),
], ids=["an-object", "no-managed-fields", "bookmark", "error-status", "null-metadata", "no-object"])
def test_trim_drops_managed_fields_and_nothing_else(obj: Any, want: Any) -> None:
    assert compat.trim(copy.deepcopy(obj)) == want


def test_handlers_get_the_watched_objects_without_managed_fields(cluster: Cluster, monkeypatch) -> None:
    """A run and a pod stored with ``managedFields`` (as a real API server stores every object): the run's daemon
    (the body kopf keeps for it) and the pod index see them without, and with the rest of their metadata."""
    runs: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    real_cycle, real_pod_obs = handlers.cycle, handlers.pod_obs

    async def cycle(ctx: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        runs.append(copy.deepcopy(dict(body["metadata"])))
        return await real_cycle(ctx, body, *args, **kwargs)

    def pod_obs(body: Any) -> Any:
        pods.append(copy.deepcopy(dict(body["metadata"])))
        return real_pod_obs(body)

    monkeypatch.setattr(handlers, "cycle", cycle)
    monkeypatch.setattr(handlers, "pod_obs", pod_obs)
    run = lpt("mf", cpu_spec(nodes=1))
    run["metadata"].update(labels={"team": "a"}, annotations={"example.com/note": "n"}, managedFields=MANAGED)
    stored_run = cluster.apply(run)
    stored_pod = cluster.call(cluster.k.put(PODS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "stray", "namespace": NS, "labels": {plan.LABEL_UID: "not-a-run"},
                     "managedFields": MANAGED},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))
    assert stored_run["metadata"]["managedFields"] == stored_pod["metadata"]["managedFields"] == MANAGED
    with Operator(cluster):
        wait_for(lambda: runs and any(p["name"] == "stray" for p in pods), 15, "the run's cycle and the pod indexed")
    pod = next(p for p in pods if p["name"] == "stray")
    for seen, stored in ((runs[0], stored_run), (pod, stored_pod)):
        assert "managedFields" not in seen
        assert seen["resourceVersion"]  # the operator's own writes (its finalizer) may have moved it on
        for key in ("uid", "labels", "annotations", "generation", "creationTimestamp"):
            assert seen.get(key) == stored["metadata"].get(key), key
