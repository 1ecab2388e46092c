"""The operator's Kubernetes client: the `kubernetes` package's configuration and credentials, aiohttp requests.

Why this client: kopf has no public one, and the ``kubernetes`` package is already a dependency and
handles every way of logging in (kubeconfig, in-cluster service account with token rotation, exec
plugins). It loads the configuration and produces the credentials; the requests themselves are aiohttp
calls on the operator's event loop (see ``Client``), with plain dict bodies and raw JSON responses.
Every call names its (apiGroup, resource, verb) and is refused unless ``rbac.RULES`` lists it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kubetitan import GROUP, PLURAL, VERSION, rbac

log = logging.getLogger("kubetitan.kube")


AUTH_REFRESH_SECONDS = 30.0


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
    """Async calls the operator makes. ``calls`` counts them by (group, resource, verb) for the RBAC test.

    Requests go through one aiohttp session on the operator's event loop (like kopf's own calls); the
    ``kubernetes`` package is kept for what it is good at: loading the configuration and producing the
    current credentials (``Configuration.auth_settings()`` runs its refresh hook, which re-reads a rotated
    service-account token or re-runs an exec plugin when the token expires). The earlier version sent
    every call through ``kubernetes.ApiClient`` in a thread pool: ~1.7 ms of CPU per call against ~0.7 ms
    here (bench/operator_bench.py), which mattered once hundreds of runs were created at once.
    ``concurrency`` bounds the requests in flight.
    """

    def __init__(self, cfg: kubernetes.client.Configuration, concurrency: int = 16) -> None:
        self.cfg = cfg
        self.host = cfg.host.rstrip("/")
        self.limit = asyncio.Semaphore(concurrency)
        self.session: Any = None
        self.calls: dict[tuple[str, str, str], int] = {}
        self._auth_headers: dict[str, str] | None = None
        self._auth_at = 0.0

    def _ssl(self) -> Any:
        if not self.host.startswith("https"):
            return None
        if not self.cfg.verify_ssl:
            return False
        ctx = ssl.create_default_context(cafile=self.cfg.ssl_ca_cert)
        if self.cfg.cert_file:
            ctx.load_cert_chain(self.cfg.cert_file, self.cfg.key_file)
        return ctx

    def _auth(self) -> dict[str, str]:
        """Credential headers, refreshed every ``AUTH_REFRESH_SECONDS`` and after a 401.

        ``auth_settings()`` runs the configuration's refresh hook, which for a kubeconfig re-reads the
        whole user entry (~1 ms; it was a fifth of the operator's CPU with 500 runs). Tokens live for
        minutes to hours and the API server answers 401 to a stale one, so a short cache is safe.
        """
        now = time.monotonic()
        if self._auth_headers is not None and now - self._auth_at < AUTH_REFRESH_SECONDS:
            return self._auth_headers
        headers = {}
        for auth in self.cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        if self.cfg.username and self.cfg.password:
            headers["authorization"] = self.cfg.get_basic_auth_token()
        self._auth_headers, self._auth_at = headers, now
        return headers

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _call(self, group: str, resource: str, verb: str, method: str, path: str,
                    body: Any = None, query: list[tuple[str, Any]] | None = None,
                    content_type: str = "application/json") -> dict[str, Any] | None:
        """One API call; returns the JSON body, or None for 404 (get/delete) and 409 (create)."""
        import aiohttp

        if not rbac.allowed(group, resource, verb):
            raise NotAllowed(f"{verb} {group or 'core'}/{resource} is not in kubetitan.rbac.RULES")
        self.calls[(group, resource, verb)] = self.calls.get((group, resource, verb), 0) + 1
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=0),
                timeout=aiohttp.ClientTimeout(total=30), proxy=self.cfg.proxy or None)
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        for _ in range(2):
            headers = {"Content-Type": content_type, "Accept": "application/json", **self._auth()}
            async with self.limit, self.session.request(method, self.host + path, params=query or None, data=data,
                                                        headers=headers) as r:
                status, raw = r.status, await r.read()
            if status != 401 or self._auth_headers is None:
                break
            self._auth_headers = None  # a rotated token: refresh the credentials and try once more
        if status == 404 and verb in ("get", "delete"):
            return None
        if status == 409 and verb == "create":
            return None
        if not 200 <= status < 300:
            raise ApiException(status=status, reason=f"{method} {path}: {raw[:500]!r}")
        return json.loads(raw) if raw else {}

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
