"""Operator benchmark against kmockx or the real control plane (prints numbers; asserts no timing).

    .venv/bin/python bench/operator_bench.py [--nodes 1024] [--runs 2000] [--repeat 3] [--profile DIR]
                                             [--server double|real]
                                             [--only gang|faults|recovery|many ...] [--fault-share 0.2]
                                             [--retry-after 1] [--operator-src DIR]

Three processes, so that the operator is measured on its own:

- the API server: kmockx (``tests/kmockx/serve.py``) in its own process;
- the operator: ``kubetitan operator --namespace ml ...`` (the CLI code path) in its own process; its
  RSS (``VmRSS``, and the kernel's peak ``VmHWM``) and CPU seconds come from ``/proc/<pid>``;
- this driver, which plays the user and the kubelet over HTTP and times everything from watch streams.

Scenarios (each on a fresh server and operator):

1. ``gang``: apply one ``--nodes``-node LlamaPretrain -> all its pods created;
2. ``faults``: the same with ``--fault-share`` of the pod-create requests (retries included: each request
   draws anew; run i of ``--repeat`` uses seed i, so runs of two invocations draw alike) answered 429 or 503
   (half each) with ``Retry-After: --retry-after`` seconds (kmockx's ``--fault``); it also prints how kmockx
   answered the pod creates (409s would be duplicates) and, from kmockx's request log, when the first pod create
   was answered, when every pod had been answered once, the most refusals one pod had, the floor those refusals
   set (each pod's first answer plus its refusals x ``Retry-After``, the latest) and when the last pod was created:
   ``last - floor`` is what the operator's client and fan-out added on top of the waits the server asked for;
3. ``recovery``: an 8-node gang runs, one pod fails -> the next attempt's 8 pods created;
4. ``many``: ``--runs`` LlamaPretrains (1 pod each) applied at once -> all have their pod and phase Starting;
   operator RSS idle, peak and after settling.

``--repeat N`` runs each scenario N times (each on a fresh server and operator) and prints every run and the
median.

``--profile DIR`` runs the operator under cProfile (main thread: kopf's event loop and our handlers)
and writes DIR/<scenario>.prof, and kmockx's server thread too (DIR/kmockx_<scenario>.prof).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kmockx.harness import OperatorProcess, wait_for  # noqa: E402
from support.specs import NS, cpu_spec, lpt  # noqa: E402

LPT_PATH = f"/apis/kubetitan.io/v1alpha1/namespaces/{NS}/llamapretrains"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"
OPERATOR_SRC: str | None = None
"""--operator-src: a directory holding another ``kubetitan`` package (e.g. an older commit's) to compare."""


class _Api(ABC):
    """What the driver does as the user (``url``, ``http`` and ``close`` come from the subclass)."""

    url: str
    http: requests.Session

    @abstractmethod
    def close(self) -> None:
        """Stop the API server (and its process)."""

    def __enter__(self) -> _Api:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def create(self, path: str, obj: dict[str, Any]) -> None:
        r = self.http.post(self.url + path, json=obj, timeout=30)
        assert r.status_code == 201, r.text


class Server(_Api):
    """kmockx in its own process."""

    def __init__(self, *args: str, profile: str | None = None) -> None:
        fd, self.kubeconfig = tempfile.mkstemp(suffix=".kubeconfig")
        os.close(fd)
        self.stats: dict[str, Any] = {}
        if profile:
            Path(profile).parent.mkdir(parents=True, exist_ok=True)
            args = (*args, "--profile", profile)
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/kmockx/serve.py"), self.kubeconfig, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["ready"], f"kmockx did not start: {line}"
        self.url = line[1]
        self.http = requests.Session()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        for line in self.proc.stdout:
            if line.startswith("stats "):
                self.stats = json.loads(line[len("stats "):])
        self.proc.wait(20)
        os.unlink(self.kubeconfig)

    # ---- as a kubelet
    def patch(self, path: str, patch: dict[str, Any]) -> None:
        r = self.http.patch(self.url + path, data=json.dumps(patch), timeout=30,
                            headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200, r.text

    def run_pod(self, name: str, node: str) -> None:
        self.patch(f"{POD_PATH}/{name}", {"spec": {"nodeName": node}})
        self.patch(f"{POD_PATH}/{name}/status", {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "ready": True, "state": {"running": {
                "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}]}})

    def add_node(self, name: str) -> None:
        self.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}})


class RealServer(_Api):
    """A real control plane instead (``--server real``: tests/support/cluster.py, the binaries ``make cluster``
    builds): etcd, kube-apiserver and kube-controller-manager (its ServiceAccount controller gives the namespace its
    ``default`` ServiceAccount, which pod admission needs); no scheduler and no nodes, so pods stay Pending, as on
    the double. The CRD from crds/; the operator authenticates as the admin. ``kcpu`` is kube-apiserver's CPU."""

    def __init__(self, *args: str, profile: str | None = None) -> None:
        from support.cluster import ControlPlane

        if args or profile:
            raise SystemExit("--server real: faults and --profile are the double's (kmockx's) features")
        self.cp = ControlPlane(scheduler=False, audit=False)
        self.cp.start()
        self.url, self.http, self.stats = self.cp.server, self.cp.admin.s, {}
        self.kubeconfig = str(self.cp.admin_kubeconfig)
        self.proc = self.cp.components["kube-apiserver"].proc
        self.http.post(self.url + "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", timeout=30,
                       json=__import__("yaml").safe_load((ROOT / "crds/kubetitan.io_llamapretrains.yaml").read_text()))
        self.cp.admin.ensure_namespace(NS)
        wait_for(lambda: self.cp.admin.get("v1/serviceaccounts", NS, "default") is not None
                 and self.http.get(self.url + LPT_PATH, timeout=5).status_code == 200, 60, "namespace and CRD ready")

    def close(self) -> None:
        self.cp.stop()


SERVER: type = Server
"""--server: kmockx (the double, default) or the real control plane."""


class Watch:
    """A watch stream in a thread; ``seen(pred)`` counts distinct object names whose latest event matches.

    A stream the server ends while the driver still reads is opened again (kube-apiserver closes a watcher that
    falls behind, "watcher close due to unresponsiveness", on a loaded machine); the new one starts with the current
    state (an ADDED event per object), as the first did."""

    def __init__(self, server: Server, path: str, selector: str | None = None) -> None:
        self.latest: dict[str, tuple[str, dict[str, Any]]] = {}
        self.lock = threading.Lock()
        self.closed = False
        self.reopened = 0
        self.server, self.path = server, path
        self.params = {"watch": "true", **({"labelSelector": selector} if selector else {})}
        self.resp = self._open()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _open(self) -> requests.Response:
        return self.server.http.get(self.server.url + self.path, params=self.params, stream=True, timeout=(5, None))

    def _read(self) -> None:
        while not self.closed:
            try:
                for line in self.resp.iter_lines():
                    if line.strip():
                        ev = json.loads(line)
                        if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            with self.lock:
                                self.latest[ev["object"]["metadata"]["name"]] = (ev["type"], ev["object"])
            except (requests.RequestException, AttributeError, ValueError):
                pass  # the stream ended
            while not self.closed:
                try:
                    self.resp = self._open()
                    self.reopened += 1
                    break
                except requests.RequestException:
                    time.sleep(0.2)

    def count(self, pred: Callable[[dict[str, Any]], bool] = lambda o: True) -> int:
        with self.lock:
            return sum(1 for t, o in self.latest.values() if t != "DELETED" and pred(o))

    def close(self) -> None:
        """Stop reading; the stream ends with its server (closing it from here would block on the reader)."""
        self.closed = True
        self.latest = {}


def operator(server: Server, profile: str | None, scenario: str, *args: str) -> OperatorProcess:
    env = {"PYTHONPATH": OPERATOR_SRC} if OPERATOR_SRC else None
    op = OperatorProcess(server.kubeconfig, "--namespace", NS, *args, log_format="plain", env=env)
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
        i = op.argv.index("-m")
        op.argv[i:i] = ["-m", "cProfile", "-o", str(Path(profile) / f"{scenario}.prof")]
    return op


def _kprof(profile: str | None, scenario: str) -> str | None:
    """kmockx's profile file for ``scenario`` under ``--profile DIR``."""
    return str(Path(profile) / f"kmockx_{scenario}.prof") if profile else None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fault_args(share: float, retry_after: int, seed: int) -> list[str]:
    """kmockx's ``--fault`` options: ``share`` of pod creates answered 429 or 503 (half each), with Retry-After."""
    first = share / 2
    second = (share / 2) / (1 - first)  # tried only on requests the first fault let through
    return ["--seed", str(seed), *(a for code, rate in ((429, first), (503, second)) for a in (
        "--fault", json.dumps({"code": code, "verbs": ["create"], "resource": "pods", "rate": rate,
                               "retry_after": retry_after})))]


def gang(profile: str | None, nodes: int = 64, server_args: tuple[str, ...] = (), scenario: str = "gang"
         ) -> dict[str, Any]:
    s = SERVER(*server_args, profile=_kprof(profile, scenario))
    with s, operator(s, profile, scenario, "--scan-interval", "5") as op:
        w = Watch(s, POD_PATH, "kubetitan.io/name=big")
        time.sleep(1.0)  # let the operator finish its initial listing
        cpu0, kcpu0, t0 = cpu_seconds(op.pid), cpu_seconds(s.proc.pid), time.perf_counter()
        applied = time.monotonic()
        s.create(LPT_PATH, lpt("big", cpu_spec(nodes=nodes)))
        wait_for(lambda: w.count() >= nodes, 120, f"{nodes} pods", every=0.002)
        out: dict[str, Any] = {"seconds": time.perf_counter() - t0, "cpu": cpu_seconds(op.pid) - cpu0,
                               "kcpu": cpu_seconds(s.proc.pid) - kcpu0, "pods": w.count()}
        w.close()
    out["stats"] = s.stats
    if "first" in s.stats.get("chains", {}):  # kmockx's clock is this process' (time.monotonic: one per host)
        out["stats"]["chains"]["first"] -= applied
    return out


def recovery(profile: str | None, nodes: int = 8) -> dict[str, float]:
    with Server(profile=_kprof(profile, "recovery")) as s, \
            operator(s, profile, "recovery", "--scan-interval", "5") as op:
        w = Watch(s, POD_PATH, "kubetitan.io/name=rec")
        s.create(LPT_PATH, lpt("rec", cpu_spec(nodes=nodes)))
        wait_for(lambda: w.count() >= nodes, 60, "attempt 0 pods")
        for r in range(nodes):
            s.add_node(f"node-{r}")
            s.run_pod(f"rec-a0-{r}", f"node-{r}")
        time.sleep(1.0)
        cpu0, t0 = cpu_seconds(op.pid), time.perf_counter()
        s.patch(f"{POD_PATH}/rec-a0-3/status", {"status": {"phase": "Failed", "containerStatuses": [
            {"name": "trainer", "ready": False, "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}})
        wait_for(lambda: w.count(lambda o: o["metadata"]["name"].startswith("rec-a1-")) >= nodes, 60,
                 "attempt 1 pods", every=0.002)
        out = {"seconds": time.perf_counter() - t0, "cpu": cpu_seconds(op.pid) - cpu0}
        w.close()
        return out


def many(profile: str | None, n: int) -> dict[str, float]:
    with SERVER(profile=_kprof(profile, "many")) as s, operator(s, profile, "many", "--scan-interval", "10") as op:
        pods, runs = Watch(s, POD_PATH), Watch(s, LPT_PATH)
        time.sleep(2.0)
        idle = op.memory_mb()["VmRSS"]
        peak = [idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], op.memory_mb()["VmRSS"])

        threading.Thread(target=sample, daemon=True).start()
        cpu0, kcpu0, t0 = cpu_seconds(op.pid), cpu_seconds(s.proc.pid), time.perf_counter()
        for i in range(n):
            s.create(LPT_PATH, lpt(f"j{i}", cpu_spec(nodes=1)))
        applied = time.perf_counter() - t0
        wait_for(lambda: pods.count() >= n, 600, f"{n} pods", every=0.05)
        t_pods = time.perf_counter() - t0
        wait_for(lambda: runs.count(lambda o: (o.get("status") or {}).get("phase") == "Starting") >= n, 600,
                 f"{n} runs Starting", every=0.05)
        total = time.perf_counter() - t0
        cpu, kcpu = cpu_seconds(op.pid) - cpu0, cpu_seconds(s.proc.pid) - kcpu0
        time.sleep(10.0)  # settle: daemons keep cycling every --scan-interval
        stop.set()
        mem = op.memory_mb()
        pods.close()
        runs.close()
        return {"applied": applied, "pods": t_pods, "total": total, "cpu": cpu, "kcpu": kcpu, "idle": idle,
                "peak": max(peak[0], mem["VmHWM"]), "settled": mem["VmRSS"], "reopened": pods.reopened + runs.reopened}


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=500, help="LlamaPretrains in the 'many' scenario")
    p.add_argument("--nodes", type=int, default=64, help="nodes of the gang in 'gang' and 'faults'")
    p.add_argument("--repeat", type=int, default=1, help="run each scenario this many times; print the median")
    p.add_argument("--fault-share", type=float, default=0.2, help="share of pod-create requests refused ('faults')")
    p.add_argument("--retry-after", type=int, default=1, help="the refusals' Retry-After, seconds ('faults')")
    p.add_argument("--profile", metavar="DIR")
    p.add_argument("--only", choices=["gang", "faults", "recovery", "many"], action="append",
                   help="run only this scenario (repeatable)")
    p.add_argument("--server", choices=["double", "real"], default="double",
                   help="the API server: kmockx (default) or the real control plane of tests/support/cluster.py "
                        "(gang and many only)")
    p.add_argument("--operator-src", metavar="DIR",
                   help="run the operator from DIR/kubetitan instead (A/B against an older commit: "
                        "git archive COMMIT operator/kubetitan | tar -x -C /tmp/old; DIR=/tmp/old/operator)")
    a = p.parse_args()
    global OPERATOR_SRC, SERVER
    OPERATOR_SRC = a.operator_src
    only = set(a.only or ("gang", "faults", "recovery", "many"))
    if a.server == "real":
        SERVER = RealServer
        if only - {"gang", "many"}:
            p.error(f"--server real runs gang and many only (faults are injected by kmockx; recovery plays the "
                    f"kubelet on the double): add --only gang --only many, not {sorted(only - {'gang', 'many'})}")
    api = "kube-apiserver + etcd (real)" if a.server == "real" else "kmockx"
    print(f"machine: {os.cpu_count()} CPUs, {_load()} at start; operator, {api} and this driver are separate "
          "processes", flush=True)
    if "gang" in only:
        rs = []
        for i in range(a.repeat):
            rs.append(r := gang(a.profile, a.nodes))
            print(f"  gang run {i + 1}: {r['seconds']:.3f} s, CPU: operator {r['cpu']:.2f} s, "
                  f"API server {r['kcpu']:.2f} s; "
                  f"pod creates answered {r['stats'].get('pod_creates')} ({_load()})", flush=True)
        print(f"apply -> all {a.nodes} pods created ({a.nodes}-node gang): median {_med(rs, 'seconds'):.3f} s of "
              f"{a.repeat} (operator CPU {_med(rs, 'cpu'):.2f} s; target < 2 s for 1024 nodes)", flush=True)
    if "faults" in only:
        rs = []
        for i in range(a.repeat):
            rs.append(r := gang(a.profile, a.nodes, tuple(fault_args(a.fault_share, a.retry_after, seed=i)),
                                "faults"))
            st = r["stats"]
            print(f"  faults run {i + 1}: {r['seconds']:.3f} s, CPU: operator {r['cpu']:.2f} s, "
                  f"kmockx {r['kcpu']:.2f} s; "
                  f"injected "
                  f"{'+'.join(str(f['hits']) for f in st.get('faults', []))} (429+503); pod creates answered "
                  f"{st.get('pod_creates')} ({_load()})", flush=True)
            if ch := st.get("chains"):
                print(f"    first pod create answered {ch['first']:.3f} s after the apply; most refusals of one pod "
                      f"{ch['refused']}; after the first pod-create answer: every pod answered once "
                      f"{ch['once']:.3f} s, the refusals' "
                      f"floor {ch['floor']:.3f} s, last pod created {ch['last']:.3f} s (added on top "
                      f"{ch['last'] - ch['floor']:.3f} s)", flush=True)
        print(f"apply -> all {a.nodes} pods created, {a.fault_share:.0%} of pod creates answered 429/503 with "
              f"Retry-After {a.retry_after} s: median {_med(rs, 'seconds'):.3f} s of {a.repeat} (operator CPU "
              f"{_med(rs, 'cpu'):.2f} s; target < 5 s for 1024 nodes)", flush=True)
    if "recovery" in only:
        rs = [recovery(a.profile) for _ in range(a.repeat)]
        print(f"pod failure -> next attempt's 8 pods created:  median {_med(rs, 'seconds'):.3f} s of {a.repeat} "
              f"(operator CPU {_med(rs, 'cpu'):.2f} s; target < 5 s; backoffSeconds=0) ({_load()})", flush=True)
    if "many" in only:
        for i in range(a.repeat):
            r = many(a.profile, a.runs)
            print(f"{a.runs} LlamaPretrains (run {i + 1}): applied in {r['applied']:.2f} s; all pods after "
                  f"{r['pods']:.2f} s; all Starting after {r['total']:.2f} s (CPU: operator {r['cpu']:.1f} s, "
                  f"API server {r['kcpu']:.1f} s; the driver's watches reopened {r['reopened']} times)", flush=True)
            print(f"operator RSS: idle {r['idle']:.0f} MiB, peak {r['peak']:.0f} MiB, settled {r['settled']:.0f} MiB "
                  f"with {a.runs} runs  (target < 300 MiB for 2000) ({_load()})", flush=True)
    print(f"{_load()} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
