"""The test suite's layout rules, so that any subset of it runs (``pytest tests/<dir> tests/<dir>``).

Why: pytest imports every conftest.py under the one module name ``conftest`` and drops the previous one from
``sys.modules`` first, so ``from conftest import ...`` gets whichever conftest was imported last (``pytest tests/api
tests/operator`` once failed at collection with 12 ImportErrors). Test directories without ``__init__.py`` go on
``sys.path`` as they are collected, so their modules share one flat namespace. Importable helpers therefore live in
``tests/support`` (and ``tests/kmockx``), conftest.py files hold fixtures and hooks only, and names stay unique.

These checks read the source (ast) and take well under a second. The pair of directories that used to fail
(``tests/api tests/operator``) is collected together by every whole-suite run (each xdist worker collects every
directory in one process); ``bench/collect_pairs.py`` collects every pair of test directories (slow: minutes)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.paths import REPO
from support.procs import running
from support.pyparse import parse_file

TESTS = REPO / "tests"
HOOKS_AND_SETTINGS = ("pytest_",)
"""Top-level names a conftest may define besides fixtures: pytest hooks and settings (pytest_plugins)."""


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted name) of every import anywhere in the module, with relative imports' names as written."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}" if node.module else f"{base}{a.name}") for a in node.names]
    return out


def test_no_module_imports_a_conftest():
    offenders = [f"{p.relative_to(REPO)}:{line}: imports {name}"
                 for root in (TESTS, REPO / "bench") for p in _py_files(root)
                 for line, name in _imported_modules(parse_file(p)) if name.split(".")[-1] == "conftest"]
    assert not offenders, ("conftest modules shadow each other (all are imported as `conftest`); move the helper to "
                           "tests/support and import it from there:\n" + "\n".join(offenders))


def _is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Attribute) and target.attr == "fixture") or \
                (isinstance(target, ast.Name) and target.id == "fixture"):
            return True
    return False


def test_conftests_hold_fixtures_and_hooks_only():
    offenders = []
    for path in sorted(TESTS.rglob("conftest.py")):
        for node in parse_file(path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names, ok = [node.name], _is_fixture(node)
            elif isinstance(node, ast.ClassDef):
                names, ok = [node.name], False
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names, ok = [t.id for t in targets if isinstance(t, ast.Name)], False
            else:
                continue
            bad = [n for n in names if not ok and not n.startswith(("_", *HOOKS_AND_SETTINGS))]
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in bad]
    assert not offenders, ("a conftest.py holds fixtures, hooks and private names only; put importable helpers in "
                           "tests/support:\n" + "\n".join(offenders))


def _top_level_modules() -> dict[str, list[Path]]:
    """Every module name that is importable at top level while the suite runs: the modules and packages directly
    in tests/ (on sys.path through pytest.ini) and the modules of each test directory without ``__init__.py``
    (pytest prepends such a directory when it collects a module in it)."""
    names: dict[str, list[Path]] = {}
    dirs = [TESTS] + [d for d in sorted(TESTS.rglob("*")) if d.is_dir() and "__pycache__" not in d.parts
                      and not (d / "__init__.py").exists() and any(d.glob("test_*.py"))
                      and not any((p / "__init__.py").exists() for p in d.parents if TESTS in p.parents)]
    for d in dirs:
        for p in sorted(d.iterdir()):
            if p.suffix == ".py" and p.name != "conftest.py":
                names.setdefault(p.stem, []).append(p)
            elif d == TESTS and p.is_dir() and (p / "__init__.py").exists():
                names.setdefault(p.name, []).append(p)
    return names


def test_top_level_test_module_names_are_unique():
    clashes = {n: [str(p.relative_to(REPO)) for p in ps] for n, ps in _top_level_modules().items() if len(ps) > 1}
    assert not clashes, f"these modules shadow each other on sys.path (rename one, or move a helper to tests/support): {clashes}"


def _builds_llamapretrain(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "kind" and
                                              isinstance(v, ast.Constant) and v.value == "LlamaPretrain"
                                              for k, v in zip(n.keys, n.values))
               for n in ast.walk(fn))


def test_one_set_of_spec_builders():
    """Helpers that build a LlamaPretrain object live in tests/support/specs.py (a test may still write one
    inline)."""
    offenders = [f"{p.relative_to(REPO)}:{fn.lineno}: {fn.name}"
                 for p in _py_files(TESTS) if TESTS / "support" not in p.parents
                 for fn in ast.walk(parse_file(p)) if isinstance(fn, ast.FunctionDef)
                 and not fn.name.startswith("test_") and _builds_llamapretrain(fn)]
    assert not offenders, "build LlamaPretrain objects with support.specs (lpt, make_lpt, ...):\n" + "\n".join(offenders)


def test_the_layout_check_sees_the_suite():
    """The scans above are not vacuous: they find the conftests, the e2e helper modules and the builders."""
    assert len(list(TESTS.rglob("conftest.py"))) >= 2
    assert {"kmockx", "support", "common", "kubelet", "chartlib", "test_layout"} <= set(_top_level_modules())
    assert _builds_llamapretrain(next(n for n in ast.walk(parse_file(TESTS / "support" / "specs.py"))
                                      if isinstance(n, ast.FunctionDef) and n.name == "lpt"))


def test_the_static_checks_parse_safely_while_a_collection_runs_a_finaliser_that_parses():
    """The failure CI met (tests/support/pyparse.py): a cyclic collection during ``ast.parse`` runs a finaliser
    that parses too (as 3.11's traceback module does for an unraisable exception). Plain ``ast.parse`` fails on this
    interpreter's re-entry bug, or, on one without the bug, builds the same tree; ``support.pyparse.parse`` always
    builds it and leaves the collector on."""
    import gc

    from support.pyparse import parse

    source = "\n".join(f"def f{i}(a, b):\n    return [a + b * {i} for _ in range(3)]" for i in range(400))
    expected = ast.dump(ast.parse(source))

    class ParsesWhenCollected:
        def __del__(self):
            ast.parse("x.y + 1")

    def arm() -> None:
        for _ in range(50):
            c = ParsesWhenCollected()
            c.me = c  # a cycle: freed only by the cyclic collector

    threshold = gc.get_threshold()
    results = {}
    try:
        for name, fn in (("ast.parse", ast.parse), ("pyparse.parse", parse)):
            arm()
            gc.set_threshold(1)  # collect at (nearly) every allocation, so during the tree's construction
            try:
                results[name] = ast.dump(fn(source))
            except SystemError as e:
                results[name] = e
            finally:
                gc.set_threshold(*threshold)
                gc.collect()
    finally:
        gc.set_threshold(*threshold)
    assert results["pyparse.parse"] == expected
    assert gc.isenabled()
    if sys.version_info < (3, 12):  # the bug's interpreters: the check reproduces it, so it tests the guard
        assert isinstance(results["ast.parse"], SystemError), results["ast.parse"]


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    """Canary of support.xdist_groups: under ``--dist loadgroup`` (make test) every test of one ``xdist_group`` runs
    on the same worker. With pytest 9.2 and pytest-xdist 3.8 alone they were spread over all workers."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\nfrom support import xdist_groups\n\n"
        "@pytest.hookimpl(trylast=True)\ndef pytest_collection_modifyitems(config, items):\n"
        "    xdist_groups.in_node_ids(config, items)\n")
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\npytestmark = pytest.mark.xdist_group('g')\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_a(i):\n"
        "    with open('workers.txt', 'a') as f:\n        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}"}
    # two workers are enough to spread a group (and each costs a Python with pytest's plugins: ~3 CPU s)
    plugins_off = [a for p in ("cacheprovider", "hypothesispytest", "kmock", "cloudcoil", "anyio", "typeguard")
                   for a in ("-p", f"no:{p}")]
    out = subprocess.run([sys.executable, "-m", "pytest", *plugins_off, "-n", "2", "--dist", "loadgroup", "-q",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers


def test_a_helper_process_ends_with_the_test_process_that_started_it() -> None:
    """support.procs.die_with_parent (the control plane, the S3 server, operators, Prometheus): when the test process
    is killed outright (a CI timeout, SIGKILL), its long-lived helpers end too instead of running on as orphans."""
    code = ("import subprocess, sys, time; sys.path.insert(0, 'tests'); from support.procs import die_with_parent; "
            "p = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=die_with_parent); "
            "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _ends_after_kill(parent, child), "the helper outlived the killed test process"


def _forkserver(prefix: str) -> subprocess.Popen:
    """tests/support/forkserver.py with no imports of its own, for ``prefix``; ready when it returns."""
    server = subprocess.Popen([sys.executable, str(REPO / "tests/support/forkserver.py"), prefix, "none"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "KUBETITAN_FORKSERVER": prefix})
    assert server.stdout.readline() == b"ready\n"
    return server


def test_a_fork_runs_a_module_as_python_m_does_and_ends_with_its_killed_wrapper(tmp_path: Path) -> None:
    """tests/support/forkrun.py (``forkrun.python()``, which the CLI tests run instead of ``sys.executable``): ``-m
    MODULE ARGS`` in a fork prints and exits as ``python -m MODULE ARGS`` does (``__name__``, ``sys.argv``, the
    working directory first on ``sys.path``, exit code, nothing more on stderr); and a fork whose wrapper is killed
    outright (a test's time-out: SIGKILL cannot be passed on) ends too instead of running on under the server."""
    prefix = f"kubetitan-forkserver-test-{os.getpid()}"
    (tmp_path / "probe_mod.py").write_text(
        "import json, os, sys\nprint(json.dumps([__name__, sys.argv, sys.path[0] == os.getcwd()]))\n"
        "print('to stderr', file=sys.stderr)\nsys.exit(3)\n")
    forkrun = str(REPO / "tests/support/forkrun.py")
    env = {**os.environ, "KUBETITAN_FORKSERVER": prefix, "KUBETITAN_FORKSERVER_LOG": str(tmp_path / "cold.log")}
    server = _forkserver(prefix)
    try:
        cold = subprocess.run([sys.executable, "-m", "probe_mod", "a", "--b"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        warm = subprocess.run([sys.executable, "-S", forkrun, "-m", "probe_mod", "a", "--b"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert not (tmp_path / "cold.log").exists()  # served by the server, not a cold start
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr) == (
            3, cold.stdout, "to stderr\n")
        name, argv, cwd_first = json.loads(cold.stdout)
        assert (name, argv[1:], cwd_first) == ("__main__", ["a", "--b"], True) and argv[0].endswith("probe_mod.py")

        wrapper = subprocess.Popen([sys.executable, "-S", forkrun, "-c",
                                    "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                                   env=env, stdout=subprocess.PIPE, text=True)
        fork = int(wrapper.stdout.readline())
        assert fork != wrapper.pid
        assert _ends_after_kill(wrapper, fork), "the fork outlived its killed wrapper"
    finally:
        server.stdin.close()
        server.wait(30)


def test_a_reaped_forks_cpu_is_logged_with_the_test_that_asked_and_the_bench_sums_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``KUBETITAN_FORKSERVER_LOG`` the server writes a line per fork it reaps (``forkrun.log_fork_cpu``): its
    CPU from ``wait4`` (a child it reaped included), its arguments and the test that started it; bench/fork_cpu.py
    sums the lines by kind and by test."""
    prefix = f"kubetitan-forkserver-cpu-{os.getpid()}"
    log = tmp_path / "forks.log"
    server = subprocess.Popen([sys.executable, str(REPO / "tests/support/forkserver.py"), prefix, "none"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "KUBETITAN_FORKSERVER": prefix, "KUBETITAN_FORKSERVER_LOG": str(log)})
    try:
        assert server.stdout.readline() == b"ready\n"
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
        spin = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)\n"  # its child
        env = {**os.environ, "KUBETITAN_FORKSERVER": prefix, "PYTEST_CURRENT_TEST": "tests/x.py::test_spin (call)"}
        r = subprocess.run([sys.executable, "-S", str(REPO / "tests/support/forkrun.py"), "-c", spin], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        server.stdin.close()
        server.wait(30)
    (line,) = [json.loads(x[len("forkserver: cpu "):]) for x in log.read_text().splitlines()]
    assert line["argv"][:1] == ["-c"] and line["test"] == "tests/x.py::test_spin (call)" and line["parent"] == "server"
    assert line["cpu"] >= 0.3 and line["wall"] >= 0.3, line
    spec = importlib.util.spec_from_file_location("fork_cpu", REPO / "bench" / "fork_cpu.py")
    fork_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork_cpu)
    assert fork_cpu.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1 forks, {line['cpu']:.1f} CPU s ") and "tests/x.py::test_spin" in out, out


def _ends_after_kill(parent: subprocess.Popen, pid: int, timeout: float = 10) -> bool:
    """SIGKILL ``parent``, then whether ``pid`` (a process it started) has ended within ``timeout`` seconds."""
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + timeout
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not running(pid)
