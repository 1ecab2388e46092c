"""Fixtures for the end-to-end tests: kmockx + the process-running kubelet (tests/e2e/kubelet.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from support.specs import CLAIM
from kubelet import Kubelet

from kmockx.harness import Cluster


@dataclass
class _Env:
    cluster: Cluster
    kubelet: Kubelet
    ckpt: Path


@pytest.fixture
def e2e(tmp_path: Path, request: pytest.FixtureRequest):
    """The double, its kubelet (2 nodes; ``@pytest.mark.e2e_nodes(n)`` for n, ``e2e_nodes(n, ledger=True)`` to turn the
    trainers' sample ledgers on) and the checkpoint claim's folder."""
    ckpt = tmp_path / "ckpt"
    marker = request.node.get_closest_marker("e2e_nodes")
    nodes = marker.args[0] if marker else 2
    ledger = bool(marker.kwargs.get("ledger")) if marker else False
    with Cluster() as c, Kubelet(c, tmp_path / "kubelet", nodes=nodes, claims={CLAIM: ckpt}, ledger=ledger) as k:
        yield _Env(c, k, ckpt)
        assert not k.errors, f"the e2e kubelet failed: {k.errors!r}"
