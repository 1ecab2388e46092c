#!/usr/bin/env python3
"""Re-measure the product packages' structure (pure ast, nothing imported): modules per package and the long ones,
import cycles counting the imports inside functions, functions over 60 lines, and the layer table's violations.
``--write`` regenerates docs/architecture.md's generated parts: these structure facts, the layer table and the
module map.

    python bench/code_structure.py            # the report
    python bench/code_structure.py --write    # and docs/architecture.md

tests/test_structure.py fails on a new cycle, a new unexplained long function, an import that breaks the layer
table (tests/support/codemap.py LAYERS), or a docs/architecture.md that is not what --write makes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support import codemap  # noqa: E402

ARCHITECTURE = REPO / "docs" / "architecture.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="regenerate docs/architecture.md's generated parts")
    args = ap.parse_args(argv)
    print(codemap.report())
    if args.write:
        ARCHITECTURE.write_text(codemap.regenerate(ARCHITECTURE.read_text()))
        print(f"\nwrote the structure facts, the layer table and the module map to {ARCHITECTURE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
