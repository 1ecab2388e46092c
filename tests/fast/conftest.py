"""The fast components live in ``bench/fast_components.py`` (bench code, not part of the trainer package)."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
