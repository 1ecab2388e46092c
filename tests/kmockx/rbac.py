"""RBAC for kmockx: the chart's own ClusterRoles/Roles and bindings (rendered by the real helm) decide requests.

``Authorizer.from_manifests(docs)`` takes rendered objects; ``check`` answers None (allowed) or the API server's
403 message, e.g. ``pods is forbidden: User "system:serviceaccount:ns:sa" cannot create resource "pods" in API
group "" in the namespace "x"``. ``system:masters`` may do everything. Non-resource URLs (discovery, OpenAPI,
/version) are open to every authenticated user, as the default ``system:discovery`` binding makes them.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any
from support import yamlio


REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubetitan"
RELEASE, RELEASE_NS = "kt", "kubetitan-system"


@functools.lru_cache(maxsize=None)
def render_chart(*sets: str, release: str = RELEASE) -> tuple[dict[str, Any], ...]:
    """``helm template`` of the chart (cached per release and ``--set`` list): every rendered object."""
    helm = shutil.which("helm") or str(REPO / ".tools" / "bin" / "helm")
    argv = [helm, "template", release, str(CHART), "--namespace", RELEASE_NS]
    for s in sets:
        argv += ["--set", s]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    return tuple(d for d in yamlio.load_all(out) if d)


@functools.lru_cache(maxsize=None)
def render_chart_with_certificates(*sets: str, release: str = RELEASE) -> tuple[dict[str, Any], ...]:
    """:func:`render_chart` with ``webhook.certificates=certManager``, then what cert-manager does with it: a CA and
    a serving certificate for the Certificate's DNS names in the Secret it names (``kubernetes.io/tls``, with
    ``ca.crt``), and that CA in the configuration's ``caBundle`` (its CA injector). Each ``sets`` list gets a CA of
    its own (a renewal in a test: render with another, harmless ``--set``)."""
    import base64
    import copy
    import datetime as dt

    from kubetitan import certs

    docs = [copy.deepcopy(d) for d in render_chart("webhook.certificates=certManager", *sets, release=release)]
    cert = next(d for d in docs if d["kind"] == "Certificate")
    m = certs.issue(None, certs.Action.ISSUE_CA, dt.datetime.now(dt.timezone.utc), tuple(cert["spec"]["dnsNames"]),
                    certs.CertPolicy(), common_name="cert-manager test CA")
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
              "metadata": {"name": cert["spec"]["secretName"], "namespace": cert["metadata"]["namespace"]},
              "data": {"ca.crt": base64.b64encode(m.ca_bundle).decode(), "tls.crt": base64.b64encode(m.cert).decode(),
                       "tls.key": base64.b64encode(m.key).decode()}}
    for d in docs:
        if d["kind"] == "ValidatingWebhookConfiguration":
            for w in d["webhooks"]:
                w["clientConfig"]["caBundle"] = secret["data"]["ca.crt"]
    return tuple(d for d in docs if d["kind"] not in ("Certificate", "Issuer")) + (secret,)

def _matches(values: list[str], value: str) -> bool:
    return "*" in values or value in values


class Authorizer:
    def __init__(self) -> None:
        self.cluster_roles: dict[str, list[dict[str, Any]]] = {}
        self.roles: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.bindings: list[tuple[str | None, str, str, list[dict[str, Any]]]] = []  # (ns, roleKind, role, subjects)

    def add(self, docs: Any) -> Authorizer:
        for d in docs:
            kind, meta = d.get("kind"), d.get("metadata") or {}
            if kind == "ClusterRole":
                self.cluster_roles[meta["name"]] = d.get("rules") or []
            elif kind == "Role":
                self.roles[(meta["namespace"], meta["name"])] = d.get("rules") or []
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                ns = meta.get("namespace") if kind == "RoleBinding" else None
                self.bindings.append((ns, d["roleRef"]["kind"], d["roleRef"]["name"], d.get("subjects") or []))
        return self

    @staticmethod
    def _subject_matches(s: dict[str, Any], user: str, groups: tuple[str, ...]) -> bool:
        if s.get("kind") == "ServiceAccount":
            return user == f"system:serviceaccount:{s.get('namespace')}:{s['name']}"
        if s.get("kind") == "User":
            return user == s["name"]
        return s.get("kind") == "Group" and s["name"] in groups

    def allowed(self, user: str, groups: tuple[str, ...], verb: str, group: str, resource: str, sub: str | None,
                ns: str | None, name: str | None) -> bool:
        if "system:masters" in groups:
            return True
        full = f"{resource}/{sub}" if sub else resource
        for bns, rkind, rname, subjects in self.bindings:
            if bns is not None and bns != ns:
                continue  # a RoleBinding grants only in its own namespace
            if not any(self._subject_matches(s, user, groups) for s in subjects):
                continue
            rules = self.cluster_roles.get(rname, []) if rkind == "ClusterRole" else self.roles.get((bns, rname), [])
            for r in rules:
                if _matches(r.get("verbs", []), verb) and _matches(r.get("apiGroups", []), group) \
                        and _matches(r.get("resources", []), full) \
                        and (not r.get("resourceNames") or name in r["resourceNames"]):
                    return True
        return False

    def check(self, user: str, groups: tuple[str, ...], verb: str, group: str, resource: str, sub: str | None,
              ns: str | None, name: str | None) -> str | None:
        """None when allowed, else the 403 message of the API server."""
        if self.allowed(user, groups, verb, group, resource, sub, ns, name):
            return None
        full = f"{resource}/{sub}" if sub else resource
        what = f'{resource}{"." + group if group else ""}'
        subject = f'{what} "{name}"' if name else what
        where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        return (f'{subject} is forbidden: User "{user}" cannot {verb} resource "{full}" in API group "{group}" '
                f"{where}")


def service_account(name: str, ns: str = RELEASE_NS) -> Any:
    """The identity a pod running as this ServiceAccount authenticates as with its bound token: the account's
    user and groups, its uid (the ServiceAccount object's; a stable one derived from its name here) and the
    token's extras (``authentication.kubernetes.io/credential-id``, the token's JTI), as a real API server fills
    ``user.Info``."""
    from kmockx.webhooks import Identity

    uid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"serviceaccount/{ns}/{name}"))
    return Identity(f"system:serviceaccount:{ns}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"), uid,
                    (("authentication.kubernetes.io/credential-id", (f"JTI={uuid.uuid5(uuid.NAMESPACE_URL, uid)}",)),))


def chart_rbac(release: str, namespaces: tuple[str, ...] | None) -> tuple[dict[str, Any], ...]:
    """The chart's RBAC objects for watching all namespaces (``namespaces`` None) or the listed ones."""
    sets = ("watch.mode=cluster",) if namespaces is None else \
        ("watch.mode=namespaced", "watch.namespaces={" + ",".join(namespaces) + "}")
    return tuple(d for d in render_chart(*sets, release=release)
                 if d["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding", "ServiceAccount"))


def chart_service_account(docs: Any) -> str:
    return next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
