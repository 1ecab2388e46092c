"""The API-server double each test module of this folder talks to: one per module."""

from __future__ import annotations

import pytest

from kmockx.harness import Cluster


@pytest.fixture(scope="module")
def c():
    with Cluster() as cluster:
        yield cluster
