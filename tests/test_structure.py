"""The product packages' structure, re-measured on every run (pure ``ast``, no imports; well under a second):
no new import cycle, counting the imports inside functions, and no new function over 60 lines without a
``# long: <why>`` comment. Both allow-lists hold what was there when the check came in and may only shrink:
an entry that is no longer true fails too, so fixing a cycle or splitting a function removes its entry.
``python bench/code_structure.py`` prints the same facts (and regenerates the module map in docs/architecture.md)."""

from __future__ import annotations

from support import codemap
from support.paths import REPO

KNOWN_CYCLES: set[tuple[str, ...]] = set()
"""Import cycles (sorted modules of one strongly connected component) that existed when this check came in: none
since the trainer's last one was broken (``kubetitan_trainer.flavours``, docs/architecture.md)."""

KNOWN_LONG_FUNCTIONS: set[str] = set()
"""Functions over 60 lines without a ``# long:`` comment when this check came in: none since issue 24 split them."""


def _describe(edges: list[codemap.Import], cycle: tuple[str, ...]) -> str:
    return "\n".join(f"  {e.source} -> {e.target} (line {e.line}{', in a function' if e.in_function else ''})"
                     for e in codemap.cycle_edges(edges, cycle))


def test_no_new_import_cycle():
    edges = codemap.imports()
    found = set(codemap.cycles(edges))
    new = sorted(found - KNOWN_CYCLES)
    assert not new, "new import cycle(s), counting imports inside functions; move the shared helper to the module it " \
                    "belongs to:\n" + "\n\n".join(f"{' <-> '.join(c)}:\n{_describe(edges, c)}" for c in new)
    gone = sorted(KNOWN_CYCLES - found)
    assert not gone, f"these cycles are gone (well done): remove them from KNOWN_CYCLES: {gone}"


def test_no_new_unexplained_long_function():
    long = {f.name: f for f in codemap.long_functions()}
    unexplained = sorted(n for n, f in long.items() if not f.explained and n not in KNOWN_LONG_FUNCTIONS)
    assert not unexplained, (
        f"functions over {codemap.LONG_FUNCTION_LINES} lines: split them, or say why they are long in a "
        "`# long: <why>` comment above the def or on its first lines:\n"
        + "\n".join(f"  {n} ({long[n].lines} lines, {codemap.modules()[long[n].module].path.relative_to(REPO)}:{long[n].line})"
                    for n in unexplained))
    shrunk = sorted(n for n in KNOWN_LONG_FUNCTIONS if n not in long or long[n].explained)
    assert not shrunk, f"now short, gone or explained: remove them from KNOWN_LONG_FUNCTIONS: {shrunk}"


def test_the_import_scan_sees_function_level_imports_and_relative_ones(tmp_path, monkeypatch):
    """The checks above can fail: a cycle held by imports inside functions (one relative) is found, imports under
    ``if TYPE_CHECKING`` are not edges, and a long function is measured and its ``# long:`` comment seen."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A package."""\n')
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "def f():\n    from pkg.b import g\n    return g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n" + "def long():  # long: a table\n" + "    x = 1\n" * 70
                              + "def longer():\n" + "    x = 1\n" * 70)
    monkeypatch.setattr(codemap, "PACKAGES", {"pkg": pkg})
    edges = codemap.imports()
    assert {(e.source, e.target, e.in_function) for e in edges} == {
        ("pkg.a", "pkg.b", True), ("pkg.b", "pkg.a", True), ("pkg.c", "pkg.a", False)}
    assert codemap.cycles(edges) == [("pkg.a", "pkg.b")]
    assert [(f.name, f.lines, f.explained) for f in codemap.long_functions()] == [
        ("pkg.c.long", 71, True), ("pkg.c.longer", 71, False)]


def test_the_module_map_in_docs_architecture_is_current():
    doc = REPO / "docs" / "architecture.md"
    text = doc.read_text()
    assert codemap.replace_map(text, codemap.module_map()) == text, \
        "docs/architecture.md's module map is out of date: regenerate it with `python bench/code_structure.py --write`"
