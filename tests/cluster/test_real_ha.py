"""Two operator replicas with Lease election on the real API server: the standby takes over when the leader is
killed, and deleting the Lease under two replicas never gives two writers.

Who wrote what comes from the API server's audit log: each replica authenticates with a token of its own (two
TokenRequests for the chart's ServiceAccount), and every audited write carries its token's id
(``authentication.kubernetes.io/credential-id``).
"""

from __future__ import annotations

import base64
import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kmockx.harness import OperatorProcess, free_port
from support.cluster import LEASES, ControlPlane, KubeCluster, wait_for
from support.release import Release
from support.specs import cpu_spec, lpt

pytestmark = [pytest.mark.xdist_group("real-cluster"), pytest.mark.timeout(600)]
LEASE = ("--leader-elect-lease-duration=3", "--leader-elect-renew-deadline=2", "--leader-elect-retry-period=0.5")
"""Short terms (the chart's 15/10/2 s scaled down 5x) so a take-over takes seconds."""
FLAGS = ("--scan-interval=0.2", "--scrape-interval=0.5", *LEASE)
ROUNDS = 6


def _jti(kubeconfig: Path) -> str:
    """The token id of the kubeconfig's ServiceAccount token (its JWT payload's ``jti``)."""
    token = json.loads(kubeconfig.read_text())["users"][0]["user"]["token"]
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]


class Replica:
    def __init__(self, release: Release, name: str, tmp: Path, webhook_port: int | None = None) -> None:
        self.name = name
        kc = release.operator_kubeconfig()  # a TokenRequest of its own: its writes carry its own credential id
        self.credential = f"JTI={_jti(kc)}"
        extra = [*FLAGS, f"--leader-elect-identity={name}"]
        if webhook_port is not None:  # one host: a replica that is not the URL's listens elsewhere
            extra.append(f"--webhook-port={webhook_port}")
        cert_dir = tmp / f"webhook-{name}"
        cert_dir.mkdir()
        self.proc = OperatorProcess(str(kc), *release.operator_args(cert_dir=str(cert_dir), extra=tuple(extra)))


@pytest.fixture
def replicas(release: Release, tmp_path: Path) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for r in started:
        if r.proc.proc is not None and r.proc.proc.poll() is None:
            r.proc.stop()


def _holder(kube: KubeCluster, release: Release) -> str | None:
    lease = kube.get(LEASES, release.namespace, release.fullname)
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


def _pod_creates(cp: ControlPlane, namespaces: list[str]) -> list[dict[str, Any]]:
    """Every pod create in ``namespaces`` as the audit log has it (credential id, HTTP code, when the server received
    it and when it answered), in the order received."""
    out = []
    for ns in namespaces:
        for e in cp.audit_events("pods", ns):
            if e.get("stage") != "ResponseComplete" or e["verb"] != "create":
                continue
            extra = (e.get("user") or {}).get("extra") or {}
            out.append({"ns": ns, "writer": (extra.get("authentication.kubernetes.io/credential-id") or ["-"])[0],
                        "code": (e.get("responseStatus") or {}).get("code", 0),
                        "received": e["requestReceivedTimestamp"], "answered": e["stageTimestamp"]})
    return sorted(out, key=lambda c: c["received"])


def _logged_pod_creates(cp: ControlPlane, namespaces: list[str], per_namespace: int = 2) -> list[dict[str, Any]]:
    """:func:`_pod_creates` once the audit log has an answered create (201, or 504 for one abandoned in flight) for
    each of the ``per_namespace`` pods of every namespace. The server writes a request's ResponseComplete event
    after the object is stored, so a pod can be listed before its create is in the log (more so on a loaded
    machine): wait for the log, not for the pods."""
    def logged() -> list[dict[str, Any]] | None:
        creates = _pod_creates(cp, namespaces)
        answered = collections.Counter(c["ns"] for c in creates if c["code"] in (201, 504))
        return creates if all(answered[ns] >= per_namespace for ns in namespaces) else None
    return wait_for(logged, 30, f"the audit log's pod creates in {namespaces}")


def _writer_terms(creates: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The creates split into runs of one writer (a leader's term, as the server saw it)."""
    terms: list[list[dict[str, Any]]] = []
    for c in creates:
        if not terms or terms[-1][-1]["writer"] != c["writer"]:
            terms.append([])
        terms[-1].append(c)
    return terms


def _run_in_own_namespace(kube: KubeCluster, cp: ControlPlane, name: str) -> str:
    cp.admin.ensure_namespace(name)
    spec = cpu_spec(nodes=2)
    kube.apply(lpt("r", spec, namespace=name))
    wait_for(lambda: len(kube.pods(name, "r")) == 2, 60, f"the 2 pods of {name}")
    return name


def test_the_standby_takes_over_a_killed_leader_and_a_deleted_lease_never_gives_two_writers(
        kube: KubeCluster, control_plane: ControlPlane, release: Release, replicas: list[Replica],
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    prefix = "ha" + str(abs(hash(request.node.nodeid)) % 10000)
    # b starts first and leads (it listens for webhooks on a port of its own); a serves the chart's webhook URL
    b = Replica(release, "replica-b", tmp_path, webhook_port=free_port())
    replicas.append(b)
    b.proc.start()
    wait_for(lambda: _holder(kube, release) == "replica-b", 60, "replica-b holds the Lease")
    a = Replica(release, "replica-a", tmp_path)
    replicas.append(a)
    a.proc.start()
    wait_for(release.webhook_serving, 60, "replica-a serving the chart's webhook URL", every=0.1)
    ns0 = _run_in_own_namespace(kube, control_plane, f"{prefix}-0")
    assert {c["writer"] for c in _logged_pod_creates(control_plane, [ns0])} == {b.credential}
    # the leader is killed: a takes over once the Lease expires, and reconciles the next run
    b.proc.kill()
    wait_for(lambda: _holder(kube, release) == "replica-a", 30, "replica-a takes the Lease over")
    ns1 = _run_in_own_namespace(kube, control_plane, f"{prefix}-1")
    assert {c["writer"] for c in _logged_pod_creates(control_plane, [ns1])} == {a.credential}
    # two replicas again; the Lease deleted under them, round after round
    b2 = Replica(release, "replica-b2", tmp_path, webhook_port=free_port())
    replicas.append(b2)
    b2.proc.start()
    namespaces = []
    holders = []
    for i in range(ROUNDS):
        before = kube.get(LEASES, release.namespace, release.fullname)
        kube.delete(LEASES, release.namespace, release.fullname)
        wait_for(lambda: (lease := kube.get(LEASES, release.namespace, release.fullname)) is not None
                 and lease["metadata"]["uid"] != before["metadata"]["uid"], 30, f"round {i}: a new Lease")
        namespaces.append(_run_in_own_namespace(kube, control_plane, f"{prefix}-r{i}"))
        holders.append(_holder(kube, release))
    creates = _logged_pod_creates(control_plane, namespaces)
    # every pod created once: 2 per gang, no duplicate (409). A create the stepping-down replica abandoned in flight
    # (its request cancelled, the server's 504) is allowed: the next leader reads the cluster before it acts. Such a
    # create may still have stored its pod, which the next leader then finds: that pod has a 504 and no 201.
    assert {c["code"] for c in creates} <= {201, 504}, creates
    for ns in namespaces:
        codes = collections.Counter(c["code"] for c in creates if c["ns"] == ns)
        assert codes[201] <= 2 <= codes[201] + codes[504], (ns, creates)
    # never two writers at once: a replica's first create of a term comes after the other's last was answered (a
    # term may end mid-gang, e.g. a renewal late on a loaded machine, and the other replica creates the rest)
    terms = _writer_terms([c for c in creates if c["code"] == 201])
    for before, after in zip(terms, terms[1:]):
        assert after[0]["received"] >= before[-1]["answered"], (before, after)
    names = {r.credential: r.name for r in replicas}
    print(f"{ROUNDS} Lease deletions under two replicas: holders after each round {holders}; writers "
          f"{[(c['ns'][-2:], names.get(c['writer'], c['writer']), c['code']) for c in creates]}; {len(terms)} writer terms, none "
          "overlapping, every pod created once")
