"""kmockx as a process of its own: ``python tests/kmockx/serve.py KUBECONFIG [--namespace NS ...]``.

Writes a kubeconfig pointing at the server to KUBECONFIG, prints ``ready <url>`` on stdout, and
serves until stdin closes or SIGTERM/SIGINT. The benchmark uses it so that the operator process' RSS
and CPU are measured apart from the API server's.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kmockx.harness import Cluster  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve kmockx (the test API server) until stdin closes.")
    p.add_argument("kubeconfig", help="where to write a kubeconfig for the server")
    p.add_argument("--namespace", action="append", default=[], help="extra namespace to create (repeatable)")
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(namespaces=tuple(a.namespace)) as c:
        shutil.copyfile(c.kubeconfig, a.kubeconfig)
        print(f"ready {c.url}", flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
