"""A static map of the product packages, read with ``ast`` (nothing is imported): the modules, the import graph
including the imports inside functions, its cycles, and the functions' lengths.

Used by tests/test_structure.py (new import cycles and unexplained long functions fail) and by
``bench/code_structure.py`` (prints the report; ``--write`` regenerates the module map in docs/architecture.md)."""

from __future__ import annotations

import ast
import functools
import re
import textwrap
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


# ------------------------------------------------------------------------------------------------- the layer table
@dataclass(frozen=True)
class Layer:
    """One rule of the layer table: no module under ``modules`` (prefixes; ``except_`` taken out) imports anything
    under ``never`` (product modules or outside packages such as torch, by prefix), at top level or in a function."""

    modules: tuple[str, ...]
    never: tuple[str, ...]
    why: str
    except_: tuple[str, ...] = ()

    def covers(self, module: str) -> bool:
        return _under(module, self.modules) and not _under(module, self.except_)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


KT = "kubetitan_trainer"
TRAINING_LOOP = (f"{KT}.trainer", f"{KT}.train_spec", f"{KT}.main", f"{KT}.evaluation", f"{KT}.metrics")
BASE = (f"{KT}.atomic", f"{KT}.errors", f"{KT}.knobs", f"{KT}.runtime", f"{KT}.compat", f"{KT}.flavours",
        f"{KT}.storage", f"{KT}.job_config", f"{KT}.netcheck", f"{KT}.cpu_bridge")
TORCH = ("torch", "torchtitan", "torchao")

LAYERS: tuple[Layer, ...] = (
    Layer(("kubetitan_core",), ("kubetitan", KT, *TORCH, "kopf", "kubernetes"),
          "the shared core is torch-free and Kubernetes-free; the operator and the trainer both import it"),
    Layer(("kubetitan",), (KT, *TORCH), "the operator never imports the trainer, nor torch"),
    Layer(("kubetitan.observation",), ("kopf", "kubetitan.handlers", "kubetitan.reconcile", "kubetitan.decide"),
          "observation is read by the policy and the reconcile loop, never the other way round; only the cycle's "
          "read (which fills a snapshot from the run's memory) sees the reconcile loop",
          except_=("kubetitan.observation.read",)),
    Layer(("kubetitan.decide",), ("kopf", "kubernetes", "aiohttp", "kubetitan.kube", "kubetitan.handlers",
                                  "kubetitan.reconcile", "kubetitan.status", "kubetitan.observation.read",
                                  "kubetitan.observation.scrape", "kubetitan.observation.snapshot"),
          "the decision is pure: it reads the observation's types, never the API, the scrape, the cycle or the status"),
    Layer(("kubetitan.decide.core", "kubetitan.decide.failure"),
          ("kubetitan.decide.elastic", "kubetitan.decide.liveness", "kubetitan.decide.lifecycle"),
          "the shared core and the failure policy (which the others restart through) import no other policy"),
    Layer(BASE, (f"{KT}.data", f"{KT}.recovery", f"{KT}.compile", f"{KT}.launch", f"{KT}.checks", f"{KT}.local",
                 *TRAINING_LOOP),
          "the trainer's base modules (errors, knobs, atomic writes, compat, storage, ...) import no concern above them"),
    Layer((f"{KT}.data",), (f"{KT}.recovery", f"{KT}.compile", f"{KT}.launch", *TRAINING_LOOP),
          "data never imports recovery, compile, the launcher or the training loop"),
    Layer((f"{KT}.recovery",), (f"{KT}.data", f"{KT}.compile", f"{KT}.launch", *TRAINING_LOOP),
          "recovery never imports data, compile, the launcher or the training loop"),
    Layer((f"{KT}.compile",), (f"{KT}.data", f"{KT}.recovery", f"{KT}.launch", *TRAINING_LOOP),
          "compile never imports data, recovery, the launcher or the training loop"),
    Layer((KT,), (f"{KT}.launch",), "nothing imports the launcher (the pod's entry point) but the launcher",
          except_=(f"{KT}.launch",)),
    Layer((KT,), ("s3torchconnector",), "only the storage seam and compat import s3torchconnector",
          except_=(f"{KT}.storage", f"{KT}.compat")),
    Layer((f"{KT}.atomic", f"{KT}.errors", f"{KT}.knobs", f"{KT}.runtime", f"{KT}.job_config", f"{KT}.launch.store",
           f"{KT}.launch.failures", f"{KT}.launch.state", f"{KT}.recovery.heartbeat", f"{KT}.data.shards",
           f"{KT}.data.stream", f"{KT}.data.prepare", f"{KT}.data.prepare_job"), TORCH,
          "torch-free trainer modules: the launchers' store protocol, failures and state, heartbeats, the shard "
          "format, the global sample stream and prepare-data are tested and run without torch"),
)
"""The layer table: which modules may not import which. tests/test_structure.py fails on an import that breaks a
row; docs/architecture.md shows the table (``python bench/code_structure.py --write``)."""


def external_imports(mods: dict[str, Module] | None = None) -> list[Import]:
    """Every import of an outside package (its top-level name as the target: ``torch``, ``s3torchconnector``), with
    where it sits; imports under ``if TYPE_CHECKING`` are left out."""
    mods = mods or modules()
    out: list[Import] = []

    def visit(node: ast.AST, source: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, source, in_function)
                continue
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                names = [child.module]
            else:
                names = []
            out.extend(Import(source, n, child.lineno, in_function) for n in names if n.split(".")[0] not in PACKAGES)
            visit(child, source, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    for m in mods.values():
        visit(_parsed(m.path)[1], m.name, False)
    return out


def layer_violations(layers: tuple[Layer, ...] = LAYERS, mods: dict[str, Module] | None = None) -> list[str]:
    """Every import that breaks a row of ``layers``: '<module> imports <target> (line N[, in a function]): <why>'."""
    mods = mods or modules()
    found = []
    for e in imports(mods) + external_imports(mods):
        for rule in layers:
            if rule.covers(e.source) and _under(e.target, rule.never):
                found.append(f"{e.source} imports {e.target} (line {e.line}{', in a function' if e.in_function else ''})"
                             f": {rule.why}")
    return sorted(set(found))


LAYERS_BEGIN = "<!-- layer table: generated by `python bench/code_structure.py --write`; do not edit by hand -->"
LAYERS_END = "<!-- end of layer table -->"


def layer_table() -> str:
    """The layer table as markdown (docs/architecture.md)."""
    def names(xs: tuple[str, ...]) -> str:
        return ", ".join(f"`{x}`" for x in xs)

    out = [LAYERS_BEGIN, "", "| Modules | Never import | Why |", "|---|---|---|"]
    for rule in LAYERS:
        who = names(rule.modules) + (f" (but {names(rule.except_)})" if rule.except_ else "")
        out.append(f"| {who} | {names(rule.never)} | {rule.why} |")
    out += ["", LAYERS_END]
    return "\n".join(out)


STRUCTURE_BEGIN = "<!-- structure facts: generated by `python bench/code_structure.py --write`; do not edit by hand -->"
STRUCTURE_END = "<!-- end of structure facts -->"


BIG_MODULE_LINES = 400
"""Modules longer than this are named in the report (only crossing it changes the report, not every edit)."""


def report() -> str:
    """What ``python bench/code_structure.py`` prints: modules per package and the long ones, import cycles (counting the imports inside functions),
    functions over :data:`LONG_FUNCTION_LINES` lines, and the layer table's violations."""
    mods = modules()
    edges = imports(mods)
    lines = [f"{len(mods)} modules in {', '.join(PACKAGES)}; {len(edges)} imports between them "
             f"({sum(e.in_function for e in edges)} inside functions)"]
    for package in PACKAGES:
        mine = sorted((m for n, m in mods.items() if n == package or n.startswith(package + ".")), key=lambda m: m.name)
        big = [m.name for m in mine if m.lines > BIG_MODULE_LINES]
        lines.append(f"  {package}: {len(mine)} modules, {len(big)} over {BIG_MODULE_LINES} lines" + (":" if big else ""))
        lines += textwrap.wrap(", ".join(big), 112, initial_indent="      ", subsequent_indent="      ")
    found = cycles(edges)
    lines.append(f"\nimport cycles (strongly connected components, imports inside functions included): {len(found)}")
    for c in found:
        lines.append("  " + " <-> ".join(c))
        lines += [f"      {e.source} -> {e.target}  line {e.line}{'  (in a function)' if e.in_function else ''}"
                  for e in cycle_edges(edges, c)]
    lines.append(f"  of which at module top level only: {len(cycles([e for e in edges if not e.in_function]))}")
    long = long_functions()
    lines.append(f"\nfunctions over {LONG_FUNCTION_LINES} lines: {len(long)} "
                 f"({sum(f.explained for f in long)} with a `# long:` comment)")
    lines += [f"  {f.lines:4d}  {f.name}{'  (explained)' if f.explained else ''}" for f in long]
    broken = layer_violations(mods=mods)
    lines.append(f"\nlayer table: {len(LAYERS)} rules, {len(broken)} imports break them")
    lines += [f"  {b}" for b in broken]
    return "\n".join(lines)


def structure_facts() -> str:
    """The structure facts block of docs/architecture.md: :func:`report` in a code block."""
    return "\n".join([STRUCTURE_BEGIN, "", "```", report(), "```", "", STRUCTURE_END])


def replace_between(text: str, begin: str, end: str, new: str) -> str:
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + new + text[stop:]


def regenerate(text: str) -> str:
    """docs/architecture.md with its generated parts (structure facts, layer table, module map) current."""
    text = replace_between(text, STRUCTURE_BEGIN, STRUCTURE_END, structure_facts())
    text = replace_between(text, LAYERS_BEGIN, LAYERS_END, layer_table())
    return replace_map(text, module_map())
