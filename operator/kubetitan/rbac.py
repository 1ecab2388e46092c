"""The exact Kubernetes API access the operator needs: one table, used by the code and the chart.

``kube.Client`` refuses any call that is not listed here (so the table cannot drift from the code),
kopf's own calls (watching, finalizers, events) are listed too, and the Helm chart renders
the Role/ClusterRole from ``rules()``. A test compares the table with the calls the operator makes.
"""

from __future__ import annotations

from typing import NamedTuple

from kubetitan_core import GROUP, PLURAL


class Rule(NamedTuple):
    api_group: str
    resource: str
    verbs: tuple[str, ...]
    why: str


RULES: tuple[Rule, ...] = (
    Rule(GROUP, PLURAL, ("get", "list", "watch", "patch", "delete"),
         "watch runs, the daemons' finalizer (kopf), TTL after finished deletes the run"),
    Rule(GROUP, f"{PLURAL}/status", ("get", "patch"),
         "write status once per cycle; kopf's own bookkeeping in status.kopf"),
    Rule(GROUP, f"{PLURAL}/finalizers", ("update",),
         "children's blockOwnerDeletion owner references (OwnerReferencesPermissionEnforcement)"),
    Rule("", "pods", ("get", "list", "watch", "create", "delete"), "the gang: index, create, delete, force delete"),
    Rule("", "configmaps", ("get", "list", "watch", "create", "patch"),
         "trainer.toml of the run; an index (a watch), so one deleted by hand is recreated at once"),
    Rule("", "services", ("get", "list", "watch", "create"),
         "headless service for rendezvous and DNS; an index (a watch), like the config map"),
    Rule("scheduling.k8s.io", "podgroups", ("get", "create", "delete"),
         "one gang PodGroup per attempt where the server serves them: create (get: whose is a name taken), "
         "delete when the attempt ends"),
    Rule("", "nodes", ("get", "list", "watch"), "health of the nodes running the gang: an index (cluster-scoped)"),
    Rule("", "resourcequotas", ("get", "list", "watch"),
         "a quota changed in a namespace (raised, or usage freed): retry at once the creates it refused there"),
    Rule("", "events", ("get", "create", "patch"),
         "restart/fail/succeed events, aggregated: a repeat is counted on the same Event (kubetitan.events)"),
    Rule("events.k8s.io", "events", ("create", "patch"), "the same through the newer events API"),
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch"),
         "kopf resource discovery"),
    Rule("", "namespaces", ("get", "list", "watch"), "kopf namespace discovery with --all-namespaces"),
    Rule("coordination.k8s.io", "leases", ("get", "create", "update"),
         "leader election (--leader-elect): one Lease in the operator's own namespace"),
    Rule("authorization.k8s.io", "subjectaccessreviews", ("create",),
         "the admission webhook's requester checks: may the requesting user use what her spec references"),
    Rule("", "secrets", ("get", "update"),
         "webhook.certificates=operator: the webhook's CA and pair, in the one Secret the chart ships (by name)"),
    Rule("admissionregistration.k8s.io", "validatingwebhookconfigurations", ("get", "update"),
         "webhook.certificates=operator: the caBundle of the chart's own configuration (by name)"),
)

LEADER_ELECTION = frozenset({"leases"})
"""Rows granted only in the Lease's namespace (the release namespace), by a Role of their own."""

WEBHOOK_CERTIFICATES = frozenset({"secrets", "validatingwebhookconfigurations"})
"""Rows granted only with the operator's own webhook certificates, each on the one object the chart names
(``resourceNames``): the Secret in the release namespace (a Role), the configuration (a ClusterRole)."""

CLUSTER_SCOPED = frozenset({"nodes", "customresourcedefinitions", "namespaces", "subjectaccessreviews"})


def allowed(api_group: str, resource: str, verb: str) -> bool:
    return any(r.api_group == api_group and r.resource == resource and verb in r.verbs for r in RULES)


def rules(cluster_wide: bool = True) -> list[dict[str, object]]:
    """Kubernetes PolicyRules for a (Cluster)Role; namespaced mode still needs a ClusterRole for the
    cluster-scoped rows (see docs/operator.md)."""
    out: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for r in RULES:
        if not cluster_wide and r.resource in CLUSTER_SCOPED:
            continue
        out.setdefault((r.api_group, r.verbs), []).append(r.resource)
    return [{"apiGroups": [g], "resources": sorted(res), "verbs": list(v)} for (g, v), res in out.items()]
