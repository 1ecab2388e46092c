"""A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-controller-manager and kube-scheduler,
built from their Go modules (``tests/cluster/go.mod``, ``make cluster``) into ``.tools/bin``.

What controller-runtime's envtest gives Go operators, with the controller-manager and the scheduler as well:

- **etcd** on loopback (a data dir of its own, ``--unsafe-no-fsync``: a test cluster's data is thrown away).
- **kube-apiserver** on ``127.0.0.1`` with generated certificates (one CA for serving and client certificates),
  service-account tokens (an RSA signing key), ``Node,RBAC`` authorization, the default admission chain plus
  ``NodeRestriction`` (PodSecurity, ResourceQuota, ServiceAccount, ValidatingAdmissionWebhook, ... are on by default),
  and the ``GenericWorkload`` gate with ``scheduling.k8s.io/v1beta1`` served (PodGroups: gang scheduling).
- **kube-controller-manager**: every default controller (garbage collector, namespace, resource quota, pod GC,
  node lifecycle, service-account tokens, deployments, ...) with per-controller service-account credentials and a
  short node grace period (``node_grace_seconds``), so a node that stops renewing its Lease turns NotReady in
  seconds, not in the default 50.
- **kube-scheduler** with its default profile (the gang-scheduling plugin on, by the gate).

Users (client certificates signed by the cluster's CA): ``admin`` (``system:masters``), the controller-manager and
the scheduler as their bootstrap identities, a node agent per node (``system:node:<name>``), and any tenant a test
names (:meth:`ControlPlane.user`). The operator authenticates as the chart's ServiceAccount with a token from the
TokenRequest API (:meth:`ControlPlane.service_account_kubeconfig`), so the chart's RBAC is exactly what it has.

Run it by hand (``make cluster-up``, or ``python -m support.cluster`` with ``tests`` on ``PYTHONPATH``): it prints
the admin kubeconfig's path and stays up until Ctrl-C; point ``kubectl``/``helm`` at it with ``KUBECONFIG``.

Nothing outside the cluster's own temporary directory is written, and only the processes it started are stopped
(by their pids).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import urllib3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kmockx import harness
from support.paths import REPO
from support.procs import die_with_parent
from support.runs import RunQueries

BIN = REPO / ".tools" / "bin"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
GO_MOD = REPO / "tests" / "cluster" / "go.mod"
FLOOR_GO_MOD = REPO / "tests" / "cluster" / "floor" / "go.mod"
FLOOR_BIN = REPO / ".tools" / "floor" / "bin"
"""The kube-apiserver of the oldest Kubernetes minor the CRD is checked on (``make cluster`` builds it from
:data:`FLOOR_GO_MOD`)."""
FEATURE_GATES = {"GenericWorkload": True}
"""Gates the control plane runs with (apiserver, controller-manager, scheduler alike)."""
RUNTIME_CONFIG = ("scheduling.k8s.io/v1beta1=true",)
"""Beta API groups the server serves besides its defaults (PodGroups and Workloads)."""
SERVICE_CIDR = "10.96.0.0/16"
"""Service ClusterIPs are allocated from it; nothing routes to them (no kube-proxy): the tests reach pods directly."""
ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDITED_VERBS = ["create", "update", "patch", "delete", "deletecollection"]
STARTS_KEY = pytest.StashKey[list]()
"""Where a test session without xdist keeps the control plane's start line (tests/conftest.py prints it)."""


_NODE_CERTS = threading.Lock()
"""Held while a node's certificate is looked for and issued: the kubelet double's threads of a node that just joined
(registration, Lease renewals, pod status) ask for it at once, and one found the certificate written before its key
("Could not find the TLS key file": `make test` at 01737dd, the elastic scenario's replacement node)."""
POLL_SECONDS = 0.2
"""How often a real-cluster test re-reads what it waits for: each read is a request to the API server, and the
events waited for take seconds (the double's tests poll every 20 ms, which here cost more API server CPU than the
scenario itself)."""


def wait_for(pred: Any, timeout: float = 10.0, what: str = "condition", every: float = POLL_SECONDS) -> Any:
    """:func:`kmockx.harness.wait_for` at the real cluster's pace."""
    return harness.wait_for(pred, timeout, what, every)


def kubernetes_version(go_mod: Path = GO_MOD) -> str:
    """The Kubernetes version ``go_mod`` pins (what ``make cluster`` builds from it)."""
    m = re.search(r"^require k8s\.io/kubernetes (v\S+)", go_mod.read_text(), re.M)
    assert m, f"{go_mod}: no 'require k8s.io/kubernetes vX.Y.Z' line"
    return m.group(1)


def missing_binaries(bin_dir: Path = BIN, components: tuple[str, ...] = COMPONENTS) -> list[str]:
    return [c for c in components if not os.access(bin_dir / c, os.X_OK)]


def _free_port() -> int:
    from kmockx.harness import free_port  # this process's port block (xdist workers never collide)

    return free_port()


# ---------------------------------------------------------------------------------------------------- certificates
def _pem_key(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Pki:
    """One CA; serving and client certificates signed by it, written as PEM files under ``dir``."""

    dir: Path
    ca_key: Any = None
    ca_cert: Any = None

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubetitan-test-ca")])
        now = dt.datetime.now(dt.timezone.utc)
        self.ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                        .public_key(self.ca_key.public_key()).serial_number(x509.random_serial_number())
                        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
                        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                     content_commitment=False, key_encipherment=False,
                                                     data_encipherment=False, key_agreement=False,
                                                     encipher_only=False, decipher_only=False), critical=True)
                        .sign(self.ca_key, hashes.SHA256()))
        (self.dir / "ca.crt").write_bytes(self.ca_cert.public_bytes(serialization.Encoding.PEM))

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.crt"

    def issue(self, name: str, cn: str, orgs: tuple[str, ...] = (), server_names: tuple[str, ...] = (),
              client: bool = True) -> tuple[Path, Path]:
        """A key and certificate ``<name>.crt``/``<name>.key``: CN = user, O = groups; ``server_names`` (DNS names
        or IP addresses) make it a serving certificate too."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                             *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs)])
        now = dt.datetime.now(dt.timezone.utc)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + (
            [ExtendedKeyUsageOID.SERVER_AUTH] if server_names else [])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if server_names:
            sans: list[x509.GeneralName] = []
            for n in server_names:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(n)))
                except ValueError:
                    sans.append(x509.DNSName(n))
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self.ca_key, hashes.SHA256())
        crt, keyf = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        keyf.write_bytes(_pem_key(key))
        keyf.chmod(0o600)
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))  # after its key: node_api looks for this one
        return crt, keyf

    def service_account_keys(self) -> tuple[Path, Path]:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        priv, pub = self.dir / "sa.key", self.dir / "sa.pub"
        priv.write_bytes(_pem_key(key))
        priv.chmod(0o600)
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
        return priv, pub


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, *, cert: Path | None = None,
                     key: Path | None = None, token: str | None = None, namespace: str = "default") -> Path:
    creds: dict[str, str] = {"token": token} if token else {"client-certificate": str(cert), "client-key": str(key)}
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "kubetitan-test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": user, "context": {"cluster": "kubetitan-test", "user": user, "namespace": namespace}}],
    }, indent=1))
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------------------------------------- REST client
_CLUSTER_SCOPED = {"nodes", "namespaces", "persistentvolumes", "customresourcedefinitions", "clusterroles",
                   "clusterrolebindings", "validatingwebhookconfigurations", "mutatingwebhookconfigurations",
                   "priorityclasses", "storageclasses", "apiservices", "selfsubjectaccessreviews",
                   "subjectaccessreviews", "selfsubjectreviews", "tokenreviews", "runtimeclasses"}


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any] | str) -> None:
        self.status, self.body = status, body
        msg = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {msg}")

    @property
    def reason(self) -> str:
        return self.body.get("reason", "") if isinstance(self.body, dict) else ""


def resource_path(resource: str, ns: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    """``"v1/pods"`` or ``"kubetitan.io/v1alpha1/llamapretrains"`` (the double's spelling) as a URL path."""
    parts = resource.split("/")
    plural = parts[-1]
    base = "/api/" + parts[0] if len(parts) == 2 else "/apis/" + "/".join(parts[:2])
    path = base + (f"/namespaces/{ns}" if ns and plural not in _CLUSTER_SCOPED else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Api:
    """A small synchronous client of the real API server for tests (one identity). Helpers mirror the API double's
    test helpers (``get``/``list``/``patch``/``delete``), so test code and the kubelet double run on either."""

    def __init__(self, server: str, ca_file: Path, cert: tuple[Path, Path] | None = None,
                 token: str | None = None) -> None:
        self.server = server
        self.s = requests.Session()
        self.s.trust_env = False  # REQUESTS_CA_BUNDLE would replace the cluster's CA (requests merges it over verify)
        self.s.verify = str(ca_file)
        if cert:
            self.s.cert = (str(cert[0]), str(cert[1]))
        if token:
            self.s.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 30.0, ok404: bool = False) -> Any:
        data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        r = self.s.request(method, self.server + path, data=data, params=params, timeout=timeout,
                           headers={"Content-Type": content_type} if data is not None else None)
        if r.status_code == 404 and ok404:
            return None
        if r.status_code >= 400:
            try:
                err: dict[str, Any] | str = r.json()
            except ValueError:
                err = r.text
            raise ApiError(r.status_code, err)
        return r.json() if r.content else None

    # -- the double's helper spelling
    def get(self, resource: str, ns: str | None, name: str, sub: str | None = None) -> dict[str, Any] | None:
        return self.request("GET", resource_path(resource, ns, name, sub), ok404=True)

    def list(self, resource: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        return self.request("GET", resource_path(resource, ns), params=params)["items"]

    def create(self, resource: str, ns: str | None, obj: dict[str, Any], **params: Any) -> dict[str, Any]:
        return self.request("POST", resource_path(resource, ns), obj, params=params or None)

    def patch(self, resource: str, ns: str | None, name: str, patch: dict[str, Any], subresource: str | None = None,
              kind: str = "merge") -> dict[str, Any]:
        ct = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
              "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", resource_path(resource, ns, name, subresource), patch, content_type=ct)

    def apply(self, resource: str, ns: str | None, obj: dict[str, Any], manager: str = "kubetitan-tests",
              force: bool = True) -> dict[str, Any]:
        """Server-side apply."""
        return self.request("PATCH", resource_path(resource, ns, obj["metadata"]["name"]), obj,
                            content_type="application/apply-patch+yaml",
                            params={"fieldManager": manager, "force": "true" if force else "false"})

    def delete(self, resource: str, ns: str | None, name: str, grace: int | None = None,
               propagation: str | None = None) -> None:
        body: dict[str, Any] = {}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if propagation:
            body["propagationPolicy"] = propagation
        self.request("DELETE", resource_path(resource, ns, name), body or None, ok404=True)

    def ensure_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        with contextlib.suppress(ApiError):
            self.create("v1/namespaces", None, {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": name, "labels": labels or {}}})


# ---------------------------------------------------------------------------------------------------- processes
@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    args: list[str] = field(default_factory=list)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback (see the module docstring)."""

    workdir: Path | None = None
    bin_dir: Path = BIN
    node_grace_seconds: int = 10
    """kube-controller-manager's ``--node-monitor-grace-period``: a node whose Lease and status have not been
    renewed for this long is marked ``Ready=Unknown``."""
    controllers: str = "*"
    scheduler: bool = True
    feature_gates: dict[str, bool] = field(default_factory=lambda: dict(FEATURE_GATES))
    audit: bool = True
    """Write an audit log of every write (Metadata level: who, what, the answer), read by :meth:`audit_events`."""
    apiserver_only: bool = False
    """etcd and kube-apiserver alone (no controller-manager, no scheduler): what the API's own checks need."""
    runtime_config: tuple[str, ...] = RUNTIME_CONFIG
    apiserver_bin: Path | None = None
    """Another kube-apiserver binary than ``bin_dir``'s (the floor's, :data:`FLOOR_BIN`)."""
    components: dict[str, Component] = field(default_factory=dict)
    _tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    _own_dir: bool = False

    # -- lifecycle
    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        wanted = ("etcd",) + (("kube-apiserver",) if self.apiserver_bin is None else ()) + (
            () if self.apiserver_only else ("kube-controller-manager", "kube-scheduler"))
        missing = missing_binaries(self.bin_dir, wanted)
        if self.apiserver_bin is not None and not os.access(self.apiserver_bin, os.X_OK):
            missing.append(str(self.apiserver_bin))
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)} in {self.bin_dir}: run `make cluster` (builds them "
                               f"from tests/cluster/go.mod)")
        t0 = time.monotonic()
        if self.workdir is None:
            self.workdir, self._own_dir = Path(tempfile.mkdtemp(prefix="kubetitan-cluster-")), True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = Pki(self.workdir / "pki")
        self.sa_key, self.sa_pub = self.pki.service_account_keys()
        self.port = _free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        serving = self.pki.issue("apiserver", "kube-apiserver", client=False, server_names=(
            "127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local", "10.96.0.1"))
        self.admin_cert = self.pki.issue("admin", "kubetitan-admin", ("system:masters",))
        self.admin_kubeconfig = self._kubeconfig("admin", self.admin_cert)
        self._start_etcd()
        self.timings["etcd"] = time.monotonic() - t0
        self._start_apiserver(serving)
        self.timings["kube-apiserver"] = time.monotonic() - t0
        self.admin = Api(self.server, self.pki.ca_file, cert=self.admin_cert)
        if self.apiserver_only:
            self.timings["ready"] = time.monotonic() - t0
            return
        self._start_controller_manager()
        if self.scheduler:
            self._start_scheduler()
        self._wait_default_service_account()
        self.timings["ready"] = time.monotonic() - t0

    def stop(self) -> None:
        for name in reversed(list(self.components)):
            c = self.components.pop(name)
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(10)
        if self._own_dir and self.workdir is not None and not os.environ.get("KUBETITAN_KEEP_CLUSTER_DIR"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- users
    def _kubeconfig(self, user: str, cert: tuple[Path, Path], namespace: str = "default") -> Path:
        assert self.workdir is not None
        return write_kubeconfig(self.workdir / f"{user}.kubeconfig", self.server, self.pki.ca_file, user,
                                cert=cert[0], key=cert[1], namespace=namespace)

    def user(self, name: str, groups: tuple[str, ...] = (), namespace: str = "default") -> tuple[Api, Path]:
        """A user authenticated by a client certificate (CN ``name``, O ``groups``): a client and a kubeconfig."""
        cert = self.pki.issue(f"user-{name}", name, groups)
        return Api(self.server, self.pki.ca_file, cert=cert), self._kubeconfig(f"user-{name}", cert, namespace)

    def tenant(self, name: str, namespace: str, extra_rules: tuple[dict[str, Any], ...] = ()) -> Path:
        """A tenant as a platform team would make one: a client certificate (CN ``name``, group ``tenants``) and a Role
        in ``namespace`` (created if missing) to create, read, change and delete LlamaPretrains and read the pods and
        events of their runs, plus ``extra_rules``; nothing cluster-wide. Returns the tenant's kubeconfig."""
        self.admin.ensure_namespace(namespace)
        _, kubeconfig = self.user(name, ("tenants",), namespace=namespace)
        rules = [{"apiGroups": ["kubetitan.io"], "resources": ["llamapretrains"],
                  "verbs": ["create", "get", "list", "watch", "patch", "update", "delete"]},
                 {"apiGroups": [""], "resources": ["pods", "pods/log", "events"], "verbs": ["get", "list", "watch"]},
                 *extra_rules]
        meta = {"name": f"{name}-runs"}
        self.admin.create("rbac.authorization.k8s.io/v1/roles", namespace, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules})
        self.admin.create("rbac.authorization.k8s.io/v1/rolebindings", namespace, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
            "subjects": [{"kind": "User", "name": name, "apiGroup": "rbac.authorization.k8s.io"}]})
        return kubeconfig

    def node_api(self, node: str) -> Api:
        """The node agent's identity (``system:node:<node>``): the Node authorizer and NodeRestriction apply."""
        crt, key = self.pki.dir / f"node-{node}.crt", self.pki.dir / f"node-{node}.key"
        with _NODE_CERTS:  # one certificate per node, however many clients (threads) ask for it at once
            if not crt.exists():
                crt, key = self.pki.issue(f"node-{node}", f"system:node:{node}", ("system:nodes",))
        return Api(self.server, self.pki.ca_file, cert=(crt, key))

    def token(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A token of the ServiceAccount from the TokenRequest API (what a projected token volume holds)."""
        r = self.admin.request("POST", resource_path("v1/serviceaccounts", namespace, service_account, "token"), {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}})
        return r["status"]["token"]

    def service_account_kubeconfig(self, namespace: str, service_account: str) -> Path:
        """A kubeconfig with a new token of the ServiceAccount, in a file of its own (a client re-reads its file:
        two replicas must never share one, or one would authenticate with the other's token)."""
        assert self.workdir is not None
        self._tokens += 1
        return write_kubeconfig(self.workdir / f"sa-{namespace}-{service_account}-{self._tokens}.kubeconfig", self.server,
                                self.pki.ca_file, f"system:serviceaccount:{namespace}:{service_account}",
                                token=self.token(namespace, service_account), namespace=namespace)

    # -- components
    def _spawn(self, name: str, args: list[str]) -> Component:
        assert self.workdir is not None
        log = self.workdir / f"{name}.log"
        f = open(log, "ab")  # noqa: SIM115 - the child keeps it
        program = self.apiserver_bin if name == "kube-apiserver" and self.apiserver_bin else self.bin_dir / name
        proc = subprocess.Popen([str(program), *args], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        f.close()
        c = self.components[name] = Component(name, proc, log, time.monotonic(), list(args))
        return c

    @staticmethod
    def _healthz(port: int) -> bool:
        """The /healthz of kube-controller-manager or kube-scheduler (self-signed serving certificates)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            return requests.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200

    def _wait(self, c: Component, probe: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
            try:
                if probe():
                    return
            except (requests.RequestException, OSError, ApiError):
                pass
            time.sleep(0.1)  # polling a process's health endpoint: nothing to subscribe to before it serves
        raise RuntimeError(f"{c.name} not ready after {timeout:.0f} s:\n{c.tail()}")

    def _start_etcd(self) -> None:
        assert self.workdir is not None
        client, peer = _free_port(), _free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        c = self._spawn("etcd", [
            f"--data-dir={self.workdir / 'etcd'}", "--name=default", f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}", f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}", "--unsafe-no-fsync",
            "--quota-backend-bytes=2147483648", "--log-level=warn"])
        self._wait(c, lambda: requests.get(self.etcd_url + "/health", timeout=1).json().get("health") == "true")

    def _gates(self) -> str:
        return ",".join(f"{k}={str(v).lower()}" for k, v in sorted(self.feature_gates.items()))

    def _audit_flags(self) -> list[str]:
        if not self.audit:
            return []
        assert self.workdir is not None
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(json.dumps({"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": [
            "RequestReceived"], "rules": [{"level": "Metadata", "verbs": AUDITED_VERBS}, {"level": "None"}]}))
        self.audit_log = self.workdir / "audit.log"
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-mode=blocking",
                "--audit-log-maxsize=0"]

    def audit_events(self, resource: str | None = None, namespace: str | None = None) -> list[dict[str, Any]]:
        """The audit log's events of writes (each: user with its credential id, verb, objectRef, responseStatus,
        stageTimestamp), optionally of one resource (plural) and namespace."""
        out = []
        with open(self.audit_log) as f:
            text = f.read()
        for line in text.split("\n")[:-1]:  # a last line without its newline is still being written
            if line:
                e = json.loads(line)
                ref = e.get("objectRef") or {}
                if (resource is None or ref.get("resource") == resource) and (
                        namespace is None or ref.get("namespace") == namespace):
                    out.append(e)
        return out

    def _start_apiserver(self, serving: tuple[Path, Path]) -> None:
        c = self._spawn("kube-apiserver", [*self._audit_flags(), 
            f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}", f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.pki.ca_file}", f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={self.sa_pub}", f"--service-account-signing-key-file={self.sa_key}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            *([f"--feature-gates={self._gates()}"] if self.feature_gates else []),
            *([f"--runtime-config={','.join(self.runtime_config)}"] if self.runtime_config else []),
            "--enable-priority-and-fairness=false",
            "--endpoint-reconciler-type=none",  # the kubernetes Service cannot point at a loopback address
            "--profiling=false", "--v=1"])
        s = requests.Session()
        s.trust_env = False
        s.verify, s.cert = str(self.pki.ca_file), (str(self.admin_cert[0]), str(self.admin_cert[1]))
        self._wait(c, lambda: s.get(self.server + "/readyz", timeout=2).status_code == 200, timeout=90)

    def _component_kubeconfig(self, name: str, cn: str) -> Path:
        return self._kubeconfig(name, self.pki.issue(name, cn))

    def _start_controller_manager(self) -> None:
        assert self.workdir is not None
        kc = self._component_kubeconfig("kube-controller-manager", "system:kube-controller-manager")
        port = _free_port()
        c = self._spawn("kube-controller-manager", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--leader-elect=false", f"--controllers={self.controllers}", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.sa_key}", f"--root-ca-file={self.pki.ca_file}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--feature-gates={self._gates()}",
            f"--node-monitor-grace-period={self.node_grace_seconds}s", "--node-monitor-period=1s",
            "--concurrent-gc-syncs=5", "--v=1"])
        self._wait(c, lambda: self._healthz(port))

    def _start_scheduler(self) -> None:
        assert self.workdir is not None
        kc = self._component_kubeconfig("kube-scheduler", "system:kube-scheduler")
        port = _free_port()
        c = self._spawn("kube-scheduler", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
            f"--feature-gates={self._gates()}", "--v=1"])
        self._wait(c, lambda: self._healthz(port))

    def _wait_default_service_account(self) -> None:
        """Pods can be created in ``default`` only once the service-account controller made its ServiceAccount."""
        c = self.components["kube-controller-manager"]
        self._wait(c, lambda: self.admin.get("v1/serviceaccounts", "default", "default") is not None)

    def restart_apiserver(self) -> float:
        """Stop kube-apiserver (SIGTERM, SIGKILL after 3 s) and start it again with the same flags: every watch
        ends, and its watch cache starts anew from etcd. Returns the seconds until it was ready again."""
        t0 = time.monotonic()
        old = self.components.pop("kube-apiserver")
        old.proc.send_signal(signal.SIGTERM)
        try:
            old.proc.wait(3)
        except subprocess.TimeoutExpired:  # its graceful shutdown waits for the open watches to drain (>10 s here)
            old.proc.kill()
            old.proc.wait(10)
        c = self._spawn("kube-apiserver", old.args)
        self._wait(c, lambda: self.admin.s.get(self.server + "/readyz", timeout=2).status_code == 200, timeout=90)
        return time.monotonic() - t0

    # -- etcd
    def compact(self) -> int:
        """Compact etcd at its current revision (what the API server does every 5 minutes): watches resumed from
        an older resourceVersion are answered 410 Gone. Returns the revision."""
        rev = int(requests.post(self.etcd_url + "/v3/kv/range", json={"key": base64.b64encode(b"/").decode()},
                                timeout=5).json()["header"]["revision"])
        r = requests.post(self.etcd_url + "/v3/kv/compaction", json={"revision": rev, "physical": True}, timeout=30)
        r.raise_for_status()
        return rev

    def version(self) -> dict[str, Any]:
        return self.admin.request("GET", "/version")


LPT = "kubetitan.io/v1alpha1/llamapretrains"
PODS, NODES, LEASES = "v1/pods", "v1/nodes", "coordination.k8s.io/v1/leases"
NODE_CAPACITY = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "8",
                 "vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi", "ephemeral-storage": "500Gi"}
"""What each node of the e2e kubelet reports (a p5.48xlarge's GPU and EFA counts; its CPU and memory scaled down)."""


def _micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeCluster(RunQueries):
    """The API double's test-helper interface (``kmockx.harness.Cluster``) over the real control plane, for the e2e
    kubelet and the scenarios: reads and a test's own writes as the admin, a node agent's writes (its Node, its
    Lease, its pods' status and final delete) as that node (``system:node:<name>``: the Node authorizer and
    NodeRestriction judge them). The real scheduler binds pods (``schedules``); the node lifecycle controller turns
    a node whose Lease is not renewed ``Ready=Unknown``."""

    schedules = True

    def __init__(self, cp: ControlPlane) -> None:
        self.cp, self.api = cp, cp.admin
        self._nodes: dict[str, Api] = {}
        self._leases: dict[str, Api] = {}

    # -- reads and a test's writes (admin)
    def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        return self.api.get(resource, ns, name)

    def list(self, resource: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        return self.api.list(resource, ns, selector)

    def patch(self, resource: str, ns: str | None, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self.api.patch(resource, ns, name, patch, subresource)

    def delete(self, resource: str, ns: str | None, name: str) -> None:
        self.api.delete(resource, ns, name)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.api.create(LPT, obj["metadata"].get("namespace", "default"), obj)

    def force_delete(self, ns: str, name: str) -> None:
        """``kubectl delete pod --grace-period=0 --force``."""
        self.api.delete(PODS, ns, name, grace=0)

    # -- a node agent's writes (its own identity)
    def node(self, name: str) -> Api:
        if name not in self._nodes:
            self._nodes[name] = self.cp.node_api(name)
        return self._nodes[name]

    def add_node(self, name: str, ready: bool = True, capacity: dict[str, str] | None = None) -> None:
        """Register a Node as a kubelet does (create, then status), with its Lease."""
        api = self.node(name)
        cap = {**NODE_CAPACITY, **(capacity or {})}
        if api.get(NODES, None, name) is None:
            api.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                         "kubernetes.io/arch": "amd64"}}})
        api.patch(NODES, None, name, {"status": {
            "capacity": cap, "allocatable": cap, "conditions": [self._ready_cond(ready)],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": kubernetes_version(), "containerRuntimeVersion": "e2e://1",
                         "operatingSystem": "linux", "architecture": "amd64", "osImage": "e2e kubelet",
                         "kernelVersion": os.uname().release, "machineID": name, "systemUUID": name,
                         "bootID": name, "kubeProxyVersion": ""}}}, "status")
        self.renew_node(name)

    def renew_node(self, name: str) -> None:
        """The node's heartbeat: renew its Lease in ``kube-node-lease`` (created on first use). A client of its own
        per node: the heartbeat runs on the kubelet double's lease thread."""
        if name not in self._leases:
            self._leases[name] = self.cp.node_api(name)
        api, now = self._leases[name], _micro_now()
        try:
            api.patch(LEASES, "kube-node-lease", name, {"spec": {"renewTime": now}})
        except ApiError as e:
            if e.status != 404:
                raise
            try:
                api.create(LEASES, "kube-node-lease", {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": "kube-node-lease"},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}})
            except ApiError as e2:
                # a node that just registered is renewed by its registration and by the lease thread at once: the
                # one whose create comes second finds the Lease made a moment ago, renewed either way
                if e2.status != 409:
                    raise

    @staticmethod
    def _ready_cond(ready: bool) -> dict[str, Any]:
        return {"type": "Ready", "status": "True" if ready else "Unknown",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                "message": "e2e kubelet is posting ready status" if ready else "e2e kubelet stopped posting",
                "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}

    def set_node_ready(self, name: str, ready: bool) -> None:
        """The kubelet's own Ready report (on restore); a failed node is turned Unknown by the node lifecycle
        controller once its Lease is older than the grace period, not by the test."""
        self.node(name).patch(NODES, None, name, {"status": {"conditions": [self._ready_cond(ready)]}}, "status",
                              kind="strategic")

    def patch_pod_status(self, ns: str, name: str, status: dict[str, Any], node: str) -> None:
        self.node(node).patch(PODS, ns, name, {"status": status}, "status")

    def delete_now(self, ns: str, name: str, node: str) -> None:
        """The kubelet's final delete of a pod whose containers ended (grace 0, its own identity)."""
        self.node(node).delete(PODS, ns, name, grace=0)


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[ControlPlane]:
    with ControlPlane(**kwargs) as cp:
        yield cp


def _tenant_arg(text: str) -> tuple[str, str]:
    name, _, namespace = text.partition(":")
    if not name or not namespace:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:NAMESPACE, e.g. alice:team-a")
    return name, namespace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m support.cluster",
                                description="Start the tests' real Kubernetes control plane and keep it up until "
                                            "Ctrl-C (point kubectl/helm at the printed kubeconfig).")
    p.add_argument("--dir", type=Path, default=None, help="working directory (default: a new temporary one, "
                                                          "removed at exit)")
    p.add_argument("--no-scheduler", action="store_true", help="start no kube-scheduler")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME:NAMESPACE", type=_tenant_arg,
                   help="also make this tenant (repeatable): a client certificate and a Role in NAMESPACE for "
                        "LlamaPretrains and their pods' logs and events (ControlPlane.tenant); prints its KUBECONFIG")
    a = p.parse_args(argv)
    with ControlPlane(workdir=a.dir, scheduler=not a.no_scheduler) as cp:
        v = cp.version()
        print(f"Kubernetes {v['gitVersion']} up in {cp.timings['ready']:.1f} s "
              f"(etcd {cp.timings['etcd']:.1f} s, apiserver ready at {cp.timings['kube-apiserver']:.1f} s)")
        print(f"export KUBECONFIG={cp.admin_kubeconfig}")
        for name, namespace in a.tenant:
            print(f"tenant {name} in namespace {namespace}: export KUBECONFIG={cp.tenant(name, namespace)}")
        print(f"logs: {cp.workdir}/*.log; Ctrl-C stops it")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    raise SystemExit(main())
