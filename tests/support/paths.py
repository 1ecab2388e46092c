"""Where things are in the repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
"""The ready-to-apply example resources, in name order."""


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())
