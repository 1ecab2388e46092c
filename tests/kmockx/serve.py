"""kmockx as a process of its own: ``python tests/kmockx/serve.py KUBECONFIG [--namespace NS ...]``.

Writes a kubeconfig pointing at the server to KUBECONFIG, prints ``ready <url>`` on stdout, and
serves until stdin closes or SIGTERM/SIGINT. The benchmark uses it so that the operator process' RSS
and CPU are measured apart from the API server's.

``--fault JSON`` (repeatable) injects a :class:`kmockx.Fault` (its fields as a JSON object), e.g. 10% of pod
creates answered 429 with ``Retry-After: 1``::

    --fault '{"code": 429, "verbs": ["create"], "resource": "pods", "rate": 0.1, "retry_after": 1}'

Faults are tried in order, so a second one with ``rate`` r2 answers (1 - r1) * r2 of the requests. On exit it
prints ``stats {JSON}``: each fault's hits and the answers to pod creates by status code. ``--profile FILE`` runs
the server's thread (its event loop: every request's admission, storage and watch fan-out) under cProfile.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kmockx.harness import Cluster  # noqa: E402


def chains(log: list[Any], faults: list[Any]) -> dict[str, Any]:
    """How the pod creates went, per pod (``faults`` asking for a ``Retry-After``): the most refusals one pod had
    (``refused``), when the first pod create was answered (``first``, ``time.monotonic()``: the same clock in every
    process of the host), and in seconds after it: when every pod had been answered once (``once``), when the last
    pod was created (``last``) and the floor the refusals alone set (``floor``: for each pod, its first answer plus its refusals times the
    ``Retry-After``; the latest of them). ``last - floor`` is what the client and the double added on top."""
    wait = max((f.retry_after or 0 for f in faults), default=0)
    per: dict[str, list[Any]] = collections.defaultdict(list)
    for e in log:
        if e.verb == "create" and e.name and e.path.split("?")[0].endswith("/pods"):
            per[e.name].append(e)
    if not per:
        return {}
    t0 = min(es[0].time for es in per.values())
    refused = {n: sum(1 for e in es if e.code in (429, 503)) for n, es in per.items()}
    created = [e.time for es in per.values() for e in es if e.code == 201]
    floor = max(es[0].time + refused[n] * wait for n, es in per.items())
    return {"refused": max(refused.values()), "first": t0, "floor": round(floor - t0, 3),
            "once": round(max(es[0].time for es in per.values()) - t0, 3),
            "last": round(max(created, default=t0) - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve kmockx (the test API server) until stdin closes.")
    p.add_argument("kubeconfig", help="where to write a kubeconfig for the server")
    p.add_argument("--namespace", action="append", default=[], help="extra namespace to create (repeatable)")
    p.add_argument("--fault", action="append", default=[], type=json.loads, metavar="JSON",
                   help="inject a kmockx.Fault, its fields as a JSON object (repeatable; tried in order)")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults' random choice (reproducible runs)")
    p.add_argument("--profile", metavar="FILE", help="cProfile the server's thread; the stats go to FILE on exit")
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(namespaces=tuple(a.namespace), profile=a.profile) as c:
        assert c.k is not None
        c.k.seed = a.seed
        faults = [c.k.inject(**f) for f in a.fault]
        shutil.copyfile(c.kubeconfig, a.kubeconfig)
        print(f"ready {c.url}", flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        stop.wait()
        pod_creates = collections.Counter(e.code for e in c.k.log if e.verb == "create"
                                  and e.path.split("?")[0].endswith("/pods"))
        print("stats " + json.dumps({"faults": [{"code": f.code, "resource": f.resource, "hits": f.hits}
                                               for f in faults],
                                    "pod_creates": {str(k): v for k, v in sorted(pod_creates.items())},
                                    "chains": chains(c.k.log, faults)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
