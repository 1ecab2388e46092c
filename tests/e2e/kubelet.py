"""A process-running kubelet for end-to-end tests (a test double, not a product feature).

It plays the node agents of a small cluster, either against kmockx (tests/kmockx) or against the real control
plane of ``support.cluster`` (a ``KubeCluster``):

- **Nodes**: creates ``Node`` objects (``node-0``, ``node-1``, ...). On the real cluster each node registers as a
  kubelet does, with its own identity (``system:node:<name>``, so the Node authorizer and NodeRestriction judge its
  writes), capacity (cpu, memory, ``nvidia.com/gpu``, EFA, hugepages) and a Lease in ``kube-node-lease`` renewed
  every :data:`HEARTBEAT_SECONDS`; :meth:`Kubelet.fail_node` stops the renewals and the node lifecycle controller
  turns the node ``Ready=Unknown`` after its grace period. On the double, tests flip ``Ready`` directly
  (:meth:`Kubelet.fail_node` / :meth:`Kubelet.restore_node`).
- **Scheduling** (the double only: on the real cluster kube-scheduler binds, and the double runs what is bound to
  its nodes): binds each new Pod of a LlamaPretrain (label ``kubetitan.io/name``) or of a Job (label
  ``batch.kubernetes.io/job-name``: the test plays the Job controller) to the ready node with
  the fewest live pods, honouring ``kubernetes.io/hostname NotIn`` node affinity (the planner's
  avoid-nodes rule) and a required pod anti-affinity on ``kubernetes.io/hostname`` (one pod of a gang per node: a
  pod with no free node stays Pending, unbound, until one is); gives it its own loopback address (127.0.0.2,
  127.0.0.3, ...) as ``status.podIP``.
- **Containers**: runs the pod's own ``command + args`` with its ``env`` as a local process, with
  ``python`` and the trainer image's interpreter (``contract.TRAINER_PYTHON``, an absolute path that exists only in
  the image) replaced by ``sys.executable``; a ``python [-s] -m MODULE`` container (the trainer's launcher) is forked
  from a warm parent that imported torch once (``tests/support/warm.py``; ``KUBETITAN_TEST_COLD_LAUNCH=1`` starts
  each cold). Env ``valueFrom.fieldRef`` is resolved like the downward API
  (``status.podIP``, ``status.hostIP``, ``spec.nodeName``, ``metadata.name``, ``metadata.namespace``,
  ``metadata.labels['k']``, ``metadata.annotations['k']``).
  Nothing is mounted: the ConfigMap mounted at ``/etc/kubetitan`` is written into a temp dir and
  ``--config=/etc/kubetitan/...`` is rewritten to it; a ``persistentVolumeClaim`` must be one the test
  registered (``claims={name: dir}``, a ReadWriteMany volume shared by every "node") and a ``hostPath`` its own
  directory, each mounted at that same path (so paths are the same inside and out); ``emptyDir`` volumes are
  ignored; anything else makes the pod wait with ``CreateContainerConfigError``, as a kubelet does when it
  cannot set a container up.
- **Names**: like a kubelet writes ``/etc/hosts`` for a pod, each process runs under
  ``unshare --mount --uts`` with its own hosts file bind-mounted on ``/etc/hosts`` and its hostname set to
  ``spec.hostname``; the file also lists the other pods of the same headless service (``subdomain``),
  standing in for cluster DNS, so ``<run>-a<N>-0.<run>.<ns>.svc`` resolves to rank 0's loopback address.
  (Where unshare is not permitted, ``--master-addr`` is rewritten to rank 0's address instead; see
  :data:`NAMESPACES`.)
- **Status**: reports phases and exit codes exactly like a kubelet: ``Pending`` + ``ContainerCreating``,
  ``Running`` + ``containerStatuses[].state.running``, then ``Succeeded``/``Failed`` with
  ``state.terminated.exitCode`` (128 + signal for a signal), ``reason`` (``Completed``, ``Error``,
  ``OOMKilled`` when :meth:`oom_kill` simulates it) and the log tail as ``message``
  (``terminationMessagePolicy: FallbackToLogsOnError``).
- **Deletion** (kmockx with ``graceful_pod_deletion``): SIGTERM to the container's main process, SIGKILL
  to every process of the pod after ``deletionGracePeriodSeconds``, report the final status, then remove the
  object with a grace-0 delete. A pod whose object disappears (force delete) is killed at once. A failed
  node's kubelet is dead: it neither reports nor deletes until :meth:`restore_node`, and then kills what
  the API no longer has, as a reconnecting kubelet does.

Two artefacts of sharing one network namespace, where real pods each have their own:

- rank 0's ``/metrics`` server binds ``[kubetitan] metrics_host`` (default ``0.0.0.0``), which would clash
  between the two pods of a gang: the materialised ``trainer.toml`` binds it to the pod's address instead;
- torch's TCPStore (the rendezvous on rank 0) binds every interface, so the processes of an old attempt
  still terminating would hold the next attempt's ``--master-port``: the double gives each rendezvous
  (``--rdzv-id``, one per attempt) its own free port and rewrites ``--master-port`` to it on every rank.

Workers started by torchrun run in their own sessions, so the double tracks every descendant of the
container's main process (from ``/proc``) and kills them all, like a container runtime killing a cgroup.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import tomli_w

from kmockx.harness import PODS, Cluster, free_port
from kubetitan_core import contract
from support import warm

INTERPRETERS = ("python", contract.TRAINER_PYTHON)
"""A container command's interpreter the double runs as ``sys.executable``: ``python`` (test pods) and the trainer
image's absolute one (the planner's pods)."""


def _module_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """(MODULE, its arguments) of ``sys.executable [-s] -m MODULE ...``, else None."""
    flags = argv[1:argv.index("-m")] if argv[:1] == [sys.executable] and "-m" in argv else None
    if flags is None or set(flags) - {"-s"} or len(argv) <= argv.index("-m") + 1:
        return None
    at = argv.index("-m")
    return argv[at + 1], argv[at + 2:]

LABEL_NAME = "kubetitan.io/name"
LABEL_JOB_NAME = "batch.kubernetes.io/job-name"
"""Pods of a Kubernetes Job (``kubetitan prepare-data --render-job``) carry it; the double runs those too."""
CONFIG_MOUNT = "/etc/kubetitan"
HEARTBEAT_SECONDS = 1.0
"""How often the double renews each live node's Lease (a kubelet's default is 10 s; the tests' clusters use a short
node grace period)."""
LOG_TAIL_BYTES = 2048  # the kubelet's FallbackToLogsOnError limit (2048 bytes or 80 lines)


def _probe_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NAMESPACES = _probe_namespaces()
"""True when each pod gets its own mount + UTS namespace (hosts file, hostname); False: --master-addr rewrite."""


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _api_away(e: BaseException) -> bool:
    """The API server is restarting or gone for a moment (refused connections, its 503 'apiserver is shutting down'):
    a kubelet tries again at its next sync, as the double does."""
    return isinstance(e, requests.ConnectionError) or getattr(e, "status", 0) in (502, 503, 504)


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(d))
    return out


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot; stat field 22): with the pid, it names one process.
    pid_max is 32768 here and the suites start thousands of processes, so pids are reused within a run."""
    st = _stat(pid)
    return int(st[19]) if st else None


def _alive(pid: int, start_time: int | None = None) -> bool:
    """A live (not zombie) process ``pid``; with ``start_time``, only the incarnation that started then."""
    st = _stat(pid)
    return st is not None and st[0] != "Z" and (start_time is None or int(st[19]) == start_time)


@dataclass
class PodProc:
    """One pod this kubelet runs (or ran)."""

    ns: str
    name: str
    node: str
    ip: str
    dir: Path
    state: str = "Bound"  # Bound -> Running -> Exited
    proc: subprocess.Popen | warm.WarmProcess | None = None
    pids: dict[int, int] = field(default_factory=dict)
    """Every process of the container seen so far: pid -> its start time (a reused pid is someone else's)."""
    started_at: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    term_sent: float | None = None
    oom: bool = False
    reported: bool = False
    labels: dict[str, str] = field(default_factory=dict)

    def live_pids(self) -> list[int]:
        return [p for p, start in self.pids.items() if _alive(p, start)]

    def signal(self, sig: int, main_only: bool = False) -> None:
        targets = [self.proc.pid] if main_only and self.proc else self.live_pids()
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class Kubelet:
    """Runs the pods of LlamaPretrains as local processes (see the module docstring)."""

    def __init__(self, cluster: Cluster, workdir: Path, nodes: int = 2, poll: float = 0.1,
                 claims: dict[str, Path] | None = None, run_as_pod_user: bool = False,
                 fs_group_policy: str = "File", ledger: bool = False, node_prefix: str = "node-") -> None:
        """``run_as_pod_user`` (needs root): run each container as its pod's ``securityContext`` user, group and
        ``fsGroup`` and apply ``fsGroup`` to volumes as a kubelet does: claims get it when ``fs_group_policy`` is
        ``File`` (a CSI driver's ``fsGroupPolicy``; ``None`` models FSx's default for ReadWriteMany claims),
        ``fsGroupChangePolicy: OnRootMismatch`` only when the root's group or mode is wrong; hostPath never,
        and a missing ``DirectoryOrCreate`` hostPath is created ``root:root 0755``. ``ledger``: turn every rank's
        sample ledger on in the materialised trainer.toml (``[kubetitan.data] ledger``, a test-only key).
        ``node_prefix``: the nodes' names (``<prefix>0``, ...; a real cluster shared by several tests needs its own)."""
        self.run_as_pod_user, self.fs_group_policy, self.ledger = run_as_pod_user, fs_group_policy, ledger
        if getattr(cluster, "k", None) is not None:
            cluster.k.graceful_pod_deletion = True  # the double's opt-in; a real API server always does it
        self.c, self.workdir, self.poll = cluster, Path(workdir), poll
        self.nodes = [f"{node_prefix}{i}" for i in range(nodes)]
        self.claims = {k: str(v) for k, v in (claims or {}).items()}
        self.dead: set[str] = set()
        self.pods: dict[tuple[str, str], PodProc] = {}
        self.ips: dict[str, str] = {}  # pod key "ns/name" -> ip, never reused within a kubelet
        self._next_ip = 2
        self.exits: dict[tuple[str, str], tuple[int, str]] = {}  # (ns, pod) -> (exit code, reason), kept
        self.rdzv_ports: dict[str, int] = {}  # --rdzv-id -> the port its rank 0 listens on
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="e2e-kubelet")
        self.errors: list[BaseException] = []
        self.env: dict[str, str] = {}
        """Extra environment of every container started from now on (e.g. ``support.hold.env``: hold the trainers
        after chosen steps)."""
        self.heartbeat_thread = threading.Thread(target=self._heartbeats, daemon=True, name="e2e-kubelet-leases")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Kubelet:
        for n in self.nodes:
            self.c.add_node(n)
        self.thread.start()
        if self.c.schedules:
            self.heartbeat_thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.thread.join(10)
        if self.heartbeat_thread.is_alive():
            self.heartbeat_thread.join(10)
        self.kill_all()
        if self.c.schedules:  # a shared real cluster: no node of this kubelet may take a later test's pods
            for n in self.nodes:
                self.c.delete("v1/nodes", None, n)

    def kill_all(self) -> None:
        with self.lock:
            for p in self.pods.values():
                p.signal(signal.SIGKILL)
            for p in self.pods.values():
                if p.proc is not None:
                    try:
                        p.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        pass

    # ------------------------------------------------------------------ faults and queries for tests
    def proc(self, ns: str, name: str) -> PodProc:
        with self.lock:
            return self.pods[(ns, name)]

    def worker_pids(self, ns: str, name: str) -> list[int]:
        """Live processes of the pod other than the container's main one (torchrun's workers)."""
        p = self.proc(ns, name)
        self._refresh(p)
        return sorted(x for x in p.live_pids() if p.proc is None or x != p.proc.pid)

    def kill(self, ns: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of the pod (a crash of the whole container)."""
        p = self.proc(ns, name)
        self._refresh(p)
        p.signal(sig)

    def kill_workers(self, ns: str, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to the pod's workers only (a training process crashing while its launcher, the container's
        main process, lives on); returns their pids."""
        pids = self.worker_pids(ns, name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def freeze(self, ns: str, name: str) -> list[int]:
        """SIGSTOP the pod's workers (a hung training process); returns their pids."""
        pids = self.worker_pids(ns, name)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def oom_kill(self, ns: str, name: str) -> None:
        """Simulate the kernel's OOM killer: SIGKILL, reported as ``OOMKilled`` with exit code 137."""
        p = self.proc(ns, name)
        p.oom = True
        self.kill(ns, name)

    def fail_node(self, node: str) -> None:
        """The node stops reporting: its kubelet is dead, its processes freeze (no RST), and it turns Ready=Unknown
        (at once on the double; on a real cluster the node lifecycle controller does it once the node's Lease has
        not been renewed for the grace period)."""
        with self.lock:
            self.dead.add(node)
            for p in self.pods.values():
                if p.node == node:
                    self._refresh(p)
                    p.signal(signal.SIGSTOP)
        if not self.c.schedules:
            self.c.set_node_ready(node, False)

    def crash_node_processes(self, node: str) -> None:
        """The failed machine's processes are gone for good (SIGKILL); the API is not told."""
        with self.lock:
            for p in self.pods.values():
                if p.node == node:
                    p.signal(signal.SIGKILL)

    def restore_node(self, node: str) -> None:
        with self.lock:
            self.dead.discard(node)
        self.c.set_node_ready(node, True)

    def replace_node(self, node: str) -> str:
        """The failed machine is replaced, as the cluster autoscaler or HyperPod's node recovery does: its processes
        are gone (SIGKILL), its Node object is deleted, and a new node (the next free ``<prefix><n>`` name) registers
        in its place. Returns the new node's name."""
        self.crash_node_processes(node)
        prefix = node.rstrip("0123456789")
        with self.lock:
            new = f"{prefix}{max(int(n[len(prefix):]) for n in [*self.nodes, node] if n.startswith(prefix)) + 1}"
            self.nodes = [n for n in self.nodes if n != node] + [new]
            self.dead.add(node)
        self.c.delete("v1/nodes", None, node)
        self.c.add_node(new)
        return new

    def force_delete(self, ns: str, name: str) -> None:
        """``kubectl delete pod --grace-period=0 --force``."""
        self.c.force_delete(ns, name)

    def live_processes(self) -> list[int]:
        with self.lock:
            return sorted(pid for p in self.pods.values() for pid in p.live_pids())

    def log(self, ns: str, name: str) -> str:
        path = self.workdir / ns / name / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------------ the sync loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - surfaced to the test through .errors
                if not _api_away(e):
                    self.errors.append(e)
            self._stop.wait(self.poll)

    def _heartbeats(self) -> None:
        """Renew the Lease of every live node every :data:`HEARTBEAT_SECONDS`, on a thread of its own as a kubelet's
        node lease controller runs: a slow pod start in the sync loop never makes a node look dead."""
        while not self._stop.wait(HEARTBEAT_SECONDS):
            for n in self.nodes:
                if n in self.dead:
                    continue
                try:
                    self.c.renew_node(n)
                except Exception as e:  # noqa: BLE001 - surfaced to the test through .errors
                    if not _api_away(e):
                        self.errors.append(e)

    def sync(self) -> None:
        pods = {(p["metadata"].get("namespace"), p["metadata"]["name"]): p for p in self.c.list(PODS)
                if {LABEL_NAME, LABEL_JOB_NAME} & set(p["metadata"].get("labels") or {})}
        with self.lock:
            for key, pp in list(self.pods.items()):
                if key not in pods and pp.node not in self.dead:
                    pp.signal(signal.SIGKILL)  # the object is gone (force delete): kill at once
                    if pp.proc is not None:
                        pp.proc.poll()
                    if not pp.live_pids():
                        del self.pods[key]
            for key, pod in sorted(pods.items()):
                if key in self.pods or pod["metadata"].get("deletionTimestamp"):
                    continue
                node = pod["spec"].get("nodeName")
                if self.c.schedules:  # the real scheduler bound it: run it if it is one of ours
                    if node in self.nodes and node not in self.dead:
                        self._adopt(pod, node)
                elif not node:
                    self._bind(pod)
            for key, pod in sorted(pods.items()):
                pp = self.pods.get(key)
                if pp is None or pp.node in self.dead:
                    continue
                self._sync_pod(pp, pod)

    # ------------------------------------------------------------------ one pod
    def _bind(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        avoid = set()
        for term in (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []:
            for e in term.get("matchExpressions") or []:
                if e.get("key") == "kubernetes.io/hostname" and e.get("operator") == "NotIn":
                    avoid |= set(e.get("values") or [])
        load = {n: 0 for n in self.nodes if n not in self.dead and n not in avoid}
        for term in ((spec.get("affinity") or {}).get("podAntiAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution") or []:
            if term.get("topologyKey") != "kubernetes.io/hostname":
                continue
            want = (term.get("labelSelector") or {}).get("matchLabels") or {}
            for p in self.pods.values():  # one pod per node: a node with a live matching pod is taken
                if p.state != "Exited" and all(p.labels.get(k) == v for k, v in want.items()):
                    load.pop(p.node, None)
        if not load:
            return  # stays Pending (no schedulable node)
        for p in self.pods.values():
            if p.node in load and p.state != "Exited":
                load[p.node] += 1
        node = min(load, key=lambda n: (load[n], n))
        self.c.patch(PODS, meta.get("namespace", "default"), meta["name"], {"spec": {"nodeName": node}})
        self._adopt(pod, node)

    def _adopt(self, pod: dict[str, Any], node: str) -> None:
        """A pod bound to ``node``: give it an address and report it Pending (ContainerCreating)."""
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        ip = self.ips.setdefault(f"{ns}/{name}", f"127.0.0.{self._next_ip}")
        if ip == f"127.0.0.{self._next_ip}":
            self._next_ip += 1
        d = self.workdir / ns / name
        d.mkdir(parents=True, exist_ok=True)
        self.pods[(ns, name)] = PodProc(ns=ns, name=name, node=node, ip=ip, dir=d, labels=dict(meta.get("labels") or {}))
        self.c.patch_pod_status(ns, name, {
            "phase": "Pending", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip, "hostIPs": [{"ip": ip}],
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now_iso()}],
            "containerStatuses": [self._cstatus(spec, {"waiting": {"reason": "ContainerCreating"}})]}, node)
        self._write_hosts()

    @staticmethod
    def _cstatus(spec: dict[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
        c = spec["containers"][0]
        return {"name": c["name"], "image": c.get("image", ""), "ready": ready, "restartCount": 0, "state": state}

    def _sync_pod(self, pp: PodProc, pod: dict[str, Any]) -> None:
        deleting = pod["metadata"].get("deletionTimestamp") is not None
        if pp.state == "Bound":
            if deleting:
                pp.state, pp.exit_code, pp.reason = "Exited", None, None
            else:
                self._start(pp, pod)
        if pp.state == "Running":
            self._refresh(pp)
            assert pp.proc is not None
            code = pp.proc.poll()
            if deleting:
                grace = int(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
                if pp.term_sent is None:
                    pp.term_sent = time.monotonic()
                    pp.signal(signal.SIGTERM, main_only=True)  # the container's main process
                elif time.monotonic() - pp.term_sent >= grace:
                    pp.signal(signal.SIGKILL)
            if code is not None:
                pp.signal(signal.SIGKILL)  # the main process is gone: the runtime kills the rest
                pp.state = "Exited"
                pp.exit_code = 128 - code if code < 0 else code
                pp.reason = "OOMKilled" if pp.oom else ("Completed" if pp.exit_code == 0 else "Error")
                self.exits[(pp.ns, pp.name)] = (pp.exit_code, pp.reason)
        if pp.state == "Exited" and not pp.reported:
            if pp.exit_code is not None:
                self._report_exit(pp, pod)  # raises while the API server is away: reported at a later sync
            pp.reported = True
        if pp.state == "Exited" and deleting and not pp.live_pids():
            self.c.delete_now(pp.ns, pp.name, pp.node)  # the kubelet's final grace-0 delete

    def _refresh(self, pp: PodProc) -> None:
        """Track every descendant of the main process (workers start their own sessions)."""
        if pp.proc is None:
            return
        kids = _children_map()
        todo = pp.live_pids()
        seen = set(todo)
        while todo:
            pid = todo.pop()
            for k in kids.get(pid, []):  # a child of a live process of ours is ours, whatever its pid was before
                if k not in seen and (start := _start_time(k)) is not None:
                    pp.pids[k] = start
                    seen.add(k)
                    todo.append(k)

    def _report_exit(self, pp: PodProc, pod: dict[str, Any]) -> None:
        code = pp.exit_code
        term: dict[str, Any] = {"exitCode": code, "reason": pp.reason, "startedAt": pp.started_at,
                                "finishedAt": _now_iso(), "containerID": f"e2e://{pp.proc.pid if pp.proc else 0}"}
        if code != 0:
            tail = self.log(pp.ns, pp.name)[-LOG_TAIL_BYTES:]
            if tail:
                term["message"] = tail
        self.c.patch_pod_status(pp.ns, pp.name, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "False", "reason": "PodCompleted"}],
            "containerStatuses": [self._cstatus(pod["spec"], {"terminated": term})]}, pp.node)

    # ------------------------------------------------------------------ starting a container
    def _start(self, pp: PodProc, pod: dict[str, Any]) -> None:
        spec = pod["spec"]
        c = spec["containers"][0]
        try:
            env = self._env(pod, pp)
            argv = self._argv(pod, pp, c)
        except ValueError as e:
            self.c.patch_pod_status(pp.ns, pp.name, {"containerStatuses": [self._cstatus(spec, {
                "waiting": {"reason": "CreateContainerConfigError", "message": str(e)}})]}, pp.node)
            return
        ids = self._pod_user(pp, spec) if self.run_as_pod_user else None
        if ids is not None:
            uid, gid, groups = ids
            home = pp.dir / "home"  # the image's home directory, writable by its user
            home.mkdir(exist_ok=True)
            os.chown(home, uid, gid)
            # What the trainer image provides for its user: a passwd entry (getpass.getuser() reads LOGNAME/USER
            # first; this machine has no entry for the uid) and its ENV cache directories, owned by that user.
            env.update(HOME=str(home), USER="kubetitan", LOGNAME="kubetitan", HF_HOME=str(home / "huggingface"),
                       TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"), TRITON_CACHE_DIR=str(home / "triton"))
            # ... and a PATH its user can search (root's home dirs here are not: a lookup there is EACCES, which
            # torchtitan's lspci probe does not expect).
            env["PATH"] = ":".join(d for d in env.get("PATH", "").split(":") if d != "/root" and not d.startswith("/root/"))
            # Drop to the pod's user after the (root-only) mount and hostname, like a runtime entering the container.
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                    f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--", *argv]
        hosts = (pp.dir / "hosts", spec.get("hostname") or pp.name) if NAMESPACES else None
        if ids is None and (module := _module_call(argv)) is not None:
            # python [-s] -m MODULE: forked from a warm parent that imported torch once (tests/support/warm.py); the
            # parent's site is set up already, and the pod's PYTHONNOUSERSITE reaches every Python the child starts
            pp.proc = warm.popen(module[0], module[1], env, pp.dir / "container.log", cwd=pp.dir, new_session=True,
                                 namespaces=hosts)
        else:
            if hosts is not None:
                script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
                argv = ["unshare", "--mount", "--uts", "--", "sh", "-c", script, "kubelet", str(hosts[0]), hosts[1],
                        *argv]
            log = open(pp.dir / "container.log", "ab")
            pp.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, cwd=str(pp.dir))
            log.close()
        pp.pids = {pp.proc.pid: _start_time(pp.proc.pid) or 0}
        pp.state, pp.started_at = "Running", _now_iso()
        self.c.patch_pod_status(pp.ns, pp.name, {
            "phase": "Running", "startTime": pp.started_at,
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                           {"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "True"}],
            "containerStatuses": [self._cstatus(spec, {"running": {"startedAt": pp.started_at}}, True)]}, pp.node)

    def _pod_user(self, pp: PodProc, spec: dict[str, Any]) -> tuple[int, int, list[int]] | None:
        """(uid, gid, supplementary groups) of the pod's securityContext (container level wins), else None."""
        sc = {**(spec.get("securityContext") or {}), **(spec["containers"][0].get("securityContext") or {})}
        if "runAsUser" not in sc:
            return None
        if os.geteuid() != 0:
            raise RuntimeError("run_as_pod_user needs the tests to run as root")
        uid = int(sc["runAsUser"])
        groups = [int(sc["fsGroup"])] if "fsGroup" in (spec.get("securityContext") or {}) else []
        return uid, int(sc.get("runAsGroup", uid)), groups

    def _env(self, pod: dict[str, Any], pp: PodProc) -> dict[str, str]:
        c = pod["spec"]["containers"][0]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KUBETITAN_", "PYTEST_", "MASTER_", "TORCHELASTIC_")) and k not in (
                   "RANK", "LOCAL_RANK", "WORLD_SIZE", "KUBECONFIG")}
        # One CPU thread per process unless the pod asks otherwise: the gang shares two cores.
        env.update(HOSTNAME=spec_hostname(pod), OMP_NUM_THREADS="1", **self.env)
        fields = {"status.podIP": pp.ip, "status.hostIP": pp.ip, "spec.nodeName": pp.node,
                  "metadata.name": pp.name, "metadata.namespace": pp.ns}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif (ref := (e.get("valueFrom") or {}).get("fieldRef")) is not None:
                if (m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", ref.get("fieldPath", ""))):
                    env[e["name"]] = str((pod["metadata"].get(m.group(1)) or {}).get(m.group(2), ""))
                    continue  # the downward API: a missing key is the empty string
                if ref.get("fieldPath") not in fields:
                    raise ValueError(f"env {e['name']}: fieldRef {ref.get('fieldPath')} is not supported")
                env[e["name"]] = fields[ref["fieldPath"]]
            else:
                raise ValueError(f"env {e['name']}: only value and fieldRef are supported by the e2e kubelet")
        return env

    def _argv(self, pod: dict[str, Any], pp: PodProc, c: dict[str, Any]) -> list[str]:
        spec = pod["spec"]
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        config_dir = None
        for m in c.get("volumeMounts") or []:
            v = vols.get(m["name"], {})
            if "configMap" in v and m["mountPath"] == CONFIG_MOUNT:
                config_dir = self._materialise(pp, v["configMap"]["name"])
            elif "hostPath" in v or "persistentVolumeClaim" in v:
                if "hostPath" in v:
                    path = v["hostPath"]["path"]
                elif (path := self.claims.get(v["persistentVolumeClaim"]["claimName"])) is None:
                    raise ValueError(f"persistentvolumeclaim {v['persistentVolumeClaim']['claimName']!r} not found")
                if path != m["mountPath"]:
                    raise ValueError(f"volume {m['name']}: {path} must be mounted at the same path, not at "
                                     f"{m['mountPath']} (the e2e kubelet mounts nothing)")
                Path(path).mkdir(parents=True, exist_ok=True)
                fs_group = (spec.get("securityContext") or {}).get("fsGroup")
                if (self.run_as_pod_user and fs_group is not None and "persistentVolumeClaim" in v
                        and self.fs_group_policy == "File"):
                    _apply_fs_group(Path(path), int(fs_group),
                                    (spec.get("securityContext") or {}).get("fsGroupChangePolicy", "Always"))
            elif "emptyDir" not in v:
                raise ValueError(f"volume {m['name']}: only configMap, hostPath, persistentVolumeClaim and emptyDir are supported")
        command = list(c.get("command") or [])
        argv = [sys.executable if i == 0 and x in INTERPRETERS else x for i, x in enumerate(command)]
        rdzv = next((a.split("=", 1)[1] for a in c.get("args") or [] if a.startswith("--rdzv-id=")), pp.name)
        for a in c.get("args") or []:
            if a.startswith("--master-port="):  # see the module docstring
                a = f"--master-port={self.rdzv_ports.setdefault(rdzv, free_port())}"
            if a.startswith(f"--config={CONFIG_MOUNT}/") and config_dir is not None:
                a = f"--config={config_dir}/{a.split('/')[-1]}"
            if a.startswith("--master-addr=") and not NAMESPACES:
                a = f"--master-addr={self._resolve(pp.ns, a.split('=', 1)[1]) or a.split('=', 1)[1]}"
            argv.append(a)
        return argv

    def _materialise(self, pp: PodProc, cm_name: str) -> Path:
        cm = self.c.get("v1/configmaps", pp.ns, cm_name)
        if cm is None:
            raise ValueError(f"configmap {cm_name!r} not found")
        d = pp.dir / "etc-kubetitan"
        d.mkdir(exist_ok=True)
        for key, text in (cm.get("data") or {}).items():
            if key.endswith(".toml"):
                cfg = tomllib.loads(text)
                if "kubetitan" in cfg:  # see the module docstring: one shared network namespace
                    cfg["kubetitan"]["metrics_host"] = pp.ip
                    if self.ledger:
                        cfg["kubetitan"].setdefault("data", {})["ledger"] = True
                text = tomli_w.dumps(cfg)
            (d / key).write_text(text)
        return d

    # ------------------------------------------------------------------ names
    def _names(self, ns: str, pod: dict[str, Any]) -> list[str]:
        spec = pod["spec"]
        host = spec.get("hostname") or pod["metadata"]["name"]
        if not spec.get("subdomain"):
            return [host]
        fq = f"{host}.{spec['subdomain']}.{ns}.svc"
        return [f"{fq}.cluster.local", fq, host]

    def _resolve(self, ns: str, hostname: str) -> str | None:
        for (pns, name), pp in self.pods.items():
            pod = self.c.get(PODS, pns, name)
            if pod is not None and pns == ns and hostname in self._names(pns, pod):
                return pp.ip
        return None

    def _write_hosts(self) -> None:
        entries = []
        for (ns, name), pp in self.pods.items():
            pod = self.c.get(PODS, ns, name)
            if pod is not None and pp.state != "Exited":
                entries.append((ns, pod["spec"].get("subdomain"), pp.ip, self._names(ns, pod)))
        for (ns, name), pp in self.pods.items():
            pod = self.c.get(PODS, ns, name)
            if pod is None:
                continue
            lines = ["# Kubernetes-managed hosts file (kubetitan e2e kubelet).", "127.0.0.1\tlocalhost",
                     "::1\tlocalhost ip6-localhost ip6-loopback", f"{pp.ip}\t{' '.join(self._names(ns, pod))}",
                     "# the headless service's other pods (cluster DNS stand-in)"]
            lines += [f"{ip}\t{' '.join(names)}" for ens, sub, ip, names in entries
                      if ens == ns and sub and sub == pod["spec"].get("subdomain") and ip != pp.ip]
            path = pp.dir / "hosts"
            # Rewrite in place: the bind mount follows the inode, so running pods see new peers.
            with open(path, "a+") as f:
                f.seek(0)
                f.truncate()
                f.write("\n".join(lines) + "\n")


def _apply_fs_group(root: Path, gid: int, change_policy: str) -> None:
    """What the kubelet does for ``fsGroup`` on a volume that supports ownership management: every file gets group
    ``gid`` and group read/write, directories also group execute and the setgid bit (new files inherit the group).
    ``OnRootMismatch`` skips the walk when the root already has that group and those permission bits."""
    want = stat.S_IRWXG | stat.S_ISGID
    st = root.stat()
    if change_policy == "OnRootMismatch" and st.st_gid == gid and st.st_mode & want == want:
        return
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, -1, gid)
        mode = path.stat().st_mode
        extra = stat.S_IRGRP | stat.S_IWGRP | ((stat.S_IXGRP | stat.S_ISGID) if path.is_dir() else 0)
        os.chmod(path, stat.S_IMODE(mode) | extra)


def spec_hostname(pod: dict[str, Any]) -> str:
    return pod["spec"].get("hostname") or pod["metadata"]["name"]

