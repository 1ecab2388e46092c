"""Run kmockx and the real kubetitan operator in-process, and play the kubelet.

- ``Cluster``: a KubeEmulator on 127.0.0.1 in its own thread and event loop, with the resources the
  operator uses declared (the LlamaPretrain CRD's printer columns come from ``kubetitan_core.crd``).
- ``Operator``: ``kubetitan.runner.run`` in a thread (the same code ``kubetitan operator`` runs),
  stopped through kopf's stop flag; ``ScaledClock`` lets API-minimum timeouts (e.g. 30 s) pass fast.
- ``OperatorProcess``: ``kubetitan operator`` as a separate process (HA replicas, logs, liveness, benchmark).
- ``Rank0Metrics``: a real prometheus-client exporter serving the trainer's metric names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import kmock
import requests
from prometheus_client import CollectorRegistry, Gauge, start_http_server


from kmockx import ApiError, KubeEmulator, kubeconfig, rbac  # noqa: F401 - ApiError re-exported for tests
from kubetitan_core import contract
from kubetitan.runner import Options, run
from support.procs import die_with_parent
from support.runs import RunQueries
from support.specs import NS, cpu_spec, lpt  # noqa: F401 - cpu_spec, lpt re-exported for tests written before tests/support
from support import yamlio

LPT = "kubetitan.io/v1alpha1/llamapretrains"
PODS, NODES, CMS, SVCS, EVENTS = "v1/pods", "v1/nodes", "v1/configmaps", "v1/services", "v1/events"
RELEASE_NS = rbac.RELEASE_NS
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
CRD_FILE = rbac.REPO / "crds" / "kubetitan.io_llamapretrains.yaml"


class ScaledClock:
    """Wall time running ``rate`` times faster from its creation (or from the last ``set_rate``)."""

    def __init__(self, rate: float = 1.0) -> None:
        self.rate, self.t0, self.base = rate, time.time(), time.time()

    def __call__(self) -> float:
        return self.base + (time.time() - self.t0) * self.rate

    def set_rate(self, rate: float) -> None:
        """Change the speed from now on; the clock never jumps."""
        self.base, self.t0, self.rate = self(), time.time(), rate


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition", every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Cluster(RunQueries):
    """kmockx with the built-ins declared, the CRD applied from crds/ and (``rbac=True``, the default) the chart's
    RBAC enforced: ``kubeconfig`` authenticates as the operator's ServiceAccount with the chart's rules for both
    watch modes (``operator_kubeconfig`` gives the exact rules of one mode), ``admin_kubeconfig`` as a cluster
    admin (a user running kubectl). In-process helpers (``apply``, ``patch``, ...) act as an admin."""

    def __init__(self, namespaces: tuple[str, ...] = (), rbac: bool = True, profile: str | None = None,
                 pod_groups: bool = False) -> None:
        self.namespaces = ("default", NS, RELEASE_NS, *namespaces)  # RELEASE_NS: the operator's own (its Lease)
        self.rbac = rbac
        self.pod_groups = pod_groups  # serve scheduling.k8s.io/v1beta1 PodGroups (KubeEmulator.serve_pod_groups)
        self.profile = profile  # a file: cProfile of the server's thread (its event loop), written when it stops
        self._kubeconfigs: list[str] = []
        self._stack: contextlib.AsyncExitStack | None = None
        self.loop = asyncio.new_event_loop()
        self.k: KubeEmulator | None = None
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True, name="kmock")
        self.kubeconfig = self._tempfile()
        self.admin_kubeconfig = self._tempfile()

    def _tempfile(self) -> str:
        fd, path = tempfile.mkstemp(suffix=".kubeconfig")
        os.close(fd)
        self._kubeconfigs.append(path)
        return path

    def _main(self) -> None:
        # asyncio.Runner, as asyncio.run: once _serve ends, the tasks it leaves (a watch handler still waiting for
        # events, its connection's handler) are cancelled and run to their end before the loop closes. Left pending,
        # they were finalised by whichever later test's garbage collection met them, each reporting 'Event loop is
        # closed' to pytest's unraisable-exception hook, which made 3.11's ``ast.parse`` fail in that test
        # (tests/support/pyparse.py; CI failed on it once, a local run once).
        with asyncio.Runner(loop_factory=lambda: self.loop) as runner:
            runner.run(self._serve())

    def _profiled(self) -> Any:
        """A cProfile of this thread from now until ``_serve`` is told to stop (None without ``profile``)."""
        if self.profile is None:
            return None
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        return prof

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        prof = self._profiled()
        async with KubeEmulator() as k, kmock.Server(k) as srv, contextlib.AsyncExitStack() as stack:
            self.k, self._stack = k, stack
            self.url = str(srv.url).rstrip("/")
            k.declare_builtins()
            if self.pod_groups:
                k.serve_pod_groups()
            for ns in dict.fromkeys(self.namespaces):  # kopf only watches namespaces that exist
                await k.put("v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            await k.put(CRDS, yamlio.load(CRD_FILE.read_text()))  # the CRD as `kubectl apply -f crds/` does
            if self.rbac:
                k.authorizer = rbac.Authorizer()
            self._ready.set()
            await self._stop.wait()
            k.drop_watches()  # open watches end as a dropped connection would, so the servers stop without waiting
            if prof is not None:  # written before the teardown, which may outlast __exit__'s join (open watches)
                prof.disable()
                prof.dump_stats(self.profile)

    def __enter__(self) -> Cluster:
        self.thread.start()
        assert self._ready.wait(10), "kmock did not start"
        with open(self.admin_kubeconfig, "w") as f:
            f.write(kubeconfig(self.url))
        if self.rbac:
            watched = tuple(n for n in self.namespaces if n not in ("default", RELEASE_NS))
            self._bind("kt", rbac.chart_rbac("kt", None) + rbac.chart_rbac("kt", watched), self.kubeconfig)
        else:
            with open(self.kubeconfig, "w") as f:
                f.write(kubeconfig(self.url))
        return self

    def _bind(self, release: str, docs: tuple[dict[str, Any], ...], path: str) -> None:
        """Authenticate a token as the chart's ServiceAccount of this render, grant its rules, write a kubeconfig."""
        assert self.k is not None and self.k.authorizer is not None
        sa = rbac.chart_service_account(docs)
        token = f"sa-{release}"
        url = self.call(self._listen())
        self.k.identities[token] = self.k.identities[f"port:{url.rpartition(':')[2]}"] = rbac.service_account(sa)
        self.k.authorizer.add(docs)
        with open(path, "w") as f:
            f.write(kubeconfig(url, token=token, user=sa))

    async def _listen(self) -> str:
        """One more port served by the same emulator (an identity of its own: see ``KubeEmulator._authn``)."""
        assert self.k is not None and self._stack is not None
        srv = await self._stack.enter_async_context(kmock.Server(self.k))
        return str(srv.url).rstrip("/")

    def operator_kubeconfig(self, namespaces: tuple[str, ...] | None) -> str:
        """A kubeconfig for the operator with exactly the chart's RBAC for watching ``namespaces`` (None: all)."""
        if not self.rbac:
            return self.kubeconfig
        if namespaces is not None and any(ch in n for n in namespaces for ch in "*?[!"):
            namespaces = None  # a glob needs the cluster-wide rules: the chart's namespaced mode lists exact names
        release = "ktc" if namespaces is None else "ktn-" + "-".join(sorted(namespaces))
        path = self._tempfile()
        self._bind(release, rbac.chart_rbac(release, None if namespaces is None else tuple(sorted(namespaces))), path)
        return path

    def __exit__(self, *exc: Any) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)
        for path in self._kubeconfigs:
            os.unlink(path)

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- API as a client / kubelet / node controller
    def apply(self, obj: dict[str, Any], admit: bool = True) -> dict[str, Any]:
        """Create a LlamaPretrain as an admin would (422 raises ``ApiError``); ``admit=False`` skips the CRD's
        schema (an object stored before the schema tightened)."""
        assert self.k is not None
        return self.call(self.k.put(LPT, obj, admit=admit))

    def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        assert self.k is not None
        return self.k.get(resource, ns, name)

    def list(self, resource: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        assert self.k is not None
        return self.k.list(resource, ns, selector)

    def patch(self, resource: str, ns: str | None, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        assert self.k is not None
        return self.call(self.k.patch_obj(resource, ns, name, patch, subresource))

    def delete(self, resource: str, ns: str | None, name: str) -> None:
        assert self.k is not None
        self.call(self.k.remove(resource, ns, name))

    def add_node(self, name: str, ready: bool = True) -> None:
        assert self.k is not None
        self.call(self.k.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                                     "status": {"conditions": [self._ready_cond(ready)]}}))

    @staticmethod
    def _ready_cond(ready: bool, when: str | None = None) -> dict[str, Any]:
        return {"type": "Ready", "status": "True" if ready else "Unknown",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                "lastTransitionTime": when or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def set_node_ready(self, name: str, ready: bool, when: str | None = None) -> None:
        self.patch(NODES, None, name, {"status": {"conditions": [self._ready_cond(ready, when)]}}, "status")

    # ---- the node-agent interface the e2e kubelet uses (support.cluster.KubeCluster is the real cluster's)
    schedules = False
    """The double has no scheduler: the e2e kubelet binds pods itself."""

    def renew_node(self, name: str) -> None:
        """No node Leases here: a node is Ready until a test says otherwise."""

    def patch_pod_status(self, ns: str, name: str, status: dict[str, Any], node: str) -> None:
        self.patch(PODS, ns, name, {"status": status}, "status")

    def delete_now(self, ns: str, name: str, node: str) -> None:
        """The kubelet's final grace-0 delete (already gone: nothing to do)."""
        assert self.k is not None
        with contextlib.suppress(AssertionError):  # kmockx's remove asserts the object exists
            self.call(self.k.remove(PODS, ns, name))

    def force_delete(self, ns: str, name: str) -> None:
        """``kubectl delete pod --grace-period=0 --force``."""
        k = self.k
        assert k is not None

        async def go() -> None:
            async with k._lock:
                await k._delete(kmock.resource(PODS), ns, name, {"gracePeriodSeconds": 0})

        self.call(go())

    def run_pod(self, ns: str, pod: str, node: str, ip: str = "127.0.0.1") -> None:
        if self.get(NODES, None, node) is None:
            self.add_node(node)
        self.patch(PODS, ns, pod, {"spec": {"nodeName": node}})
        self.patch(PODS, ns, pod, {"status": {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "ready": True, "state": {
                "running": {"startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}]}}, "status")

    def terminate_pod(self, ns: str, pod: str, exit_code: int, reason: str = "Error", message: str = "") -> None:
        self.patch(PODS, ns, pod, {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{"name": "trainer", "ready": False, "state": {"terminated": {
                "exitCode": exit_code, "reason": reason, "message": message}}}]}}, "status")

    def wait_pod(self, ns: str, pod: str, reason: str, message: str = "") -> None:
        self.patch(PODS, ns, pod, {"status": {"phase": "Pending", "containerStatuses": [
            {"name": "trainer", "ready": False, "state": {"waiting": {"reason": reason, "message": message}}}]}},
            "status")


class Operator:
    """The real operator in a thread; ``stop()`` is kopf's graceful stop (like SIGTERM)."""

    def __init__(self, cluster: Cluster, namespaces: tuple[str, ...] = ("ml",), clock: Callable[[], float] | None = None,
                 scan_interval: float = 0.1, scrape_interval: float = 0.05, all_namespaces: bool = False,
                 hang_floor_seconds: float | None = None, leader: Any = None) -> None:
        kc = cluster.operator_kubeconfig(None if all_namespaces else tuple(namespaces))
        self.options = Options(namespaces=[] if all_namespaces else list(namespaces), all_namespaces=all_namespaces,
                               kubeconfig=kc, metrics_port=None,
                               scan_interval=scan_interval, scrape_interval=scrape_interval, scrape_timeout=1.0,
                               clock=clock or time.time, leader=leader)
        if hang_floor_seconds is not None:
            self.options.hang_floor_seconds = hang_floor_seconds
        self.registry = CollectorRegistry()
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True, name="operator")

    def _main(self) -> None:
        try:
            run(self.options, stop_flag=self.stop_flag, ready_flag=self.ready_flag, registry=self.registry)
        except BaseException as e:  # noqa: BLE001 - surfaced by stop()
            self.error = e

    def __enter__(self) -> Operator:
        self.thread.start()
        assert self.ready_flag.wait(15), f"operator did not start: {self.error!r}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(20)
        assert not self.thread.is_alive(), "operator did not stop"
        assert self.error is None, f"operator crashed: {self.error!r}"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def run_cycles(self, name: str, ns: str = NS) -> float:
        """Reconcile cycles the operator ran for one run (``kubetitan_operator_run_cycles_total``)."""
        return self.metric(contract.OP_RUN_CYCLES, {"namespace": ns, "name": name}) or 0.0


PORT_BLOCK = 1000
"""Ports :func:`free_port` hands out per test process (an xdist worker, or a bench), below the ephemeral range."""
_next_port: list[int] = []


def _port_block(worker: str, ephemeral_low: int) -> range:
    """This process's block: 10000 + 1000 x (xdist worker number + 1) (0 for a process without xdist), below the
    kernel's ephemeral ports, skipping the one holding torchrun's 29500 (refused as a metrics port by the API)."""
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = 10000 + PORT_BLOCK * index
    if start <= 29500 < start + PORT_BLOCK:
        start += PORT_BLOCK
    if start + PORT_BLOCK > ephemeral_low:
        raise RuntimeError(f"no port block for xdist worker {worker!r} below the ephemeral range ({ephemeral_low})")
    return range(start, start + PORT_BLOCK)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port for a listener a test names (a trainer's metrics port, the kubelet double's rendezvous port, an
    operator's endpoint): from a block of this process's own below the kernel's ephemeral range, never the same
    one twice in a row, and free on every interface when handed out.

    Not ``bind(("127.0.0.1", 0))``: the kernel may hand the same ephemeral port to the next caller once the probe
    closes, and the kubelet double's rendezvous port then equalled a test's metrics port (seen under two CPU hogs:
    rank 0's TCPStore, which binds every interface, held it, and every worker failed with EADDRINUSE at start).
    Ports the kernel picks for its own (gloo, TCPStore clients, the API double) come from the ephemeral range."""
    block = _port_block(os.environ.get("PYTEST_XDIST_WORKER", ""), _ephemeral_low())
    if not _next_port:
        _next_port.append(block.start + os.getpid() % PORT_BLOCK)  # two plain processes at once: other offsets
    for _ in range(PORT_BLOCK):
        port = block.start + (_next_port[0] - block.start) % PORT_BLOCK
        _next_port[0] = port + 1
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {block}")


def _bindable(port: int) -> bool:
    """Nothing listens on ``port`` on any interface (dual-stack ``::``, or ``0.0.0.0`` without IPv6)."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
            return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False  # taken (another program on this machine): the caller tries the next one
    return False


def proc_memory_mb(pid: int) -> dict[str, float]:
    """``VmRSS`` (now) and ``VmHWM`` (peak RSS) of a process, in MiB, from /proc."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


class OperatorProcess:
    """``kubetitan operator`` as its own process (the CLI code path), JSON logs to a file, liveness on.

    ``stop()`` sends SIGTERM (kopf's graceful stop: a leader releases its Lease), ``kill()`` SIGKILL.
    """

    def __init__(self, kubeconfig: str, *args: str, log_format: str = "json", env: dict[str, str] | None = None
                 ) -> None:
        self.port = free_port()
        self.liveness = f"http://127.0.0.1:{self.port}/healthz"
        fd, self.log_path = tempfile.mkstemp(suffix=".log", prefix="kubetitan-operator-")
        os.close(fd)
        self.argv = [sys.executable, "-m", "kubetitan.cli", "operator", "--kubeconfig", kubeconfig,
                     "--metrics-port", "0", "--liveness", self.liveness, "--log-format", log_format, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> OperatorProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=die_with_parent)
        wait_for(self.alive, timeout, f"the operator's liveness endpoint {self.liveness}", every=0.1)
        return self

    def alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
        try:
            return requests.get(self.liveness, timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self._final_log = self.log_text()  # a failing test may still print it after the with block
        os.unlink(self.log_path)

    def stop(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"operator did not stop on SIGTERM within {timeout}s") from None
        return self.proc.returncode

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def memory_mb(self) -> dict[str, float]:
        return proc_memory_mb(self.pid)

    def log_text(self) -> str:
        if getattr(self, "_final_log", None) is not None:
            return self._final_log
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_records(self) -> list[dict[str, Any]]:
        """Every log line parsed as JSON (raises on a line that is not one JSON object)."""
        return [json.loads(line) for line in self.log_text().splitlines() if line.strip()]


class Rank0Metrics:
    """Rank 0's /metrics with the trainer's metric names, served by a real exporter on 127.0.0.1."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        names = {contract.M_STEP: "step", contract.M_TOTAL_STEPS: "steps", contract.M_LOSS: "loss",
                 contract.M_TOKENS_PER_SECOND: "tok/s", contract.M_TOKENS_PER_SECOND_PER_GPU: "tok/s/gpu",
                 contract.M_FLOPS_PER_GPU: "flop/s", contract.M_MFU: "ratio", contract.M_STEP_DURATION: "s",
                 contract.M_LAST_CHECKPOINT_STEP: "step", contract.M_LAST_STEP_TIMESTAMP: "s",
                 contract.M_PRODUCTIVE_SECONDS: "s", contract.M_JOB_START_TIMESTAMP: "s",
                 contract.M_ATTEMPT: "attempt"}
        self.g = {n: Gauge(n, f"test gauge ({u})", registry=self.registry) for n, u in names.items()}
        self.server, _ = start_http_server(0, "127.0.0.1", registry=self.registry)
        self.port = self.server.server_port

    def set(self, **values: float) -> None:
        for k, v in values.items():
            self.g[getattr(contract, k)].set(v)

    def step(self, step: int, attempt: int = 0, checkpoint: int | None = None, loss: float = 2.5) -> None:
        now = self.clock()
        self.set(M_STEP=step, M_ATTEMPT=attempt, M_LOSS=loss, M_LAST_STEP_TIMESTAMP=now,
                 M_TOKENS_PER_SECOND=8192.0, M_TOKENS_PER_SECOND_PER_GPU=1024.0, M_FLOPS_PER_GPU=4.0e14,
                 M_MFU=0.4, M_STEP_DURATION=1.0, M_PRODUCTIVE_SECONDS=step * 1.0,
                 M_JOB_START_TIMESTAMP=now - step * 1.25)
        if checkpoint is not None:
            self.set(M_LAST_CHECKPOINT_STEP=checkpoint)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
