"""Where things are in the repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from support import yamlio


REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
"""The ready-to-apply example resources, in name order."""


def load_example(path: Path) -> dict[str, Any]:
    return yamlio.load(path.read_text())
