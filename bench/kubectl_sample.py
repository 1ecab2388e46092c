"""Real `kubectl get lpt` output for the docs: prints what kubectl prints, asserts nothing.

The REAL operator (in-process kopf) and the REAL trainer (torchrun + torchtitan's debug model on CPU, gloo)
run against the strict API double (tests/kmockx) with the e2e kubelet double (tests/e2e/kubelet.py, 2 "nodes"
x 1 process), exactly as in tests/e2e. One run of ``--steps`` steps checkpoints every ``--interval`` steps;
rank 1's processes are SIGKILLed once the run has passed ``--kill-at`` (so the sample shows a restart). The
real kubectl (``.tools/bin/kubectl``, or the one on PATH) is run with the API double's admin kubeconfig:

- ``kubectl get lpt`` and ``kubectl get lpt -o wide`` once the new attempt has trained past ``--show-at``;
- ``kubectl get pods`` at the same moment;
- ``kubectl get lpt`` and ``kubectl describe lpt`` once the run has succeeded.

Everything kubectl printed goes to stdout, each block headed by the command line, and to ``--out``:

    .venv/bin/python bench/kubectl_sample.py --out bench/results/kubectl_sample
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "e2e")]

from common import free_port  # noqa: E402
from support.specs import CLAIM, NS, e2e_spec, lpt, with_debug_model  # noqa: E402
from kubelet import Kubelet  # noqa: E402

from kmockx.harness import Cluster, Operator  # noqa: E402

NAME = "debug-2node"


def kubectl_path() -> str:
    local = REPO / ".tools" / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        sys.exit("kubectl not found: run `make tools` (it puts kubectl into .tools/bin)")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--interval", type=int, default=10, help="checkpoint interval in steps (default 10)")
    p.add_argument("--kill-at", type=int, default=15, help="kill rank 1 once status.training.step >= this")
    p.add_argument("--show-at", type=int, default=30, help="run kubectl get once the next attempt passed this step")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    p.add_argument("--out", type=Path, help="directory for the raw output (kubectl.txt)")
    a = p.parse_args()
    kubectl = kubectl_path()
    blocks: list[str] = []

    def run(c: Cluster, *args: str) -> None:
        shown = " ".join(["kubectl", *args])
        r = subprocess.run([kubectl, "--kubeconfig", c.admin_kubeconfig, *args], capture_output=True, text=True,
                           timeout=60)
        block = f"$ {shown}\n{r.stdout}{r.stderr}" + ("" if r.returncode == 0 else f"(exit {r.returncode})\n")
        print(block, flush=True)
        blocks.append(block)

    tmp = Path(tempfile.mkdtemp(prefix="kubectl-sample-"))
    ckpt = tmp / "ckpt"
    t0 = time.time()
    with Cluster() as c, Kubelet(c, tmp / "kubelet", claims={CLAIM: ckpt}) as k, Operator(c, namespaces=(NS,)):
        spec = e2e_spec(ckpt, a.steps, a.interval, free_port(), hangTimeoutSeconds=120)
        c.apply(lpt(NAME, with_debug_model(spec)))
        killed = shown = False
        while time.time() - t0 < a.timeout:
            st = c.status(NS, NAME)
            step = (st.get("training") or {}).get("step") or 0
            attempt = st.get("attempt") or 0
            if not killed and attempt == 0 and step >= a.kill_at:
                try:
                    k.kill(NS, f"{NAME}-a0-1")
                except KeyError:  # the status is ahead of the kubelet: look again
                    time.sleep(0.1)
                    continue
                killed = True
                print(f"# killed {NAME}-a0-1 at step {step}", flush=True)
            if killed and not shown and attempt >= 1 and step >= a.show_at:
                run(c, "get", "lpt", "-n", NS)
                run(c, "get", "lpt", NAME, "-n", NS, "-o", "wide")
                run(c, "get", "pods", "-n", NS, "-l", f"kubetitan.io/name={NAME}")
                shown = True
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(0.2)
        run(c, "get", "lpt", "-n", NS)
        run(c, "describe", "lpt", NAME, "-n", NS)
        wall = time.time() - t0
        ok = shown and c.status(NS, NAME).get("phase") == "Succeeded"
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    head = (f"# commit {commit}: bench/kubectl_sample.py --steps {a.steps} --interval {a.interval} --kill-at {a.kill_at} "
            f"--show-at {a.show_at}\n# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}, "
            f"{platform.node()}, kubectl {kubectl}; wall {wall:.0f} s; {'OK' if ok else 'INCOMPLETE'}\n")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "kubectl.txt").write_text(head + "\n" + "\n".join(blocks))
        print(f"raw output: {a.out / 'kubectl.txt'}")
    print(head, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
