"""The product packages' structure, re-measured on every run (pure ``ast``, no imports; well under a second):
no new import cycle, counting the imports inside functions, no new function over 60 lines without a
``# long: <why>`` comment, and no import that breaks the layer table (``support.codemap.LAYERS``). Both allow-lists
hold what was there when the check came in and may only shrink: an entry that is no longer true fails too, so fixing
a cycle or splitting a function removes its entry. ``python bench/code_structure.py`` prints the same facts (and
``--write`` regenerates docs/architecture.md's structure facts, layer table and module map, which a test compares)."""

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


def test_no_import_breaks_the_layer_table():
    broken = codemap.layer_violations()
    assert not broken, ("imports that break the layer table (tests/support/codemap.py LAYERS): move the code to the "
                        "layer it belongs to, or pass what it needs in from above:\n  " + "\n  ".join(broken))


def test_the_layer_table_sees_imports_inside_functions_and_of_outside_packages(tmp_path, monkeypatch):
    """The check above can fail: a data module that imports recovery inside a function, and a module outside the
    storage seam that imports s3torchconnector, each break their row; an exempt module and a TYPE_CHECKING import
    do not."""
    pkg = tmp_path / "kubetitan_trainer"
    for sub in ("data", "recovery"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""A package."""\n')
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "recovery" / "tier.py").write_text("X = 1\n")
    (pkg / "data" / "loaders.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from kubetitan_trainer.recovery import tier\n"
                                              "def f():\n    from kubetitan_trainer.recovery.tier import X\n    return X\n")
    (pkg / "data" / "s3.py").write_text("import s3torchconnector.dcp\n")
    (pkg / "storage.py").write_text("from s3torchconnector import S3ClientConfig\n")
    monkeypatch.setattr(codemap, "PACKAGES", {"kubetitan_trainer": pkg})
    rules = tuple(r for r in codemap.LAYERS if r.modules != ("kubetitan_core",) and r.modules != ("kubetitan",))
    assert codemap.layer_violations(rules) == [
        "kubetitan_trainer.data.loaders imports kubetitan_trainer.recovery.tier (line 5, in a function): data never "
        "imports recovery, compile, the launcher or the training loop",
        "kubetitan_trainer.data.s3 imports s3torchconnector.dcp (line 1): only the storage seam and compat import "
        "s3torchconnector"]


def test_docs_architecture_is_what_the_code_structure_script_writes():
    doc = REPO / "docs" / "architecture.md"
    text = doc.read_text()
    assert codemap.regenerate(text) == text, \
        "docs/architecture.md's structure facts, layer table or module map are out of date: regenerate them with " \
        "`python bench/code_structure.py --write`"
