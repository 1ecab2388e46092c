#!/usr/bin/env python3
"""Re-measure the product packages' structure (pure ast, nothing imported): import cycles counting the imports
inside functions, and functions over 60 lines. ``--write`` regenerates the module map in docs/architecture.md.

    python bench/code_structure.py            # the report
    python bench/code_structure.py --write    # and the module map

tests/test_structure.py fails on a new cycle or a new unexplained long function (allow-lists that may only shrink)."""

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
    ap.add_argument("--write", action="store_true", help="regenerate the module map in docs/architecture.md")
    args = ap.parse_args(argv)
    mods = codemap.modules()
    edges = codemap.imports(mods)
    print(f"{len(mods)} modules in {', '.join(codemap.PACKAGES)}; {len(edges)} imports between them "
          f"({sum(e.in_function for e in edges)} inside functions)")
    found = codemap.cycles(edges)
    print(f"\nimport cycles (strongly connected components, imports inside functions included): {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
        for e in codemap.cycle_edges(edges, c):
            print(f"      {e.source} -> {e.target}  line {e.line}{'  (in a function)' if e.in_function else ''}")
    top = codemap.cycles([e for e in edges if not e.in_function])
    print(f"  of which at module top level only: {len(top)}")
    long = codemap.long_functions()
    print(f"\nfunctions over {codemap.LONG_FUNCTION_LINES} lines: {len(long)} "
          f"({sum(f.explained for f in long)} with a `# long:` comment)")
    for f in long:
        print(f"  {f.lines:4d}  {f.name}{'  (explained)' if f.explained else ''}")
    if args.write:
        ARCHITECTURE.write_text(codemap.replace_map(ARCHITECTURE.read_text(), codemap.module_map()))
        print(f"\nwrote the module map to {ARCHITECTURE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
