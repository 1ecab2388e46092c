"""YAML for the tests, through libyaml's C loader: the pure-Python loader (what ``yaml.safe_load`` uses) took about a
fifth of the CPU of tests/api, tests/chart and the docs checks (helm's rendered charts, the spec corpora), measured
with py-spy. Same documents, same Python objects; tests/api/test_yaml_vs_libyaml.py holds the product's own loader
(``kubetitan_core.strictyaml``) to libyaml's answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml


def load(stream: str | bytes) -> Any:
    """``yaml.safe_load``, in C."""
    return yaml.load(stream, Loader=yaml.CSafeLoader)  # noqa: S506 - the safe loader


def load_all(stream: str | bytes) -> Iterator[Any]:
    """``yaml.safe_load_all``, in C."""
    return yaml.load_all(stream, Loader=yaml.CSafeLoader)  # noqa: S506 - the safe loader
