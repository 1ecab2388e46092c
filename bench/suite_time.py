"""Where the suite's time goes, from a pytest ``--durations=0`` output: the summed setup + call + teardown time of
each xdist group (``@pytest.mark.xdist_group``, read from the test files with ``ast``; tests without one are
"ungrouped") and of each test file. With ``-n 2 --dist loadgroup`` a group runs on one worker, so the largest group
bounds the wall time, and the sum over two workers bounds it from below: sum / 2.

    python bench/suite_time.py PYTEST_OUTPUT.txt [--files 25]

Summed test time is less sensitive to other load on the machine than wall time, but not immune (CPU-bound tests
slow down, waits do not).
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


def _group_of(decorators: list[ast.expr]) -> str | None:
    for d in decorators:
        for node in ast.walk(d):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "xdist_group"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                return str(node.args[0].value)
    return None


def groups(path: Path) -> tuple[str | None, dict[str, str]]:
    """(the module's group, {test function: its own group}) of one test file."""
    tree = ast.parse(path.read_text())
    module = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module = _group_of([node.value])
    own = {n.name: g for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and (g := _group_of(n.decorator_list)) is not None}
    return module, own


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("durations", type=Path, help="a pytest output with --durations=0")
    ap.add_argument("--files", type=int, default=25, help="how many of the slowest files to list")
    a = ap.parse_args()
    by_group: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    cache: dict[str, tuple[str | None, dict[str, str]]] = {}
    for line in a.durations.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if not m:
            continue
        seconds, nodeid = float(m.group(1)), m.group(3)
        file, _, rest = nodeid.partition("::")
        func = rest.split("::")[-1].split("[")[0]
        if file not in cache:
            cache[file] = groups(REPO / file) if (REPO / file).exists() else (None, {})
        module, own = cache[file]
        by_group[own.get(func) or module or "ungrouped"] += seconds
        by_file[file] += seconds
    total = sum(by_group.values())
    if not total:
        print("no durations found (run pytest with --durations=0)", file=sys.stderr)
        return 1
    print(f"summed test time {total:.0f} s (setup + call + teardown; at least {total / 2:.0f} s of wall on 2 workers)")
    print(f"{'xdist group':<20}{'seconds':>10}")
    for g, s in by_group.most_common():
        print(f"{g:<20}{s:>10.1f}")
    print(f"\n{'slowest files':<64}{'seconds':>10}")
    for f, s in by_file.most_common(a.files):
        print(f"{f:<64}{s:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
