"""Every dashboard panel's query against a REAL Prometheus scraping a REAL CPU training run and the
operator's metrics server; plus `promtool check metrics` on both exporters' output.

Prometheus (Debian's, from `make tools`) listens on 127.0.0.1 on a free port with tmp storage and
scrapes every half second: the trainer (examples/debug-cpu.yaml: torchtitan's debug model, 2 gloo ranks, launched
exactly as `kubetitan run` launches it, with the trainer's own `write_config`) as job kubetitan-trainer, and
the operator's `OperatorMetrics` served by prometheus-client as the operator serves it (with
per-run series recorded through its own methods) as job kubetitan-operator. The static target
labels stand in for the chart's PodMonitor relabelling (namespace, pod, name).

The queries need the trainer training until the last one (rates, the ETA "while the run trains"); the test kills
it then. ``STEPS`` steps of the debug model with a checkpoint and an evaluation every 2 take ~0.7 s each here (at
load 4): the last query ran at step ~10, with minutes of training left (the slack is printed at the end:
bench/results/suite/s16_windows_trainer.txt). The test model's steps would save no CPU: the trainer trains flat out
until the test kills it either way.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import tomli_w
import yaml

from kubetitan_core import contract
from kubetitan_core.api import LlamaPretrain, TrainingStatus
from kubetitan.monitoring import dashboards, queries
from kubetitan.monitoring.config import DEFAULT
from support.procs import die_with_parent
from support.trainer import step_records
from support.windows import slack
from support import yamlio

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "charts" / "kubetitan" / "files" / "kubetitan-rules.yaml"
NS, NAME = "ml", "live-debug"
SCRAPE = "500ms"  # half a second: the 10 scrapes the test waits for take 5 s of the trainer's (2 ranks') CPU, not 10
RATE = "8s"  # stands in for Grafana's $__rate_interval (at least 4 scrape intervals) at that scrape interval
STEPS = 400
pytestmark = pytest.mark.xdist_group("live-prometheus")


def free_port() -> int:
    """A free port BELOW the kernel's ephemeral range: gloo and the clients bind ephemeral ports
    at random, and one could take a port picked here before the trainer binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20000, min(low, 32768))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def binary(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run `make tools` (Debian's prometheus package)")
    return found


def http_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what: str, check, timeout: float, proc=None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            pytest.fail(f"{what}: process exited with {proc.returncode} first\n{tail}")
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last})\n{tail}")


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (torchrun starts each worker in its own session,
    so killing the launcher's process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop(proc) -> None:
    """Stop a process and everything it started (SIGKILL: the test needs no checkpoint)."""
    if proc.poll() is None:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=30)


def start_trainer(tmp: Path, metrics_port: int):
    from kubetitan_trainer.local import processes_per_node, write_config

    lpt = LlamaPretrain.model_validate(yamlio.load((REPO / "examples" / "debug-cpu.yaml").read_text()))
    lpt.metadata.name, lpt.metadata.namespace = NAME, NS
    out = tmp / "run"
    out.mkdir()
    config = write_config(lpt, out, STEPS, metrics_port)
    cfg = tomllib.loads(config.read_text())
    # The CPU has no FLOP/s peak, so the trainer would not export MFU; borrow an H100's so that
    # the MFU panel has a series (its value is tiny and meaningless here).
    cfg["kubetitan"]["gpu_product"] = "H100"
    # Small steps and an early checkpoint: the test needs series, not training (a loaded CI machine
    # runs these steps slowly).
    cfg["training"]["seq_len"] = 64
    cfg["training"]["local_batch_size"] = 2
    cfg["checkpoint"]["interval"] = 2
    cfg["metrics"]["log_freq"] = 1
    # A two-source mixture (the shipped corpus prepared twice) with a held-out evaluation every 2 steps: the eval and
    # per-source token, loss and epoch panels get series.
    from kubetitan_trainer.data.loaders import BUILTIN_CORPUS

    paths = []
    for name in ("web", "code"):
        r = subprocess.run([sys.executable, "-m", "kubetitan_trainer.data.prepare", str(BUILTIN_CORPUS), "-o",
                            str(tmp / name), "--workers", "1", "--no-progress"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        paths.append(str(tmp / name))
    cfg["kubetitan"]["data"] = {"source": "mixture", "mixture_paths": paths, "mixture_weights": [3, 1],
                                "mixture_names": ["web", "code"], "eval_samples": 4, "held_out_percent": 5}
    cfg["validation"] = {"enable": True, "freq": 2, "steps": -1}
    config.write_text(tomli_w.dumps(cfg))
    log = out / "train.log"
    args = [f"--config={config}", "--nnodes=1", f"--nproc-per-node={processes_per_node(lpt)}", "--node-rank=0",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--rdzv-id=live-{NAME}", "--dns-timeout=5",
            "--max-restarts=0"]
    env = {**os.environ, contract.ENV_ATTEMPT: "0", contract.ENV_JOB_NAME: NAME, contract.ENV_JOB_NAMESPACE: NS,
           contract.ENV_JOB_START_TIME: str(int(time.time())), "OMP_NUM_THREADS": "1"}  # torchrun's default for workers
    # ``python -m kubetitan_trainer.launch ARGS``, forked from the tests' warm parent (support.warm: torch imported
    # once per test process; `kubetitan run`'s cold start is tests/trainer/test_local_run.py's)
    from support import warm

    return warm.popen("kubetitan_trainer.launch", args, env, log, cwd=REPO, new_session=True), log


def start_operator_metrics(port: int):
    """The operator's metrics, served the way runner.run serves them, with one run's series."""
    from prometheus_client import start_http_server

    from kubetitan.operator_metrics import OperatorMetrics

    m = OperatorMetrics()
    server, _ = start_http_server(port, "127.0.0.1", registry=m.registry)
    m.set_phase(NS, NAME, "Running")
    m.set_phase(NS, "other", "Succeeded")
    m.set_training(NS, NAME, TrainingStatus(step=40, total_steps=400, tokens_per_second=1234.0, mfu=0.41,
                                            goodput=0.93), restart_count=1)
    m.restarted(NS, NAME, "NodeFailure")
    for seconds in (0.01, 0.03, 0.2):
        m.reconcile.observe(seconds)
    m.errors.labels("ApiError").inc()
    m.recovery.observe(42.0)
    return m, server


def prometheus_config(trainer_port: int, operator_port: int) -> dict:
    return {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": "450ms", "evaluation_interval": "1s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {"job_name": DEFAULT.trainer_job,
             "static_configs": [{"targets": [f"127.0.0.1:{trainer_port}"],
                                 "labels": {"namespace": NS, "name": NAME, "pod": f"{NAME}-a0-0", "rank": "0"}}]},
            {"job_name": DEFAULT.operator_job, "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"],
                                 "labels": {"namespace": "kubetitan-system", "pod": "kt-kubetitan-0"}}]},
        ],
    }


def substitute(expr: str) -> str:
    return expr.replace("$namespace", NS).replace("$job", NAME).replace("$__rate_interval", RATE)


def panel_targets():
    for dash in (dashboards.run_dashboard(), dashboards.operator_dashboard()):
        for panel in dash["panels"]:
            for t in panel["targets"]:
                yield f"{dash['uid']}/{panel['title']}/{t['refId']}", t["expr"]


def annotation_queries():
    for dash in (dashboards.run_dashboard(), dashboards.operator_dashboard()):
        for a in dash["annotations"]["list"]:
            yield f"{dash['uid']}/annotation {a['name']}", a["expr"]


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=30)


def test_operator_exporter_passes_promtool_check_metrics():
    from prometheus_client import generate_latest

    port = free_port()
    m, server = start_operator_metrics(port)
    try:
        text = generate_latest(m.registry).decode()
    finally:
        server.shutdown()
    assert "kubetitan_operator_job_step{" in text
    proc = promtool_check_metrics(text)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_every_dashboard_query_returns_series_from_a_real_prometheus(tmp_path):
    prom_port, trainer_port, operator_port = free_port(), free_port(), free_port()
    trainer, train_log = start_trainer(tmp_path, trainer_port)
    m, op_server = start_operator_metrics(operator_port)
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(prometheus_config(trainer_port, operator_port)))
    prom_log = tmp_path / "prometheus.log"
    with open(prom_log, "wb") as f:
        prom = subprocess.Popen(
            [binary("prometheus"), f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h"],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    try:
        wait_for("prometheus ready", lambda: http_text(f"http://127.0.0.1:{prom_port}/-/ready").strip(), 60, prom, prom_log)

        def instant(expr: str) -> dict:
            return http_json(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))

        def scalar(expr: str) -> float | None:
            r = instant(expr)["data"]["result"]
            return float(r[0]["value"][1]) if r else None

        # Train until a checkpoint is saved and 10 scrapes of a rate window cover the run and the operator.
        wait_for("a checkpoint and a rate window of scrapes in Prometheus",
                 lambda: (scalar(f'max({contract.M_LAST_CHECKPOINT_STEP}{{job="{DEFAULT.trainer_job}"}}) > 0') and
                          scalar(f'count_over_time({contract.M_STEP}{{job="{DEFAULT.trainer_job}"}}[{RATE}]) >= 10') and
                          scalar(f'count_over_time(up{{job="{DEFAULT.operator_job}"}}[{RATE}]) >= 10')),
                 300, trainer, train_log)

        # promtool check metrics on the trainer's live exposition (both exporters' output).
        text = http_text(f"http://127.0.0.1:{trainer_port}/metrics")
        assert contract.M_MFU in text and contract.M_STEP_DURATION + "_bucket" in text
        proc = promtool_check_metrics(text)
        assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr

        empty, failed = [], []
        for ident, expr in panel_targets():
            r = instant(substitute(expr))
            if r.get("status") != "success":
                failed.append(f"{ident}: {r.get('error')}")
            elif not r["data"]["result"]:
                empty.append(f"{ident}: {substitute(expr)}")
        assert not failed, "queries Prometheus rejected:\n" + "\n".join(failed)
        assert not empty, "queries with no series:\n" + "\n".join(empty)

        # The dashboards' template variables offer this run.
        for var in dashboards.run_dashboard()["templating"]["list"]:
            if var["type"] != "query":
                continue
            m_ = re.fullmatch(r"label_values\((.+), (\w+)\)", substitute(var["query"]["query"]))
            values = http_json(f"{api}/label/{m_.group(2)}/values?" + urllib.parse.urlencode({"match[]": m_.group(1)}))
            assert {NS, NAME} & set(values["data"]), (var["name"], values)

        # A few values are what the run and the operator reported.
        assert scalar(substitute(queries.total_steps(DEFAULT))) == STEPS
        assert 0 < scalar(substitute(queries.mfu(DEFAULT))) < 1
        assert scalar(substitute(queries.job_restarts(DEFAULT))) == 1
        assert scalar(substitute(queries.goodput(DEFAULT))) == pytest.approx(0.93)
        # ETA: the steps left at the slowest pod's pace, so positive and finite while the run trains
        eta = scalar(substitute(queries.eta_seconds(DEFAULT)))
        assert eta is not None and 0 < eta < 1e6, eta
        assert scalar(substitute(queries.finish_time_ms(DEFAULT))) > time.time() * 1000

        # Restart annotations: nothing while the restart count stands still; a restart (the operator records it
        # as it does in a cycle: the cause counter and the run's count) marks the dashboard within a rate window.
        annotations = list(annotation_queries())
        assert [name for name, _ in annotations] == ["kubetitan-run/annotation Restarts",
                                                     "kubetitan-run/annotation Restart causes"]
        for ident, expr in annotations:
            r = instant(substitute(expr))
            assert r.get("status") == "success", f"{ident}: {r.get('error')}"
            assert r["data"]["result"] == [], f"{ident} marks a restart before there was one: {r['data']['result']}"
        m.restarted(NS, NAME, "NodeFailure")
        m.set_training(NS, NAME, TrainingStatus(step=41, total_steps=400), restart_count=2)
        for ident, expr in annotations:
            result = wait_for(f"{ident} to mark the restart", lambda e=expr: instant(substitute(e))["data"]["result"],
                              30, prom, prom_log)
            if "cause" in expr:
                assert [x["metric"] for x in result] == [{"cause": "NodeFailure", "mode": "Recreate"}], result

        # Prometheus loaded the generated rules and evaluates them without errors.
        groups = http_json(f"{api}/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == len(yamlio.load(RULES_FILE.read_text())["groups"][0]["rules"])
        assert all(r["health"] in ("ok", "unknown") for r in rules), [r for r in rules if r["health"] == "err"]
        slack("the last query", step_records(tmp_path / "run"), STEPS)
    finally:
        stop(trainer)
        op_server.shutdown()
        stop(prom)
