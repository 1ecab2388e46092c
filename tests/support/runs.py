"""What tests read of a run, the same on the API double (kmockx.harness.Cluster) and on the real control plane
(support.cluster.KubeCluster): both provide ``get(resource, ns, name)`` and ``list(resource, ns, selector)``."""

from __future__ import annotations

from typing import Any

LPT = "kubetitan.io/v1alpha1/llamapretrains"
PODS = "v1/pods"


class RunQueries:
    """A run, its status and conditions, its pods by name."""

    def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def list(self, resource: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        raise NotImplementedError

    def lpt(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get(LPT, ns, name)

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return (self.lpt(ns, name) or {}).get("status") or {}

    def condition(self, ns: str, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(ns, name).get("conditions", []) if c["type"] == type_), None)

    def pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        return sorted(self.list(PODS, ns, f"kubetitan.io/name={name}"), key=lambda p: p["metadata"]["name"])

    def pod_names(self, ns: str, name: str) -> list[str]:
        return [p["metadata"]["name"] for p in self.pods(ns, name)]
