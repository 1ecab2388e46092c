"""A static map of the product packages, read with ``ast`` (nothing is imported): the modules, the import graph
including the imports inside functions, its cycles, and the functions' lengths.

Used by tests/test_structure.py (new import cycles and unexplained long functions fail) and by
``bench/code_structure.py`` (prints the report; ``--write`` regenerates the module map in docs/architecture.md)."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO
from support.pyparse import parse

PACKAGES: dict[str, Path] = {
    "kubetitan_core": REPO / "operator" / "core" / "kubetitan_core",
    "kubetitan": REPO / "operator" / "kubetitan",
    "kubetitan_trainer": REPO / "trainer" / "kubetitan_trainer",
}
"""The product packages: the shared torch-free core, the operator and CLI, the trainer."""
LONG_FUNCTION_LINES = 60
"""A function longer than this (def line to last line) carries a ``# long: <why>`` comment or is on the allow-list."""
LONG_MARK = re.compile(r"#\s*long:\s*\S")


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    doc: str
    """The first sentence of the module docstring ("" when there is none)."""
    lines: int


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    """Inside a def: executed when the function first runs, not when the module loads."""


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str
    line: int
    lines: int
    explained: bool
    """A ``# long: <why>`` comment in the comment block right above the def (or its decorators), or on the lines down
    to the first body line."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    """A file's text and syntax tree (read once per process: the three checks share them)."""
    text = path.read_text()
    return text, parse(text, str(path))


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _first_sentence(doc: str | None) -> str:
    """The docstring's first sentence (up to the first full stop that ends a word), in markdown's backticks."""
    text = " ".join((doc or "").split("\n\n")[0].split()).replace("``", "`")
    m = re.match(r"(.+?\.)(\s|$)", text)
    return (m.group(1) if m else text).rstrip(":")


def modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            source, tree = _parsed(path)
            name = _module_name(package, root, path)
            out[name] = Module(name, path, _first_sentence(ast.get_docstring(tree)), len(source.splitlines()))
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _resolve(known: set[str], source: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The product modules an import statement loads (the deepest known module of each imported name)."""
    def deepest(dotted: str) -> str | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return None

    if isinstance(node, ast.Import):
        found = [deepest(a.name) for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = source.split(".") if is_package else source.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        found = [deepest(f"{base}.{a.name}") or deepest(base) for a in node.names]
    return sorted({f for f in found if f and f != source})


def imports(mods: dict[str, Module] | None = None) -> list[Import]:
    """Every import between product modules, with where it sits; imports under ``if TYPE_CHECKING`` never run
    and are left out."""
    mods = mods or modules()
    known = set(mods)
    out: list[Import] = []

    def visit(node: ast.AST, source: str, is_package: bool, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, source, is_package, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.extend(Import(source, t, child.lineno, in_function)
                           for t in _resolve(known, source, is_package, child))
            visit(child, source, is_package, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for m in mods.values():
        visit(_parsed(m.path)[1], m.name, m.path.name == "__init__.py", False)
    return out


def cycles(edges: list[Import]) -> list[tuple[str, ...]]:
    """The import cycles: every strongly connected component of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(out)


def cycle_edges(edges: list[Import], component: tuple[str, ...]) -> list[Import]:
    """The imports that hold a cycle together (both ends inside the component)."""
    inside = set(component)
    return sorted((e for e in edges if e.source in inside and e.target in inside), key=lambda e: (e.source, e.line))


def functions(mods: dict[str, Module] | None = None) -> list[Function]:
    """Every function and method, with its length in lines (the def line to the last line of its body)."""
    out: list[Function] = []
    for m in (mods or modules()).values():
        source, tree = _parsed(m.path)
        lines = source.splitlines()

        def visit(node: ast.AST, prefix: str, module: str = m.name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{child.name}"
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    start = first - 1  # the comment block right above the def (or its decorators), whole
                    while start > 0 and lines[start - 1].lstrip().startswith("#"):
                        start -= 1
                    head = lines[start: child.body[0].lineno]
                    out.append(Function(module, qual, child.lineno, child.end_lineno - child.lineno + 1,
                                        any(LONG_MARK.search(line) for line in head)))
                    visit(child, f"{qual}.<locals>.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(tree, "")
    return out


def long_functions(limit: int = LONG_FUNCTION_LINES) -> list[Function]:
    return sorted((f for f in functions() if f.lines > limit), key=lambda f: -f.lines)


MAP_BEGIN = "<!-- module map: generated by `python bench/code_structure.py --write`; do not edit by hand -->"
MAP_END = "<!-- end of module map -->"


def module_map() -> str:
    """The module map of docs/architecture.md: one table per package, one row per module (its docstring's first
    sentence and the product modules it imports, at top level or inside functions). No sizes: the map changes when
    a module, its purpose or its dependencies do, not with every edit."""
    mods = modules()
    deps: dict[str, set[str]] = {}
    for e in imports(mods):
        deps.setdefault(e.source, set()).add(e.target)
    out = [MAP_BEGIN, ""]
    for package, root in PACKAGES.items():
        names = sorted(n for n in mods if n == package or n.startswith(package + "."))
        out += [f"### `{package}` ({root.relative_to(REPO)}, {len(names)} modules)", "",
                "| Module | What it is | Imports (product modules) |", "|---|---|---|"]
        for n in names:
            doc = mods[n].doc.replace("|", "\\|") or "(no docstring)"
            used = ", ".join(f"`{d}`" for d in sorted(deps.get(n, ()))) or "-"
            out.append(f"| `{n}` | {doc} | {used} |")
        out.append("")
    out.append(MAP_END)
    return "\n".join(out)


def replace_map(text: str, new_map: str) -> str:
    start, end = text.index(MAP_BEGIN), text.index(MAP_END) + len(MAP_END)
    return text[:start] + new_map + text[end:]
