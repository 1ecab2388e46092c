"""The operator's Kubernetes client: a thin async wrapper over the ``kubernetes`` package.

Why this client: kopf has no public one, and the ``kubernetes`` package is already a dependency and
handles every way of logging in (kubeconfig, in-cluster service account with token rotation, exec
plugins). Its calls are synchronous, so they run in a bounded thread pool; bodies are plain dicts and
responses are read as raw JSON (``_preload_content=False``), skipping the model (de)serialisation.
Every call names its (apiGroup, resource, verb) and is refused unless ``rbac.RULES`` lists it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kubetitan import GROUP, PLURAL, VERSION, rbac

log = logging.getLogger("kubetitan.kube")


class NotAllowed(RuntimeError):
    """A call that ``rbac.RULES`` does not list (a bug: add the rule or drop the call)."""


def load_config(kubeconfig: str | None = None, context: str | None = None) -> kubernetes.client.Configuration:
    """In-cluster config when running in a pod, else the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``)."""
    cfg = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            return cfg
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return cfg


def connection_info(cfg: kubernetes.client.Configuration, kopf: Any) -> Any:
    """The same credentials for kopf's own API calls (``@kopf.on.login``)."""
    token = None
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if auth:
        token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else auth
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme="Bearer" if token else None, token=token,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
    )


class Client:
    """Async calls the operator makes. ``calls`` counts them by (group, resource, verb) for the RBAC test."""

    def __init__(self, cfg: kubernetes.client.Configuration, threads: int = 16) -> None:
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, threads)
        self.api = kubernetes.client.ApiClient(cfg)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kube")
        self.calls: dict[tuple[str, str, str], int] = {}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.api.close()

    async def _call(self, group: str, resource: str, verb: str, method: str, path: str,
                    body: Any = None, query: list[tuple[str, Any]] | None = None,
                    content_type: str = "application/json") -> dict[str, Any] | None:
        """One API call; returns the JSON body, or None for 404 (get/delete) and 409 (create)."""
        if not rbac.allowed(group, resource, verb):
            raise NotAllowed(f"{verb} {group or 'core'}/{resource} is not in kubetitan.rbac.RULES")
        self.calls[(group, resource, verb)] = self.calls.get((group, resource, verb), 0) + 1

        def call() -> tuple[int, bytes]:
            m, url, headers, data, post = self.api.param_serialize(
                method, path, query_params=query or [], body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            r = self.api.call_api(m, url, header_params=headers, body=data, post_params=post, _request_timeout=30)
            return r.status, r.read()

        loop = asyncio.get_running_loop()
        status, data = await loop.run_in_executor(self.pool, call)
        if status == 404 and verb in ("get", "delete"):
            return None
        if status == 409 and verb == "create":
            return None
        if not 200 <= status < 300:
            raise ApiException(status=status, reason=f"{method} {path}: {data[:500]!r}")
        return json.loads(data) if data else {}

    # ---- helpers (paths follow the API conventions)
    @staticmethod
    def _core(ns: str | None, resource: str, name: str | None = None) -> str:
        p = f"/api/v1/namespaces/{ns}/{resource}" if ns else f"/api/v1/{resource}"
        return f"{p}/{name}" if name else p

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create a core/v1 child; False when it already exists (success for idempotent applies)."""
        resource = {"Pod": "pods", "ConfigMap": "configmaps", "Service": "services"}[obj["kind"]]
        ns = obj["metadata"]["namespace"]
        return await self._call("", resource, "create", "POST", self._core(ns, resource), obj) is not None

    async def get(self, resource: str, ns: str | None, name: str) -> dict[str, Any] | None:
        return await self._call("", resource, "get", "GET", self._core(ns, resource, name))

    async def patch(self, resource: str, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return await self._call("", resource, "patch", "PATCH", self._core(ns, resource, name), patch,
                                content_type="application/merge-patch+json")

    async def delete_pod(self, ns: str, name: str, grace_seconds: int | None = None) -> bool:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        return await self._call("", "pods", "delete", "DELETE", self._core(ns, "pods", name), body) is not None

    async def patch_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}/status"
        return await self._call(GROUP, f"{PLURAL}/status", "patch", "PATCH", path, {"status": status},
                                content_type="application/merge-patch+json")

    async def delete_run(self, ns: str, name: str) -> bool:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}"
        return await self._call(GROUP, PLURAL, "delete", "DELETE", path,
                                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
                                ) is not None
