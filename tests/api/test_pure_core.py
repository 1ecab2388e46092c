"""The package boundaries: kubetitan_core (API types, rule table, CRD, catalog, render, contract) imports neither
kopf, the Kubernetes client nor torch; the trainer (kubetitan_trainer) and the operator (kubetitan) share only
kubetitan_core and never import each other. Each import check runs in a fresh interpreter (the trainer's: a fork of
the tests' warm parent, which imported only torch and libraries of its kind), so nothing an earlier test imported can
hide an import."""

from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.pyparse import parse_file

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "operator" / "core" / "kubetitan_core"
OPERATOR = REPO / "operator" / "kubetitan"
TRAINER = REPO / "trainer" / "kubetitan_trainer"
BLOCKED = ("kopf", "kubernetes", "kubernetes_asyncio", "torch", "torchtitan", "torchao")
OPERATOR_PURE = ("kubetitan.plan", "kubetitan.decide", "kubetitan.conditions", "kubetitan.status",
                 "kubetitan.policy", "kubetitan.apidoc")


def _modules(root: Path, package: str) -> list[str]:
    """``package`` and every module and subpackage under it (``kubetitan_core.contract.launcher``)."""
    return [package] + [m.name for m in pkgutil.walk_packages([str(root)], prefix=f"{package}.")]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _block(names: tuple[str, ...]) -> str:
    return f"import sys\nfor m in {names!r}: sys.modules[m] = None  # any import of them raises ImportError\n"


def _imported(names: tuple[str, ...]) -> str:
    return f"print(sorted(m for m in sys.modules if m.split('.')[0] in {names!r} and sys.modules[m] is not None))\n"


def test_every_core_module_imports_and_validates_with_kopf_kubernetes_and_torch_blocked():
    modules = _modules(CORE, "kubetitan_core")
    assert {"kubetitan_core.api", "kubetitan_core.validation", "kubetitan_core.crd", "kubetitan_core.contract",
            "kubetitan_core.catalog", "kubetitan_core.render"} <= set(modules)
    code = (
        _block(BLOCKED + ("kubetitan", "kubetitan_trainer"))
        + f"for m in {modules!r}: __import__(m)\n"
        "from kubetitan_core.validation import parse\n"
        "from kubetitan_core.crd import crd\n"
        "from kubetitan_core.render import trainer_toml\n"
        "lpt, errs = parse({'apiVersion': 'kubetitan.io/v1alpha1', 'kind': 'LlamaPretrain', 'metadata': {'name': 'a'},"
        " 'spec': {'resources': {'env': [{'name': 'KUBETITAN_ATTEMPT', 'value': '1'}]}}})\n"
        "assert [e.rule for e in errs] == ['env.reserved'], errs\n"
        "assert crd()['spec']['versions'][0]['schema']['openAPIV3Schema']\n"
        "assert trainer_toml(lpt)\n"
        + _imported(BLOCKED)
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_operators_pure_modules_import_without_kopf_kubernetes_torch_or_the_trainer():
    r = _run(_block(BLOCKED + ("kubetitan_trainer",)) + f"for m in {OPERATOR_PURE!r}: __import__(m)\n" + _imported(BLOCKED))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_importing_every_trainer_module_never_imports_the_operator_package(tmp_path):
    """With ``kubetitan`` (the operator package) made unimportable, every trainer module still imports, and no
    ``kubetitan`` module is loaded afterwards. The interpreter is a fork of the tests' warm parent (support.warm),
    which has imported torch and the libraries torchtitan uses, none of which is ``kubetitan`` or ``kopf`` (the
    check would list them)."""
    from support import warm

    modules = _modules(TRAINER, "kubetitan_trainer")
    assert "kubetitan_trainer.local" in modules and "kubetitan_trainer.checks" in modules
    (tmp_path / "import_check.py").write_text(
        _block(("kubetitan", "kopf")) + f"for m in {modules!r}: __import__(m)\n" + _imported(("kubetitan", "kopf")))
    log = tmp_path / "import_check.log"
    proc = warm.popen("import_check", [], {**os.environ, "OMP_NUM_THREADS": "1"}, log, cwd=tmp_path)
    code, out = warm.wait_all([proc], timeout=300)[0], log.read_text(errors="replace")
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "[]", out  # what it printed last, after every import (stdout)


def _imports(root: Path, base: Path = REPO) -> dict[str, set[str]]:
    """Top-level package of every import statement (also the lazy ones inside functions), per file."""
    out: dict[str, set[str]] = {}
    for f in sorted(root.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(parse_file(f)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names.add(str(node.args[0].value).split(".")[0])
        out[str(f.relative_to(base))] = names
    return out


@pytest.mark.parametrize(("root", "forbidden"), [
    (CORE, {"kubetitan", "kubetitan_trainer", "kopf", "kubernetes", "torch", "torchtitan", "torchao"}),
    (TRAINER, {"kubetitan", "kopf", "kubernetes"}),
    (OPERATOR, {"kubetitan_trainer", "torch", "torchtitan", "torchao"}),
], ids=["core", "trainer", "operator"])
def test_no_source_file_imports_across_the_boundary(root, forbidden):
    """Static: no import statement anywhere (including lazy ones in functions and import_module strings)."""
    bad = {f: sorted(names & forbidden) for f, names in _imports(root).items() if names & forbidden}
    assert bad == {}


def test_the_static_scan_sees_lazy_imports(tmp_path):
    """The scan above can fail: it finds an import inside a function and an import_module string."""
    (tmp_path / "m.py").write_text("def f():\n    from kubetitan.plan import x\n    importlib.import_module('torch.nn')\n")
    assert _imports(tmp_path, tmp_path) == {"m.py": {"kubetitan", "torch"}}


def test_the_block_works():
    """The sys.modules trick does refuse the import (so the tests above can fail)."""
    r = _run("import sys; sys.modules['kopf'] = None; import kopf")
    assert r.returncode != 0 and "import of kopf halted" in r.stderr
