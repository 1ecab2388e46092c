"""Compat shim for the suite's ``--dist loadgroup`` (pytest 9.2 with pytest-xdist 3.8); tests/conftest.py applies it."""

from __future__ import annotations

import pytest
from _pytest.nodeid import NodeId


def in_node_ids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Compat shim (pytest 9.2 with pytest-xdist 3.8): ``--dist loadgroup`` keeps an ``xdist_group`` on one worker by
    reading ``@<group>`` at the end of each node id, which xdist appends to ``item._nodeid``; pytest 9.2 derives
    ``item.nodeid`` from ``item._id`` instead, so the suffix was lost and every group was spread over all workers
    (three real control planes instead of one, e2e gangs side by side). Appends it where xdist's did not take;
    does nothing once ``nodeid`` carries it. Canary: tests/test_layout.py::test_an_xdist_group_runs_on_one_worker."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]
