"""A two-"pod" torchrun gang on one host, exactly as the planner renders it.

Two launcher processes (``--nnodes 2``, one process each, gloo on CPU) are started with the container
command, args and env of the two pods that ``kubetitan.plan.attempt_children`` renders for a 2-node
LlamaPretrain; only what a node would provide is substituted: ``python`` -> this interpreter, the
ConfigMap mount -> a temp file, ``--master-addr`` (rank 0's headless-service name) -> 127.0.0.1, the
downward-API env (pod IP, node name) -> 127.0.0.1/127.0.0.2 and fake node names, and, because both
"pods" share this host's network, each pod's ``[kubetitan] metrics_host`` -> its own address. The
checkpoint claim is a temp dir mounted at the same path.

Then one process is killed mid-run (SIGKILL of the whole pod), the survivor is left to exit, and the
next attempt is started as the operator would (``attempt_children(lpt, attempt + 1)``): new pod
names, same checkpoint folder. It must resume from the newest complete checkpoint at the right step.

    .venv/bin/python bench/gang_cpu.py --steps 30 --interval 5 --kill-at 12
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from common import attempts_in_log, complete_checkpoints, free_port, step_log  # noqa: E402
from support.specs import CLAIM, e2e_spec, lpt, with_debug_model  # noqa: E402
from kubelet import _alive, _children_map  # noqa: E402

from kubetitan_core import contract  # noqa: E402
from kubetitan import plan
from kubetitan_core.validation import parse  # noqa: E402


def start_pod(pod: dict, cm: dict, workdir: Path, ip: str, node: str) -> subprocess.Popen:
    c = pod["spec"]["containers"][0]
    d = workdir / pod["metadata"]["name"]
    d.mkdir(parents=True)
    cfg = tomllib.loads(cm["data"][contract.CONFIG_KEY])
    cfg["kubetitan"]["metrics_host"] = ip  # one shared network namespace (see the module docstring)
    (d / contract.CONFIG_KEY).write_text(tomli_w.dumps(cfg))
    fields = {"status.podIP": ip, "spec.nodeName": node}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETITAN_", "MASTER_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    for e in c["env"]:
        env[e["name"]] = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    argv = [sys.executable if x == "python" else x for x in c["command"]]
    for a in c["args"]:
        if a.startswith("--config="):
            a = f"--config={d / contract.CONFIG_KEY}"
        elif a.startswith("--master-addr="):
            a = "--master-addr=127.0.0.1"
        argv.append(a)
    print("  $", " ".join(argv[-7:]), flush=True)
    log = open(d / "container.log", "wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def tree(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return [p for p in out if _alive(p)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=12, help="kill rank 1's pod once rank 0 logged this step")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gang-cpu-"))
    ckpt = tmp / "ckpt"
    spec = with_debug_model(e2e_spec(ckpt, a.steps, a.interval, free_port()))
    # This bench plays the gang re-creation path (a new attempt with new pods). With in-place restarts on
    # (runPolicy.maxInPlaceRestarts > 0) rank 0's launcher would wait in the rendezvous for the killed pod,
    # which only the operator replaces.
    spec["runPolicy"]["maxInPlaceRestarts"] = 0
    obj = lpt("gang", spec)
    obj["metadata"]["uid"] = "00000000-0000-0000-0000-000000000007"
    model, errors = parse(obj)
    assert model is not None and not errors, errors
    assert spec["checkpoint"]["storage"]["persistentVolumeClaim"]["claimName"] == CLAIM
    t0 = time.time()
    results = []
    for attempt in (0, 1):
        children = plan.attempt_children(model, attempt, job_start_time=t0)
        cm = next(x for x in children if x["kind"] == "ConfigMap")
        pods = [x for x in children if x["kind"] == "Pod"]
        print(f"attempt {attempt}: {[p['metadata']['name'] for p in pods]}", flush=True)
        procs = [start_pod(p, cm, tmp / "pods", f"127.0.0.{i + 1}", f"node-{i}") for i, p in enumerate(pods)]
        killed_at = None
        deadline = time.time() + a.timeout
        while time.time() < deadline and any(p.poll() is None for p in procs):
            log = step_log(ckpt)
            if attempt == 0 and killed_at is None and log and log[-1]["step"] >= a.kill_at:
                killed_at = log[-1]["step"]
                newest = max(complete_checkpoints(ckpt), default=0)
                for pid in tree(procs[1].pid):
                    os.kill(pid, signal.SIGKILL)
                print(f"  killed rank 1's pod at step {killed_at} (newest complete checkpoint: {newest})", flush=True)
            time.sleep(0.2)
        for p in procs:  # a node whose survivor hangs is cleaned up like a deleted pod
            for pid in tree(p.pid):
                os.kill(pid, signal.SIGKILL)
            p.wait()
        results.append({"attempt": attempt, "exit_codes": [p.returncode for p in procs], "killed_at": killed_at,
                        "newest_checkpoint": max(complete_checkpoints(ckpt), default=0)})
        print(f"  exit codes {[p.returncode for p in procs]}", flush=True)
    segs = attempts_in_log(step_log(ckpt))
    resumed_first = segs[-1][0]["step"] if len(segs) > 1 else None
    expect = results[0]["newest_checkpoint"]
    print("\n| attempt | pods exit codes | killed at step | newest complete checkpoint | first step |")
    print("|---|---|---|---|---|")
    print(f"| 0 | {results[0]['exit_codes']} | {results[0]['killed_at']} | {expect} | {segs[0][0]['step']} |")
    print(f"| 1 | {results[1]['exit_codes']} | - | {results[1]['newest_checkpoint']} | {resumed_first} |")
    lost = results[0]["killed_at"] - expect if results[0]["killed_at"] else None
    ok = resumed_first == expect + 1 and results[1]["exit_codes"] == [0, 0] and segs[-1][-1]["step"] == a.steps
    print(f"\nresumed at step {resumed_first} = newest complete checkpoint {expect} + 1: "
          f"{resumed_first == expect + 1}; lost steps {lost}; final step {segs[-1][-1]['step']}/{a.steps}; "
          f"wall {time.time() - t0:.0f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
