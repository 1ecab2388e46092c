"""The product code reads as written on purpose (pure ``ast`` and text, nothing imported; well under a second):

- every module-level statement that is only an expression is a docstring (a string literal) or a call, so an edit
  that left a computed string where a docstring should be is seen;
- a ``# long: <why>`` marker opens its comment block (a marker spliced into the middle of a sentence explains
  nothing);
- one module defines each named string constant (a label, a resource, a reason): no two product modules assign the
  same string to an upper-case module-level name;
- no two test modules carry the same helper (a top-level function or class, not a test, of the same text): shared
  helpers live in tests/support (or a folder's conftest.py).
"""

from __future__ import annotations

import ast

import pytest

from support import codemap
from support.paths import REPO
from support.pyparse import parse


def _module_texts() -> dict[str, tuple[str, ast.Module]]:
    return {name: codemap._parsed(m.path) for name, m in codemap.modules().items()}


def odd_expressions(tree: ast.Module) -> list[int]:
    """Lines of module- or class-level expression statements that are neither a string literal nor a call."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for stmt in node.body:
                if not isinstance(stmt, ast.Expr):
                    continue
                v = stmt.value
                if isinstance(v, ast.Constant) and isinstance(v.value, str) or isinstance(v, (ast.Call, ast.Await)):
                    continue
                if isinstance(v, ast.Constant) and v.value is Ellipsis:
                    continue
                out.append(stmt.lineno)
    return out


def spliced_long_marks(text: str) -> list[int]:
    """Lines whose comment holds a ``# long:`` marker that is not the first line of its comment block."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if codemap.LONG_MARK.search(line) and line.lstrip().startswith("#") and i > 0 \
                and lines[i - 1].lstrip().startswith("#"):
            out.append(i + 1)
    return out


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (upper-case names, strings of four characters or more): text -> name."""
    out = {}
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id.isupper() and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str) and len(stmt.value.value) > 3:
            out[stmt.value.value] = target.id
    return out


def copied_helpers(sources: dict[str, str]) -> list[list[str]]:
    """Groups of ``file:line name`` whose top-level helper (def or class, not ``test_*``) has the same text."""
    by_text: dict[str, list[str]] = {}
    for path, text in sources.items():
        for node in parse(text, path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("test_"):
                seg = ast.get_source_segment(text, node) or ""
                by_text.setdefault(seg, []).append(f"{path}:{node.lineno} {node.name}")
    return [places for places in by_text.values() if len(places) > 1]


def test_module_level_expressions_are_docstrings_or_calls():
    found = {name: lines for name, (_text, tree) in _module_texts().items() if (lines := odd_expressions(tree))}
    assert not found, ("expression statements that are neither a docstring nor a call (an edit left a computed "
                       f"value where a docstring should be; write the docstring as one string literal): {found}")


def test_long_markers_open_their_comment():
    found = {name: lines for name, (text, _tree) in _module_texts().items() if (lines := spliced_long_marks(text))}
    assert not found, ("`# long:` markers inside a comment block (write `# long: <why>` as the comment's first "
                       f"line): {found}")


def test_each_named_string_constant_is_defined_in_one_module():
    where: dict[str, list[str]] = {}
    for name, (_text, tree) in _module_texts().items():
        for text, const in string_constants(tree).items():
            where.setdefault(text, []).append(f"{name}.{const}")
    twice = {text: places for text, places in where.items() if len(places) > 1}
    assert not twice, f"string constants defined in more than one module (import the one definition): {twice}"


def test_no_test_helper_is_copied_between_modules():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "tests").rglob("*.py"))}
    copies = copied_helpers(sources)
    assert not copies, f"the same helper in several test modules (move it to tests/support): {copies}"


def test_copied_helpers_are_seen():
    helper = "def _events(c, name):\n    return sorted(c.list(name))\n"
    got = copied_helpers({"a.py": helper + "def test_a():\n    pass\n", "b.py": helper, "c.py": "def _other():\n    pass\n"})
    assert got == [["a.py:1 _events", "b.py:1 _events"]]


def test_string_constants_are_read():
    tree = ast.parse('GPU = "nvidia.com/gpu"\nX: str = "abcd"\nlower = "ignored"\nN = 3\nS = "ab"\n')
    assert string_constants(tree) == {"nvidia.com/gpu": "GPU", "abcd": "X"}


@pytest.mark.parametrize(("source", "want"), [
    ('X = 1\n"""Doc."""\nf()\n', []),
    ('X = 1\n"""Doc.""".replace("a", "b") if False else """Doc."""\n', [2]),
    ("class A:\n    x: int\n    1 + 1\n", [3]),
], ids=["docstring-and-call", "computed-docstring", "class-level-arithmetic"])
def test_odd_expressions_are_seen(source, want):
    assert odd_expressions(ast.parse(source)) == want


@pytest.mark.parametrize(("source", "want"), [
    ("# long: a table of rules\ndef f():\n    pass\n", []),
    ("# The agent subclass (imported here, as all of the\n# long: launcher) closes over state\ndef f():\n", [2]),
], ids=["opens-the-comment", "spliced"])
def test_spliced_long_marks_are_seen(source, want):
    assert spliced_long_marks(source) == want
