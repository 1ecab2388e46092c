"""The e2e kubelet double itself, with fake containers (``python -c``): statuses, signals, names, env.

Cheap (no torch): each container is a one-line Python program, so these run outside the ``e2e`` xdist group.
"""

from __future__ import annotations

import time

import pytest
from support.specs import NS
from kubelet import NAMESPACES

from kmockx.harness import PODS, wait_for


def _pod(name: str, code: str, grace: int = 30, rank: int = 0, run: str = "k") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"kubetitan.io/name": run, "kubetitan.io/rank": str(rank)}},
            "spec": {"hostname": name, "subdomain": run, "terminationGracePeriodSeconds": grace,
                     "restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": "x", "command": ["python", "-c", code],
                                     "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                             {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                             {"name": "PLAIN", "value": "v"}]}]}}


def _state(c, name: str) -> dict:
    pod = c.get(PODS, NS, name) or {}
    st = pod.get("status") or {}
    cs = (st.get("containerStatuses") or [{}])[0]
    return {"phase": st.get("phase"), **((cs.get("state") or {}).get("terminated") or {})}


@pytest.mark.parametrize(("code", "phase", "exit_code", "reason"), [
    ("pass", "Succeeded", 0, "Completed"),
    ("import sys; print('boom: bad value'); sys.exit(3)", "Failed", 3, "Error"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "Failed", 137, "Error"),
], ids=["exit-0", "exit-3-with-log-tail", "killed-by-signal"])
def test_exit_is_reported_like_a_kubelet(e2e, code: str, phase: str, exit_code: int, reason: str) -> None:
    c = e2e.cluster
    c.call(c.k.put(PODS, _pod("p", code)))
    got = wait_for(lambda: _state(c, "p") if _state(c, "p").get("phase") in ("Succeeded", "Failed") else None,
                   20, "terminated")
    assert (got["phase"], got["exitCode"], got["reason"]) == (phase, exit_code, reason)
    if exit_code == 3:
        assert "boom: bad value" in got["message"]
    pod = c.get(PODS, NS, "p")
    assert pod["spec"]["nodeName"] in e2e.kubelet.nodes and pod["status"]["podIP"].startswith("127.0.0.")


def test_downward_api_env_and_hosts_resolve_rank0(e2e) -> None:
    c, k = e2e.cluster, e2e.kubelet
    probe = ("import os, socket, time; time.sleep(0.5); "
             "print('ENV', os.environ['MY_IP'], os.environ['MY_NODE'], os.environ['PLAIN'], socket.gethostname(), "
             "socket.gethostbyname('r-0.k.ml.svc'), flush=True)")
    c.call(c.k.put(PODS, _pod("r-0", "import time; time.sleep(30)")))
    wait_for(lambda: _state(c, "r-0")["phase"] == "Running", 10, "rank 0 running")
    c.call(c.k.put(PODS, _pod("r-1", probe, rank=1)))
    wait_for(lambda: _state(c, "r-1")["phase"] == "Succeeded", 20, "probe done")
    ip0, ip1 = (c.get(PODS, NS, n)["status"]["podIP"] for n in ("r-0", "r-1"))
    assert ip0 != ip1
    line = next(ln for ln in k.log(NS, "r-1").splitlines() if ln.startswith("ENV"))
    node = c.get(PODS, NS, "r-1")["spec"]["nodeName"]
    if NAMESPACES:
        assert line.split() == ["ENV", ip1, node, "v", "r-1", ip0]
    else:  # no unshare here: names do not resolve, only the env is checked
        assert line.split()[:4] == ["ENV", ip1, node, "v"]


@pytest.mark.parametrize(("code", "grace", "want_code", "max_seconds"), [
    ("import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.1)", 30, 143, 5),
    ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
     "while True: time.sleep(0.1)", 2, 137, 10),
    ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\nprint('ready', flush=True)\n"
     "while True: time.sleep(0.1)", 30, 75, 5),
], ids=["sigterm-kills", "sigterm-ignored-sigkill-after-grace", "sigterm-handled-exit-75"])
def test_delete_sends_sigterm_then_sigkill_after_grace(e2e, code: str, grace: int, want_code: int,
                                                       max_seconds: float) -> None:
    c, k = e2e.cluster, e2e.kubelet
    c.call(c.k.put(PODS, _pod("t", code, grace=grace)))
    wait_for(lambda: _state(c, "t")["phase"] == "Running", 10, "running")
    wait_for(lambda: "ready" in k.log(NS, "t"), 10, "the program's handler installed (it prints ready after)")
    t0 = time.monotonic()
    c.delete(PODS, NS, "t")
    assert c.get(PODS, NS, "t")["metadata"]["deletionTimestamp"]  # graceful: terminating, not gone
    wait_for(lambda: c.get(PODS, NS, "t") is None, max_seconds + 5, "pod removed by the kubelet")
    took = time.monotonic() - t0
    assert k.exits[(NS, "t")][0] == want_code
    assert not k.live_processes()
    if want_code == 137:
        assert took >= grace


def test_oom_kill_and_node_failure(e2e) -> None:
    c, k = e2e.cluster, e2e.kubelet
    c.call(c.k.put(PODS, _pod("o", "import time; time.sleep(60)")))
    wait_for(lambda: _state(c, "o")["phase"] == "Running", 10, "running")
    k.oom_kill(NS, "o")
    got = wait_for(lambda: _state(c, "o") if _state(c, "o")["phase"] == "Failed" else None, 10, "oom")
    assert (got["exitCode"], got["reason"]) == (137, "OOMKilled")

    c.call(c.k.put(PODS, _pod("n", "import time; time.sleep(60)")))
    wait_for(lambda: _state(c, "n")["phase"] == "Running", 10, "running")
    node = c.get(PODS, NS, "n")["spec"]["nodeName"]
    k.fail_node(node)
    ready = next(x for x in c.get("v1/nodes", None, node)["status"]["conditions"] if x["type"] == "Ready")
    assert ready["status"] == "Unknown"
    c.delete(PODS, NS, "n")  # graceful: the dead kubelet never finishes it
    time.sleep(1)
    assert c.get(PODS, NS, "n")["metadata"]["deletionTimestamp"] and k.live_processes()
    k.force_delete(NS, "n")
    assert c.get(PODS, NS, "n") is None  # force delete
    time.sleep(0.5)
    assert k.live_processes(), "a dead node's processes are not touched until it comes back"
    k.restore_node(node)
    wait_for(lambda: not k.live_processes(), 10, "orphans killed when the node is back")
