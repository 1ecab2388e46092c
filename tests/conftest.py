"""Suite-wide hooks (a conftest holds fixtures and hooks only; helpers are in tests/support)."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import signal
import tempfile

import pytest

from support import forkrun, xdist_groups
from support.cluster import STARTS_KEY

_SLOWEST_FIRST = (
    "tests/cluster/",
    "tests/e2e/",
    "tests/operator/",
    "tests/trainer/test_train.py",
    "tests/monitoring/test_live_prometheus.py",
    "tests/trainer/test_fp8_all_gather.py",
    "tests/trainer/test_downloads.py",
    "tests/trainer/test_edge.py",
    "tests/trainer/test_units.py",
    "tests/trainer/",
    "tests/fast/",
)
"""Where the time goes (``--durations``; bench/results/suite/make_test_final_60a654a.txt), longest first. xdist
(``make test``: ``-n 5 --dist loadgroup --no-loadscope-reorder``) hands work out in collection order, so the long
xdist groups and the slow tests start first and the many short tests fill the gaps at the end
(longest-processing-time-first)."""


def _rank(item: pytest.Item) -> tuple[int, bool]:
    """(how early its path comes in _SLOWEST_FIRST, not in an xdist group): grouped tests lead their rank."""
    prefix = next((i for i, p in enumerate(_SLOWEST_FIRST) if item.nodeid.startswith(p)), len(_SLOWEST_FIRST))
    return prefix, item.get_closest_marker("xdist_group") is None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist_groups.in_node_ids(config, items)
    items.sort(key=_rank)  # stable: within a rank, collection order stays


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:  # noqa: ARG001
    """No garbage collection while pytest formats a test's report: it parses the failing source with ``ast.parse``,
    and a finaliser run by a collection in the middle (an event loop a test left, reported to the unraisable hook,
    whose traceback parses source too) broke Python 3.11's parser with 'SystemError: AST constructor recursion depth
    mismatch': the worker died with INTERNALERROR and the failure it was reporting was lost (a make test on this
    machine). The collection runs after the report."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if enabled:
            gc.enable()


_KUBE_CACHE: list[str] = []
"""The kubectl cache folder this process made (removed at the end)."""


def _own_kubectl_cache() -> None:
    """kubectl keeps a discovery and HTTP cache per API server address in ``~/.kube/cache`` by default: every test
    control plane's port left one there (475 folders, 274 MB in the developer's home after a day of runs). The tests'
    kubectl runs use a folder of the session's instead (``KUBECACHEDIR``, which kubectl reads), unless one is set;
    the xdist workers and every kubectl inherit it."""
    if os.environ.get("KUBECACHEDIR"):
        return
    _KUBE_CACHE.append(tempfile.mkdtemp(prefix="kubetitan-tests-kubectl-cache-"))
    os.environ["KUBECACHEDIR"] = _KUBE_CACHE[0]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _own_kubectl_cache()  # before the fork servers start: the workers inherit it
    tx = getattr(config.option, "tx", None) or []
    if not hasattr(config, "workerinput") and tx and all(t == "popen" for t in tx):  # -n N: the xdist controller
        config.option.tx = forkrun.start_servers(tx)
    gc.disable()  # collection imports torch and torchtitan: as the trainer does (kubetitan_trainer.main.imports_without_gc)
    import kubernetes_validate.utils as kv

    # kubernetes-validate's validate() reads and parses a kind's JSON schema and the multi-megabyte _definitions.json
    # on every call (a tenth of the CPU of tests/chart, py-spy); the schema files do not change during a run
    kv.schema_contents = functools.cache(kv.schema_contents)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.enable()
    gc.freeze()  # what collection imported is never collected again: later collections and the shutdown skip it


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    forkrun.stop_servers()
    for folder in _KUBE_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
    gc.freeze()  # the interpreter's shutdown collections would walk every object the tests left behind


_RESTORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every test leaves the process's signal handlers as it found them. torch elastic's ``PContext.start()``
    installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the main thread and never restores them, so a test
    that runs the launcher in-process (``launch.main``, ``start_processes``: tests/trainer/test_anatomy_restore.py,
    test_launch_causes.py) left them to every later test of its xdist worker and to what those fork (a prepare-data
    pool worker that inherited one hung a ``make test`` in session 15)."""
    before = {s: signal.getsignal(s) for s in _RESTORED_SIGNALS}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


_control_plane_starts: list[str] = []


def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - xdist's hook: a worker ended
    """Collect the real control plane's start line of each xdist worker that started one (tests/cluster)."""
    line = getattr(node, "workeroutput", {}).get("kubetitan_control_plane")
    if line:
        _control_plane_starts.append(f"[{node.gateway.id}] {line}")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    """Print how long each real control plane took to start (the lane's fixed cost, once per xdist group)."""
    for line in _control_plane_starts + config.stash.get(STARTS_KEY, []):
        terminalreporter.write_line(line)
