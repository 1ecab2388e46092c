"""Fixtures of the real-cluster lane: one control plane per xdist worker that runs the ``real-cluster`` group (every
test here is in it), the chart installed once with helm, and the operator as a process with the chart's arguments
and ServiceAccount (tests/support/cluster.py, tests/support/release.py)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kmockx.harness import OperatorProcess, free_port
from support.cluster import STARTS_KEY, ControlPlane, KubeCluster, kubernetes_version, wait_for
from support.release import Release


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    with ControlPlane() as cp:
        line = (f"real control plane: Kubernetes {cp.version()['gitVersion']} (tests/cluster/go.mod pins "
                f"{kubernetes_version()}) ready in {cp.timings['ready']:.1f} s (etcd {cp.timings['etcd']:.1f} s, "
                f"kube-apiserver {cp.timings['kube-apiserver']:.1f} s)")
        workeroutput = getattr(request.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller prints it (tests/conftest.py)
            workeroutput["kubetitan_control_plane"] = line
        else:
            request.config.stash.setdefault(STARTS_KEY, []).append(line)
        yield cp


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> KubeCluster:
    return KubeCluster(control_plane)


@pytest.fixture(scope="session")
def release(control_plane: ControlPlane) -> Iterator[Release]:
    """charts/kubetitan installed by helm (out-of-cluster webhook URL, no in-cluster replica)."""
    r = Release(control_plane, webhook_port=free_port()).install()
    yield r


@pytest.fixture(scope="module")
def operator(release: Release, control_plane: ControlPlane) -> Iterator[OperatorProcess]:
    """The operator with the chart's arguments and its ServiceAccount's token, serving the webhook the API server
    calls; ready once the configuration carries the operator's CA (the webhook answers from then on)."""
    with tempfile.TemporaryDirectory(prefix="kubetitan-webhook-") as d, OperatorProcess(
            str(release.operator_kubeconfig()), *release.operator_args(cert_dir=d), log_format="json") as op:
        wait_for(lambda: release.webhook_ready() and release.webhook_serving(), 60, "the webhook served", every=0.1)
        yield op


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own (deleted afterwards; the namespace controller empties it)."""
    name = "t-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())[:40].strip("-") + \
        f"-{int(time.monotonic() * 1000) % 100000}"
    with _namespace(control_plane, name):
        yield name


@pytest.fixture(scope="module")
def dry_run_namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """One namespace for a module's tests that store nothing (server-side dry runs). A namespace per test would cost
    the cluster a sweep at each deletion: the namespace controller lists and deletes every resource type in it,
    about 90 requests a namespace, which made most of the API server's work in this lane."""
    with _namespace(control_plane, "dry-" + request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:40]) as name:
        yield name


@contextlib.contextmanager
def _namespace(control_plane: ControlPlane, name: str) -> Iterator[str]:
    control_plane.admin.ensure_namespace(name)
    try:
        yield name
    finally:
        control_plane.admin.delete("v1/namespaces", None, name)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
