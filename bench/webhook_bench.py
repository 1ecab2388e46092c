"""Admission webhook latency for a 64-node LlamaPretrain against kmockx (prints numbers; asserts no timing).

    .venv/bin/python bench/webhook_bench.py [--requests 300] [--out bench/results/webhook] [--tag s13]

Two processes: kmockx (this one, the API server double calling webhooks as kmockx.webhooks does: AdmissionReview v1
over HTTPS, the chart's Secret and ValidatingWebhookConfiguration) and ``kubetitan operator`` (its own process, the
CLI code path, serving the webhook with kopf's WebhookServer). For each requester mode (``off``: parse, validate,
policy, warnings; ``references``: plus one SubjectAccessReview per referenced object, answered by the same API
double, through the operator's answer cache (kubetitan.access_cache, the chart's defaults): the first create asks,
the repeats within the TTL do not; ``references-uncached``: the same with the cache off, every create asks all
five reviews, concurrently) it creates the spec ``--requests`` times (each create deleted again; a namespace the operator does not
watch, so no reconcile runs) and prints:

- ``webhook``: the API server's round trip to the webhook (POST sent -> AdmissionReview answer read), the latency
  the target (p99 < 50 ms) is about;
- ``create``: the client's whole ``POST .../llamapretrains`` (schema, CEL, the webhook, storing).

The raw numbers (every sample, in ms) go to ``<out>/<UTC time>[-<tag>].json`` and the printed table to
``<out>/<UTC time>[-<tag>].txt``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kmockx import rbac, webhooks  # noqa: E402
from kmockx.harness import Cluster, OperatorProcess, free_port, wait_for  # noqa: E402

BENCH_NS = "bench"
SVC = ("kubetitan-system", "kt-kubetitan-webhook")


def spec_64_nodes() -> dict[str, Any]:
    """examples/llama3-70b-p5.yaml on 64 nodes (512 GPUs), with a Secret in env and a pull secret, so that the
    references mode asks four SubjectAccessReviews (two claims, one Secret... see kubetitan.admission.VERBS)."""
    doc = yaml.safe_load((ROOT / "examples" / "llama3-70b-p5.yaml").read_text())
    doc["metadata"] = {"name": "llama3-70b-64", "namespace": BENCH_NS}
    s = doc["spec"]
    s["resources"]["nodes"] = 64
    s["training"]["globalBatchSize"] = 1024
    s["resources"]["env"] = [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}}]
    s["resources"]["imagePullSecrets"] = ["regcred"]
    return doc


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary(xs: list[float]) -> str:
    return (f"n={len(xs)} p50={pct(xs, 50):.1f} ms p90={pct(xs, 90):.1f} ms p99={pct(xs, 99):.1f} ms "
            f"max={max(xs):.1f} ms mean={statistics.fmean(xs):.1f} ms")


MODES = {
    "off": ("--requester-checks", "off"),
    "references": ("--requester-checks", "references"),
    "references-uncached": ("--requester-checks", "references", "--requester-cache-allowed-seconds", "0",
                            "--requester-cache-denied-seconds", "0"),
}
"""Bench mode -> the operator's flags."""
UNLIMITED = ("--webhook-rate-user-per-second", "100000", "--webhook-rate-user-burst", "1000000",
             "--webhook-rate-source-per-second", "100000", "--webhook-rate-source-burst", "1000000")
"""The per-caller budget of SubjectAccessReviews (kubetitan.webhook_guard) out of the way: one user creating runs
back to back would overdraw the chart's (10 a second) in the uncached mode, and the budget is not what is measured."""


def run_mode(mode: str, n: int, warmup: int, secret: dict[str, Any], vwc: dict[str, Any], tmp: Path
             ) -> dict[str, list[float]]:
    for key in ("tls.crt", "tls.key"):
        (tmp / key).write_bytes(base64.b64decode(secret["data"][key]))
    port = free_port()
    with Cluster(namespaces=(BENCH_NS,)) as c:
        webhooks.state(c.k)["endpoints"][SVC] = ("127.0.0.1", port)
        c.call(c.k.put(webhooks.VWC, vwc))
        kc = c.operator_kubeconfig(("ml",))
        op = OperatorProcess(kc, "--namespace", "ml", "--webhook-port", str(port), "--webhook-addr", "127.0.0.1",
                             "--webhook-cert-file", str(tmp / "tls.crt"), "--webhook-key-file", str(tmp / "tls.key"),
                             *MODES[mode], *UNLIMITED, "--policy-priority-classes", "training-high")
        with op:
            def listening() -> bool:
                with socket.socket() as s:
                    return s.connect_ex(("127.0.0.1", port)) == 0

            wait_for(listening, 30, "the webhook port")
            doc = spec_64_nodes()
            url = f"{c.url}/apis/kubetitan.io/v1alpha1/namespaces/{BENCH_NS}/llamapretrains"
            session = requests.Session()
            session.headers["Authorization"] = "Bearer kmock"
            creates: list[float] = []
            calls = webhooks.state(c.k)["calls"]
            for i in range(warmup + n):
                if i == warmup:
                    calls.clear()
                t0 = time.perf_counter()
                r = session.post(url, params={"fieldValidation": "Strict"}, json=copy.deepcopy(doc), timeout=30)
                dt = (time.perf_counter() - t0) * 1000
                assert r.status_code == 201, r.text
                if i >= warmup:
                    creates.append(dt)
                c.delete("kubetitan.io/v1alpha1/llamapretrains", BENCH_NS, doc["metadata"]["name"])
            hooks = [x.seconds * 1000 for x in calls if x.outcome == "allowed"]
            assert len(hooks) == n, (len(hooks), [x for x in calls if x.outcome != "allowed"][:3])
            warned = r.headers.get("Warning", "")
        c.call(webhooks.close(c.k))
    return {"webhook": hooks, "create": creates, "warnings": [warned]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "webhook"))
    p.add_argument("--rounds", type=int, default=3,
                   help="split each mode's creates into this many rounds, the modes taking turns, so that a change "
                        "in the shared machine's load falls on every mode alike (default %(default)s)")
    p.add_argument("--tag", default="", help="appended to the result files' names (e.g. the date or the commit)")
    a = p.parse_args()
    docs = rbac.render_chart_with_certificates()  # the bench mounts a pair as cert-manager issues it
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-webhook-tls"))
    vwc = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    lines = [f"# webhook_bench {stamp}: {a.requests} creates of a 64-node LlamaPretrain per mode in {a.rounds} "
             f"rounds, modes taking turns (each round after {a.warmup} warm-up), {platform.node()}, python "
             f"{platform.python_version()}, {socket.gethostname()} load average "
             f"{open('/proc/loadavg').read().split()[:3]} at the start"]
    raw: dict[str, Any] = {"stamp": stamp, "requests": a.requests, "warmup": a.warmup, "rounds": a.rounds,
                           "load_average": {}}
    per_round = [a.requests // a.rounds + (i < a.requests % a.rounds) for i in range(a.rounds)]
    with tempfile.TemporaryDirectory() as tmp:
        for r, n in enumerate(per_round):
            for mode in MODES:
                res = run_mode(mode, n, a.warmup, secret, vwc, Path(tmp))
                got = raw.setdefault(mode, {"webhook": [], "create": [], "warnings": res["warnings"]})
                got["webhook"] += res["webhook"]
                got["create"] += res["create"]
            raw["load_average"][f"after round {r + 1}"] = open("/proc/loadavg").read().split()[:3]
        for mode in MODES:
            res = raw[mode]
            lines.append(f"requesterChecks={mode:19s} webhook: {summary(res['webhook'])}")
            lines.append(f"requesterChecks={mode:19s} create:  {summary(res['create'])}")
        lines.append(f"load average after each round: {raw['load_average']}")
    lines.append(f"warnings on each create: {raw['off']['warnings'][0] or '(none)'}")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = stamp + (f"-{a.tag}" if a.tag else "")
    (out / f"{name}.txt").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"raw samples: {out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
