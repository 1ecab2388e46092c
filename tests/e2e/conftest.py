"""Fixtures for the end-to-end tests: kmockx + the process-running kubelet (tests/e2e/kubelet.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from common import CLAIM
from kubelet import Kubelet

from kmockx.harness import Cluster


@dataclass
class Env:
    cluster: Cluster
    kubelet: Kubelet
    ckpt: Path


@pytest.fixture
def e2e(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    with Cluster() as c, Kubelet(c, tmp_path / "kubelet", claims={CLAIM: ckpt}) as k:
        yield Env(c, k, ckpt)
        assert not k.errors, f"the e2e kubelet failed: {k.errors!r}"
