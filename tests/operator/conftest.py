"""Fixtures for the operator-against-kmock tests: one kmock cluster per test, one rank-0 exporter."""

from __future__ import annotations

import pytest

from kmockx.harness import Cluster, Rank0Metrics


@pytest.fixture
def cluster():
    with Cluster() as c:
        yield c


@pytest.fixture
def rank0():
    m = Rank0Metrics()
    yield m
    m.close()
