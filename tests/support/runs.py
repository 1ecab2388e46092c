"""What tests read of a run, the same on the API double (kmockx.harness.Cluster) and on the real control plane
(support.cluster.KubeCluster): both provide ``get(resource, ns, name)`` and ``list(resource, ns, selector)``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

LPT = "kubetitan.io/v1alpha1/llamapretrains"
PODS = "v1/pods"


class RunQueries(ABC):
    """A run, its status and conditions, its pods by name (over the subclass's ``get`` and ``list``)."""

    @abstractmethod
    def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        """One object, or None."""

    @abstractmethod
    def list(self, resource: str, ns: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        """The objects of a kind, optionally of one namespace and label selector."""

    def lpt(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get(LPT, ns, name)

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return (self.lpt(ns, name) or {}).get("status") or {}

    def condition(self, ns: str, name: str, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status(ns, name).get("conditions", []) if c["type"] == type_), None)

    def step(self, ns: str, name: str) -> int:
        """The run's last trained step in its status (0 before the first)."""
        return (self.status(ns, name).get("training") or {}).get("step") or 0

    def events(self, ns: str, name: str) -> list[tuple[str, str]]:
        """(type, reason) of every Event about the run, sorted."""
        return sorted((e.get("type", ""), e.get("reason", "")) for e in self.list("v1/events", ns)
                      if (e.get("involvedObject") or {}).get("name") == name)

    def pods(self, ns: str, name: str) -> list[dict[str, Any]]:
        return sorted(self.list(PODS, ns, f"kubetitan.io/name={name}"), key=lambda p: p["metadata"]["name"])

    def pod_names(self, ns: str, name: str) -> list[str]:
        return [p["metadata"]["name"] for p in self.pods(ns, name)]


def condition(status: Any, type_: str) -> tuple[str, str]:
    """(status, reason) of a typed status's condition ``type_``, which must be there."""
    from kubetitan import conditions as C

    c = C.find(status.conditions, type_)
    assert c is not None, type_
    return c.status, c.reason
