"""Shared fixtures and builders for the kubetitan test suite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def make_lpt(spec: dict[str, Any] | None = None, name: str = "run", namespace: str = "ml",
             uid: str | None = None) -> dict[str, Any]:
    """A raw LlamaPretrain object (as a user would write it) with the given spec."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {
        "apiVersion": "kubetitan.io/v1alpha1",
        "kind": "LlamaPretrain",
        "metadata": meta,
        "spec": copy.deepcopy(spec or {}),
    }


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def repo() -> Path:
    return REPO
