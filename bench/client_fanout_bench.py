"""CPU of the operator's create path alone: ``fanout.slow_start`` over ``kube.Client.create`` (prints numbers).

    .venv/bin/python bench/client_fanout_bench.py [--pods 1024] [--repeat 5]

One process: a trivial aiohttp server answering every request 201 and the client sending ``--pods`` pod creates
through slow start with its default 16 request slots, as ``reconcile.apply.create_children`` does. No kmockx, no
kopf, no other process: the number is what the client and the fan-out cost per create, stable under the shared
machine's load (the server's share is the same in every tree). For an A/B, run it with another tree's operator
first on ``PYTHONPATH`` (``git archive COMMIT operator/kubetitan | tar -x -C /tmp/old``; then
``PYTHONPATH=/tmp/old/operator:operator/core``).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp.web
import kubernetes

import kubetitan
import kubetitan.kube as kube
from kubetitan import fanout


async def _once(n: int) -> tuple[float, float]:
    async def handler(request: aiohttp.web.Request) -> aiohttp.web.Response:
        await request.read()
        return aiohttp.web.json_response({"kind": "Pod"}, status=201)

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = kube.Client(kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}"))
    pods = [{"kind": "Pod", "apiVersion": "v1", "metadata": {"name": f"p{i}", "namespace": "ml"}} for i in range(n)]
    told = {"waiting": kube.RETRY_WAIT} if hasattr(kube, "RETRY_WAIT") else {}  # an older tree has none
    t0, c0 = time.perf_counter(), time.process_time()
    unsent = await fanout.slow_start(pods, client.create, **told)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert unsent == 0
    await client.aclose()
    await runner.cleanup()
    return wall, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    runs = [asyncio.run(_once(a.pods)) for _ in range(a.repeat)]
    print(f"{kubetitan.__file__}: {a.pods} creates through slow start and the client, wall "
          f"{' '.join(f'{w:.3f}' for w, _ in runs)} s, CPU {' '.join(f'{c:.3f}' for _, c in runs)} s "
          f"(min CPU {min(c for _, c in runs) / a.pods * 1e6:.0f} us per create)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
