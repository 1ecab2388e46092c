"""The product code reads as written on purpose (pure ``ast`` and text, nothing imported; well under a second):

- every module-level statement that is only an expression is a docstring (a string literal) or a call, so an edit
  that left a computed string where a docstring should be is seen;
"""

from __future__ import annotations

import ast

import pytest

from support import codemap


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


def test_module_level_expressions_are_docstrings_or_calls():
    found = {name: lines for name, (_text, tree) in _module_texts().items() if (lines := odd_expressions(tree))}
    assert not found, ("expression statements that are neither a docstring nor a call (an edit left a computed "
                       f"value where a docstring should be; write the docstring as one string literal): {found}")


@pytest.mark.parametrize(("source", "want"), [
    ('X = 1\n"""Doc."""\nf()\n', []),
    ('X = 1\n"""Doc.""".replace("a", "b") if False else """Doc."""\n', [2]),
    ("class A:\n    x: int\n    1 + 1\n", [3]),
], ids=["docstring-and-call", "computed-docstring", "class-level-arithmetic"])
def test_odd_expressions_are_seen(source, want):
    assert odd_expressions(ast.parse(source)) == want
