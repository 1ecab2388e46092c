"""The real torchtitan train loop on CPU: 2 gloo ranks, FSDP dp_shard=2, the test model (support.specs.TEST_MODEL).

Runs are data (like torchtitan's OverrideDefinitions): each case is a list of launches in one
dump folder. All share one xdist group so that two torch runs never overlap on the 2-core CI box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kubetitan_core import contract
from kubetitan_core.contract import ExitCode
from kubetitan_trainer.recovery import anatomy
from kmockx.harness import free_port  # the tests' one port allocator (no bind-0 races between tests)
from kubetitan_trainer.local import scrape

from support import hold, warm
from support.specs import tiny_lpt, write_config
from support.trainer import step_records as records

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("trainer-torch"), pytest.mark.timeout(900)]

STEPS = 8
"""Steps of the runs that act mid-run: each action lands while the workers are held after a known step
(``support.hold``), so no window of extra steps has to outlast the test's reaction (until now 88 steps after the
trigger, ~3 s at the 35 ms a step of ``support.specs.TINY``). 8 steps, a checkpoint every 4."""


def launch(config: Path, env_extra: dict[str, str] | None = None) -> warm.WarmProcess | subprocess.Popen:
    """The launcher for ``config``: 2 local workers (``env_extra``: e.g. ``support.hold.env``)."""
    env = {**os.environ, contract.ENV_ATTEMPT: "3", contract.ENV_JOB_START_TIME: "1700000000", "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    return warm.popen("kubetitan_trainer.launch",
                      [f"--config={config}", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                       f"--master-port={free_port()}", "--rdzv-id=test", "--max-restarts=0"],
                      env, config.with_suffix(".log"), cwd=REPO)


def losses(dump: Path) -> dict[int, float]:
    return {rec["step"]: rec["loss"] for rec in records(dump)}


def tail(config: Path) -> str:
    return config.with_suffix(".log").read_text(errors="replace")[-4000:]


def wait_for(proc: warm.WarmProcess | subprocess.Popen, port: int, cond, timeout: float = 400) -> dict[str, float] | None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            m = scrape(port)
            if cond(m):
                return m
        except OSError:
            pass
        time.sleep(0.3)
    return None


def test_train_metrics_sigterm_resume_and_partial_checkpoint(tmp_path):
    """One uninterrupted run (async saves), then a run stopped by SIGTERM and resumed: same losses step by step.

    Both act while their workers are held after step 2 (``support.hold``): A reads /metrics, B gets SIGTERM (the
    workers let go once the launcher has created their stop file)."""
    steps, every = STEPS, 4  # A saves asynchronously at steps 4 and 8
    # --- A: uninterrupted, with the metrics endpoint checked while it runs
    port = free_port()
    a_dump = tmp_path / "a"
    # A saves asynchronously (the API's default), B synchronously: the losses must not tell them apart.
    a_cfg = write_config(tmp_path / "a.toml", tiny_lpt({"training": {"steps": steps},
                                                   "checkpoint": {"asyncMode": "async", "intervalSteps": every}}),
                         a_dump, {"kubetitan": {"metrics_port": port, "metrics_host": "127.0.0.1"}})
    held = tmp_path / "held-a"
    proc = launch(a_cfg, hold.env(held, 2))
    hold.wait_held(held, 2, ranks=2, alive=lambda: proc.poll() is None)
    m = wait_for(proc, port, lambda m: m.get(contract.M_STEP, 0) >= 2 and contract.M_LOSS in m)
    text = None
    if m is not None:
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    hold.go(held, 2)
    assert proc.wait(timeout=600) == 0, tail(a_cfg)
    assert m is not None, "metrics endpoint never showed step >= 2: " + tail(a_cfg)
    now = time.time()
    assert 0 < m[contract.M_LOSS] < 20
    assert m[contract.M_TOKENS_PER_SECOND_PER_GPU] > 0
    assert m[contract.M_TOKENS_PER_SECOND] == pytest.approx(2 * m[contract.M_TOKENS_PER_SECOND_PER_GPU])
    assert m[contract.M_FLOPS_PER_GPU] > 0
    assert m[contract.M_TOTAL_STEPS] == steps
    assert m[contract.M_ATTEMPT] == 3 and m[contract.M_JOB_START_TIMESTAMP] == 1700000000
    assert now - 120 < m[contract.M_LAST_STEP_TIMESTAMP] <= now
    assert m[contract.M_PRODUCTIVE_SECONDS] > 0
    assert m[contract.M_TOKENS] >= 2 * 2 * 4 * 64  # >= 2 steps x 2 ranks x batch 4 x seq 64
    assert m[contract.M_MEMORY_MAX_RESERVED] > 1e7
    assert m[contract.M_STEP_DURATION + "_count"] >= 2 and m[contract.M_DATA_LOADING_DURATION + "_count"] >= 2
    assert contract.M_MFU not in m  # CPU: no peak, no MFU series (documented)
    a_log = a_cfg.with_suffix(".log").read_text(errors="replace")  # ... and no MFU from torchtitan's A100 fallback
    assert "fallback to A100" not in a_log and "mfu: n/a" in a_log and "MFU is not computed" in a_log
    assert not re.search(r"mfu: [0-9]", a_log), "a step line shows an MFU on CPU"
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    a = losses(a_dump)
    assert sorted(a) == list(range(1, steps + 1))
    assert a[steps] < a[1] - 1.0, f"loss did not fall: {a}"
    ck = a_dump / contract.CHECKPOINT_SUBDIR
    assert all((ck / f"step-{s}" / contract.DCP_METADATA_FILE).is_file() for s in (every, steps))

    # --- B: same config, SIGTERM once step >= 2 -> full checkpoint at that step, exit 75
    port = free_port()
    b_dump = tmp_path / "b"
    b_obj = tiny_lpt({"training": {"steps": steps}, "checkpoint": {"intervalSteps": 2 * steps}})  # no periodic save
    b_cfg = write_config(tmp_path / "b.toml", b_obj, b_dump,
                         {"kubetitan": {"metrics_port": port, "metrics_host": "127.0.0.1"}})
    held = tmp_path / "held-b"
    proc = launch(b_cfg, hold.env(held, 2))
    hold.wait_held(held, 2, ranks=2, alive=lambda: proc.poll() is None)
    assert wait_for(proc, port, lambda m: m.get(contract.M_STEP, 0) >= 2) is not None, tail(b_cfg)
    proc.send_signal(signal.SIGTERM)
    stop, deadline = hold.stop_file(held, 2), time.monotonic() + 60
    while not stop.exists() and time.monotonic() < deadline:  # the launcher's answer to SIGTERM: the workers'
        time.sleep(0.05)                                       # stop file, read at the next step's end
    assert stop.exists(), tail(b_cfg)
    hold.go(held, 2)
    assert proc.wait(timeout=300) == ExitCode.TERMINATED_CHECKPOINTED, tail(b_cfg)
    saved = sorted(int(p.name.split("-")[1]) for p in (b_dump / contract.CHECKPOINT_SUBDIR).glob("step-*"))
    assert len(saved) == 1 and 2 <= saved[0] < steps, saved
    stop = saved[0]
    assert (b_dump / contract.CHECKPOINT_SUBDIR / f"step-{stop}" / contract.DCP_METADATA_FILE).is_file()
    assert "Saving a full checkpoint" in tail(b_cfg)
    # a clean stop is no worker failure in the launcher's log
    assert "Workers stopped cleanly after saving the stop checkpoint" in tail(b_cfg)
    assert "failed first" not in tail(b_cfg) and "ERROR failed (exitcode: 75)" not in tail(b_cfg), tail(b_cfg)

    # --- B': a newer partial save (no .metadata) must be skipped with a warning; resume at stop+1
    partial = b_dump / contract.CHECKPOINT_SUBDIR / f"step-{stop + 1}"
    shutil.copytree(b_dump / contract.CHECKPOINT_SUBDIR / f"step-{stop}", partial)
    (partial / contract.DCP_METADATA_FILE).unlink()
    before = len(losses(b_dump))
    proc = launch(b_cfg)
    assert proc.wait(timeout=600) == 0, tail(b_cfg)
    log = tail(b_cfg)
    assert f"Skipped checkpoint step-{stop + 1}" in b_cfg.with_suffix(".log").read_text()
    assert f"Training starts at step {stop + 1}" in b_cfg.with_suffix(".log").read_text(), log
    b = losses(b_dump)
    assert before == stop and sorted(b) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert b[s] == pytest.approx(a[s], rel=1e-4, abs=1e-5), (s, a, b)


RECIPES = [
    ("fp8-tensorwise-fsdp-all-gather-precomputed-scales-emulated",
     {"compile": False, "float8": {"enabled": True, "recipe": "tensorwise", "fsdpFloat8AllGather": True,
                                   "precomputeDynamicScale": True, "emulate": True}},
     ["FSDP FP8 all-gather is on", "precomputed FP8 scales is on", "Swapped to Float8Linear"]),
    ("compile", {"compile": True}, ["Compiling each TransformerBlock with torch.compile",
                                    # the start-up network check (kubetitan_trainer.netcheck) after step 1
                                    "Network check: NCCL is not in use (no GPU"]),
]


@pytest.mark.parametrize(("name", "precision", "log_lines"), RECIPES, ids=[r[0] for r in RECIPES])
def test_seed_recipe_features_on_cpu(name, precision, log_lines, tmp_path):
    """The seeds' recipe on 2 ranks: FP8 in torchao's emulation mode (eager only), and torch.compile.

    torch.compile runs with the ``aot_eager`` backend here: Dynamo captures and AOTAutograd splits the same forward
    and backward graphs of every TransformerBlock that Inductor gets on a GPU (tests/fast/test_compiled_head.py does
    the same), without Inductor's C++ code generation for CPU kernels, which no GPU run uses and which cost ~45 s of
    CPU here (docs/testing.md, "The test model")."""
    obj = tiny_lpt({
        "training": {"steps": 2, "seqLen": 32, "localBatchSize": 2},
        "precision": {"activationCheckpointing": "none", "mixedPrecisionParam": "float32", **precision},
        "data": {"source": "synthetic"},
        "checkpoint": {"enabled": False},
    })
    patch = {"kubetitan": {"metrics_port": 0}}
    if precision.get("compile"):
        patch["compile"] = {"backend": "aot_eager"}
    cfg = write_config(tmp_path / "f.toml", obj, tmp_path / "f", patch)
    proc = launch(cfg)
    assert proc.wait(timeout=800) == 0, tail(cfg)
    text = cfg.with_suffix(".log").read_text()
    for line in log_lines:
        assert line in text, line
    assert sorted(losses(tmp_path / "f")) == [1, 2]


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # no such process, or it ended between the lookup and the read (ESRCH)
        return []


def _cut_off_newest_save(workers: list[int], tier: Path, newer_than: int) -> int:
    """Freeze every worker where both ranks' tiers hold the same step T > ``newer_than``, make T's DCP save look cut
    off (no .metadata, as when a failure lands in it), and return T; the workers stay stopped."""
    for _ in range(200):
        for w in workers:
            os.kill(w, signal.SIGSTOP)
        metas = [tier / f"rank-{r}.json" for r in range(2)]
        steps = {json.loads(m.read_text())["step"] if m.exists() else -1 for m in metas}
        if len(steps) == 1 and min(steps) > newer_than:
            t = steps.pop()
            folder = Path(json.loads(metas[0].read_text())["checkpoint_folder"])
            (folder / f"step-{t}" / ".metadata").unlink(missing_ok=True)
            return t
        for w in workers:  # a tier write in flight on one rank: let the step finish, look again
            os.kill(w, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the two ranks' tiers never held the same step")


def test_in_place_restart_restarts_every_rank_and_resumes_from_the_checkpoint(tmp_path):
    """--max-restarts=2: one worker SIGKILLed after the first checkpoint (step 1); the same launcher forks new workers
    for both ranks, they resume from step 1 out of the restore tier (the replayed step 2 has the same loss). Then a
    kill whose step-T DCP save was cut off (its .metadata gone): the tier, written before DCP's save, holds T on
    both ranks, so generation 2 resumes at T + 1 from it, not from step 1, the newest complete checkpoint (no lost
    steps). Each generation's start-up anatomy is logged, the tier folder is gone when the launcher exits.

    Both kills land while the workers are held (``support.hold``), before the run's next save: the first after step
    2 (the step-K save, checkpoint interval K, not made yet); the second after step K + 1 (the step-K save made, the
    final one not). torchtitan's first-step checkpoint (``checkpoint.enable_first_step_checkpoint``, the same save as
    any other) gives the first kill its checkpoint after one step instead of K."""
    first, every = 1, STEPS // 2
    steps, port = STEPS, free_port()
    held = tmp_path / "held"
    tier = tmp_path / "tier"
    dump = tmp_path / "ip"
    cfg = write_config(tmp_path / "ip.toml", tiny_lpt({"training": {"steps": steps}, "data": {"source": "synthetic"},
                                                  "checkpoint": {"intervalSteps": every}}),
                       dump, {"kubetitan": {"metrics_port": port, "metrics_host": "127.0.0.1"},
                              "checkpoint": {"enable_first_step_checkpoint": True}})
    env = {**os.environ, contract.ENV_ATTEMPT: "0", "OMP_NUM_THREADS": "1"}
    proc = warm.popen("kubetitan_trainer.launch",
                      [f"--config={cfg}", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                       f"--master-port={free_port()}", "--rdzv-id=inplace", "--max-restarts=2", "--monitor-interval=0.1",
                       f"--restore-tier={tier}"], {**env, **hold.env(held, 2, every + 1)}, cfg.with_suffix(".log"),
                      cwd=REPO)
    hold.wait_held(held, 2, ranks=2, alive=lambda: proc.poll() is None)
    m = wait_for(proc, port, lambda m: m.get(contract.M_LAST_CHECKPOINT_STEP, 0) >= first
                 and m.get(contract.M_STEP, 0) >= first + 1)
    assert m is not None, tail(cfg)
    assert m[contract.M_RESUMED_FROM_STEP] == 0, m  # generation 0 started fresh
    first_workers = _children(proc.pid)
    assert len(first_workers) == 2, first_workers
    os.kill(first_workers[1], signal.SIGKILL)
    hold.go(held, 2)  # generation 1 trains step 2 again, unheld
    hold.wait_held(held, every + 1, ranks=2, alive=lambda: proc.poll() is None)
    m = wait_for(proc, port, lambda m: m.get(contract.M_RESTART_GENERATION, 0) == 1
                 and m.get(contract.M_LAST_CHECKPOINT_STEP, 0) >= every)
    assert m is not None, tail(cfg)
    second_workers = _children(proc.pid)
    assert len(second_workers) == 2 and not set(second_workers) & set(first_workers), second_workers
    cut = _cut_off_newest_save(second_workers, tier, newer_than=first)
    for w in second_workers:  # both: a surviving rank 0 must not finish the cut-off save's .metadata
        os.kill(w, signal.SIGKILL)
    hold.go(held, every + 1)
    assert proc.wait(timeout=600) == 0, tail(cfg)
    text = cfg.with_suffix(".log").read_text(errors="replace")
    assert "restarting every rank's workers in place" in text
    runs = [int(json.loads(x)["step"]) for x in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines()]
    restart_at = next(i for i in range(1, len(runs)) if runs[i] <= runs[i - 1])
    assert runs[restart_at] == first + 1  # resumed after the first checkpoint (the step-K one did not exist yet)
    assert runs[-1] == steps
    by_gen = [json.loads(x) for x in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines()]
    gen2 = [r["step"] for r in by_gen if r.get("generation") == 2]
    assert gen2[0] == cut + 1, (cut, runs)  # the cut-off step's tier, not the newest complete DCP (step 1)
    assert f"Resuming from the newest complete checkpoint, step {first}" in text
    recs = [json.loads(x) for x in (dump / "kubetitan" / "steps.jsonl").read_text().splitlines()]
    before, after = recs[:restart_at], recs[restart_at:]
    replayed = first + 1
    assert next(r["loss"] for r in after if r["step"] == replayed) == next(r["loss"] for r in before
                                                                             if r["step"] == replayed)
    assert f"Loaded step {first} from the restore tier" in text and not tier.exists()
    assert f"Every rank's restore tier holds step {cut}, newer than the newest complete checkpoint" in text
    starts = [json.loads(x) for x in (dump / "kubetitan" / "startup.jsonl").read_text().splitlines()]
    assert [(s["generation"], s["origin"], s["first_step"], s["checkpoint_source"]) for s in starts] == [
        (0, "launcher_start", 1, "none"), (1, "failure_detected", first + 1, "restore_tier"),
        (2, "failure_detected", cut + 1, "restore_tier")]
    for s in starts:
        assert list(s["phases"]) == list(anatomy.PHASES) and min(s["phases"].values()) >= 0
        assert sum(s["phases"].values()) == pytest.approx(s["total_seconds"])
    assert starts[0]["phases"]["imports"] > starts[1]["phases"]["imports"]  # generation 1's workers were forked warm
    # the pod's pre-flight gate ran once, before generation 0 (on CPU: the product and a one-rank gloo all-reduce)
    gate = starts[0]["preflight"]
    assert gate["status"] == "passed" and starts[0]["phases"]["preflight"] > 0
    assert {r["check"]: r["status"] for r in gate["rows"]} == {
        "gpu_count": "skipped", "gpu_model": "skipped", "nvml": "skipped", "matmul": "passed",
        "matmul_tflops": "skipped", "allreduce": "passed", "efa": "skipped"}
    assert all("preflight" not in s and s["phases"]["preflight"] == 0 for s in starts[1:])
    assert starts[1]["phases"]["checkpoint_load"] > 0
