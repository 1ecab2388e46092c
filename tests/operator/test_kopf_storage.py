"""kopf's bookkeeping stays off the run's annotations: a run whose own annotations nearly fill the API server's
256 KiB limit is reconciled and deleted (its finalizer removed), against kmockx, which enforces that limit in
bytes as kube-apiserver's ValidateAnnotationsSize does."""

from __future__ import annotations

import pytest

from kmockx.harness import LPT, NS, ApiError, Cluster, Operator, cpu_spec, lpt, wait_for
from kubetitan.handlers import FINALIZER

pytestmark = pytest.mark.xdist_group("operator-kmock")
LIMIT = 256 * 1024
KEY = "example.com/blob"


def _with_annotation(name: str, value: str) -> dict:
    obj = lpt(name, cpu_spec(nodes=1))
    obj["metadata"]["annotations"] = {KEY: value}
    return obj


@pytest.mark.parametrize(("value", "refused"), [
    ("x" * (LIMIT - len(KEY)), False),
    ("x" * (LIMIT - len(KEY) + 1), True),
    ("é" * ((LIMIT - len(KEY)) // 2 + 1), True),  # 2 bytes each: over the limit in bytes, not in characters
], ids=["at-the-limit", "one-byte-over", "multibyte-over"])
def test_the_double_limits_annotations_in_bytes(cluster: Cluster, value: str, refused: bool) -> None:
    if not refused:
        cluster.apply(_with_annotation("fits", value))
        return
    with pytest.raises(ApiError) as e:
        cluster.apply(_with_annotation("over", value))
    assert e.value.code == 422 and f"may not be more than {LIMIT} bytes" in e.value.status["message"]


def test_a_run_with_255_kib_of_annotations_reconciles_and_deletes(cluster: Cluster) -> None:
    cluster.apply(_with_annotation("big", "x" * (255 * 1024)))
    with Operator(cluster):
        wait_for(lambda: cluster.pod_names(NS, "big") == ["big-a0-0"], 15, "the run's pod")
        wait_for(lambda: cluster.status(NS, "big").get("phase") == "Starting", 15, "the run's status")
        obj = cluster.lpt(NS, "big")
        assert obj is not None and obj["metadata"]["finalizers"] == [FINALIZER]
        assert list(obj["metadata"]["annotations"]) == [KEY], "kopf wrote no annotation of its own"
        cluster.delete(LPT, NS, "big")
        wait_for(lambda: cluster.lpt(NS, "big") is None, 15, "the run deleted (its finalizer removed)")
    refused = [str(e) for e in cluster.k.log if e.code == 422]
    assert not refused, refused


def test_no_handler_reads_kopfs_essence_so_none_is_built() -> None:
    """``handlers.NoEssence`` builds an empty essence instead of two deep copies of every watched object per watch
    event: valid only while the operator registers no change handler (the essence's only reader) and no idle timer
    or daemon (whose idle countdown the diff resets). A new one must take NoEssence out."""
    import kopf

    from kubetitan import handlers

    registry = kopf.get_default_registry()
    assert not registry._changing.get_all_handlers(), "a change handler needs kopf's real essence: drop NoEssence"
    for h in [*registry._spawning.get_all_handlers()]:
        assert not getattr(h, "idle", None), f"{h.id} counts idle time from kopf's diff: drop NoEssence"
    assert handlers.NoEssence(name="kopf").build(body={"spec": {"a": 1}}) == {}
