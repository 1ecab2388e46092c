"""kubetitan.kube.Client against a tiny API server that checks bearer tokens: cached credentials, refresh on 401."""

from __future__ import annotations

import asyncio

import aiohttp.web
import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from kubetitan.kube import Client


@pytest.mark.parametrize(
    ("accepted", "want_status", "want_hook_calls", "want_requests"),
    [
        ("t1", 200, 1, 1),     # the token still works: one refresh-hook call, then the cache
        ("t2", 200, 2, 2),     # rotated: 401, refresh once, retry succeeds
        ("never", 401, 2, 2),  # revoked: one retry only, then the error
    ],
    ids=["valid", "rotated", "revoked"],
)
def test_credentials_cached_and_refreshed_on_401(accepted: str, want_status: int, want_hook_calls: int,
                                                 want_requests: int) -> None:
    seen: list[str] = []

    async def pods(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.headers.get("authorization", ""))
        if request.headers.get("authorization") != f"Bearer {accepted}":
            return aiohttp.web.json_response({"kind": "Status", "code": 401}, status=401)
        return aiohttp.web.json_response({"kind": "Pod", "metadata": {"name": request.match_info["name"]}})

    async def main() -> None:
        app = aiohttp.web.Application()
        app.router.add_get("/api/v1/namespaces/ml/pods/{name}", pods)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}")
        cfg.api_key_prefix["BearerToken"] = "Bearer"
        cfg.api_key["BearerToken"] = "t0"  # as loaded from the kubeconfig; the hook refreshes it before each use
        calls = []

        def hook(c: kubernetes.client.Configuration) -> None:  # like kube_config's token refresh
            calls.append(1)
            c.api_key["BearerToken"] = f"t{len(calls)}"

        cfg.refresh_api_key_hook = hook
        client = Client(cfg)
        try:
            if want_status == 200:
                assert (await client.get("pods", "ml", "p0")) == {"kind": "Pod", "metadata": {"name": "p0"}}
                assert (await client.get("pods", "ml", "p1"))["metadata"]["name"] == "p1"  # cached credentials
            else:
                with pytest.raises(ApiException, match="401"):
                    await client.get("pods", "ml", "p0")
        finally:
            await client.aclose()
            await runner.cleanup()
        assert len(calls) == want_hook_calls
        assert len(seen) == want_requests + (1 if want_status == 200 else 0)
        assert client.calls[("", "pods", "get")] == (2 if want_status == 200 else 1)

    asyncio.run(main())
