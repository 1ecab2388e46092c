"""API discovery: whether the API server serves Kubernetes PodGroups (``scheduling.k8s.io/v1beta1``).

The planner is told, never asks (``plan.uses_pod_group(spec, served)``): this module asks the server. The answer
comes from the discovery document of the group version (``GET /apis/scheduling.k8s.io/v1beta1``, readable by every
authenticated user through the ``system:discovery`` role, so no RBAC row), read when the operator starts and again
before a new attempt once it is ``recheck_seconds`` old, or at once after the API refused a PodGroup (a server
downgraded, or its ``GenericWorkload`` gate turned off, answers 404). A failed read keeps the last answer (none
yet: not served) and is tried again at the next new attempt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubetitan.kube import message_of
from kubetitan.plan import POD_GROUP_API_VERSION

log = logging.getLogger("kubetitan.discovery")

POD_GROUP_RECHECK_SECONDS = 300.0
"""How long an answer is used before a new attempt reads the discovery document again."""


@dataclass
class PodGroupApi:
    """The operator's knowledge of whether the server serves PodGroups (one per operator)."""

    recheck_seconds: float = POD_GROUP_RECHECK_SECONDS
    clock: Callable[[], float] = time.monotonic
    served: bool | None = None
    """The last answer; None: not read yet (or forgotten after a refusal)."""
    checked_at: float = field(default=float("-inf"))

    async def check(self, client: Any) -> bool:
        """Whether PodGroups are served: the last answer while it is fresh, else the discovery document's."""
        now = self.clock()
        if self.served is not None and now - self.checked_at < self.recheck_seconds:
            return self.served
        import aiohttp

        try:
            resources = await client.api_resources(POD_GROUP_API_VERSION)
        except (ApiException, aiohttp.ClientError, TimeoutError) as e:
            log.warning("Reading the API discovery of %s failed (attempts get no PodGroup until it is read; it is "
                        "read again before the next new attempt): %s", POD_GROUP_API_VERSION, message_of(e))
            return bool(self.served)
        served = resources is not None and "podgroups" in resources
        if served != self.served:
            log.info("PodGroups (%s) are %s", POD_GROUP_API_VERSION,
                     "served: attempts get a gang PodGroup (spec.scheduling.podGroup: Auto)" if served else
                     "not served: attempts get no PodGroup (Kubernetes 1.37+ serves them with the GenericWorkload "
                     "feature gate and --runtime-config=scheduling.k8s.io/v1beta1=true)")
        self.served, self.checked_at = served, now
        return served

    def forget(self) -> None:
        """The API refused a PodGroup: read the discovery document again before the next attempt's children."""
        self.checked_at = float("-inf")
