"""The pod's pre-flight gate (``kubetitan_trainer.preflight``, ``kubetitan_trainer.launch.gate``): every check's pass
and fail on a fake probe (a table), the runner (every check runs, a check that raises fails, the tests-only injection),
the real probe on this CPU (the exact product, the one-rank gloo all-reduce), the gate's process as the launcher
reads it (its JSON, a crash, a hang), and the launcher's side end to end: a failed gate's exit code 8 and termination
message, which the operator's ``classify_pod`` reads as ``PreflightFailed`` blaming the node, and the node avoided
from the next attempt on."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from kubetitan.decide.failure import classify_pod, nodes_to_avoid
from kubetitan.observation import PodObs
from kubetitan_core import render
from kubetitan_core.api import LlamaPretrain, RestartRecord
from kubetitan_core.contract import ENV_NODE_NAME, ExitCode
from kubetitan_trainer import preflight as pf
from kubetitan_trainer.launch import gate
from kubetitan_trainer.launch.state import LauncherState

from support.specs import make_lpt

H100 = "NVIDIA H100 80GB HBM3"


@dataclasses.dataclass
class FakeProbe:
    """What a node would measure (a healthy one-H100 pod unless told otherwise)."""

    names: tuple[str, ...] = (H100,)
    state: list[pf.Nvml] | str = dataclasses.field(default_factory=lambda: [pf.Nvml(0, H100, "", 0, False, False, None)])
    products: tuple[pf.Matmul, ...] = (pf.Matmul("cuda:0", 8192, "bfloat16", 262144, 0, 0.0, 712.0),)
    reduced: pf.AllReduce = pf.AllReduce(True, "NCCL all-reduce across 1 GPU(s): sum right", 0.01)
    efa: int = 0

    def gpu_names(self) -> list[str]:
        return list(self.names)

    def nvml(self):
        return self.state

    def matmuls(self) -> list[pf.Matmul]:
        return list(self.products)

    def allreduce(self) -> pf.AllReduce:
        return self.reduced

    def efa_devices(self) -> int:
        return self.efa


GPU1 = pf.Settings(gpus=1, gpu_product="H100")
P5 = pf.Settings(gpus=8, instance_type="p5.48xlarge", efa_per_node=32)
EIGHT = tuple([H100] * 8)
SLOW = pf.Matmul("cuda:3", 8192, "bfloat16", 262144, 0, 0.0, 301.5)
WRONG = pf.Matmul("cuda:0", 8192, "bfloat16", 262144, 17, 0.5, 700.0)
CASES = [
    # (id, settings, probe, check, want status, a piece of the row's detail)
    ("count-cpu-pod-skipped", pf.Settings(), FakeProbe(names=()), "gpu_count", "skipped", "a CPU pod"),
    ("count-as-asked", P5, FakeProbe(names=EIGHT), "gpu_count", "passed", "8 GPU(s) as the spec asks"),
    ("count-one-missing", P5, FakeProbe(names=EIGHT[:7]), "gpu_count", "failed", "7 GPU(s) visible, the spec asks for 8"),
    ("model-from-gpu-product", GPU1, FakeProbe(), "gpu_model", "passed", "as the spec names (H100)"),
    ("model-other-card", GPU1, FakeProbe(names=("NVIDIA H200",)), "gpu_model", "failed",
     "GPU 0 is 'NVIDIA H200', not the H100 the spec names (spec.resources.gpuProduct)"),
    ("model-from-instance-type", P5, FakeProbe(names=EIGHT[:5] + ("NVIDIA A100-SXM4-80GB",) + EIGHT[:2]), "gpu_model",
     "failed", "GPU 5 is 'NVIDIA A100-SXM4-80GB', not the H100 the spec names (instance type p5.48xlarge)"),
    ("model-l40s-is-no-l4", pf.Settings(gpus=1, gpu_product="L4"), FakeProbe(names=("NVIDIA L40S",)), "gpu_model",
     "failed", "not the L4"),
    ("model-unnamed-skipped", pf.Settings(gpus=1), FakeProbe(), "gpu_model", "skipped", "the spec names no GPU model"),
    ("nvml-unavailable-says-so", GPU1, FakeProbe(state="the pynvml module (nvidia-ml-py) is not installed"), "nvml",
     "skipped", "NVML unavailable (the pynvml module (nvidia-ml-py) is not installed): ECC and row-remapping state NOT"),
    ("nvml-clean", GPU1, FakeProbe(), "nvml", "passed", "no uncorrectable ECC error"),
    ("nvml-uncorrectable-ecc", GPU1, FakeProbe(state=[pf.Nvml(0, H100, "", 2, False, False, None)]), "nvml", "failed",
     "GPU 0: 2 uncorrectable ECC error(s)"),
    ("nvml-remap-pending", GPU1, FakeProbe(state=[pf.Nvml(0, H100, "", 0, True, False, None)]), "nvml", "failed",
     "a row remap is pending"),
    ("nvml-remap-failed", GPU1, FakeProbe(state=[pf.Nvml(0, H100, "", 0, False, True, None)]), "nvml", "failed",
     "a row remap failed"),
    ("nvml-gpu-lost", GPU1, FakeProbe(state=[pf.Nvml(0, lost="GPU is lost")]), "nvml", "failed",
     "GPU 0: NVML cannot reach it (GPU is lost)"),
    ("matmul-right", GPU1, FakeProbe(), "matmul", "passed", "equals its known result"),
    ("matmul-wrong", GPU1, FakeProbe(products=(WRONG,)), "matmul", "failed",
     "cuda:0: 17 of 262144 sampled entries of a 8192-cube bfloat16 product wrong"),
    ("tflops-above-floor", GPU1, FakeProbe(), "matmul_tflops", "passed", "cuda:0 712 TF/s, above the floor (H100 495"),
    ("tflops-below-floor", P5, FakeProbe(names=EIGHT, products=(SLOW,)), "matmul_tflops", "failed",
     "cuda:3 301.5 TF/s < 495 TF/s, the H100 floor (50% of its 989.4 TF/s dense bf16 peak)"),
    ("tflops-floor-from-the-device-name", pf.Settings(gpus=1), FakeProbe(products=(SLOW,)), "matmul_tflops", "failed",
     "the H100 floor"),
    ("tflops-unknown-card-skipped", pf.Settings(gpus=1), FakeProbe(names=("Tesla T4",)), "matmul_tflops", "skipped",
     "no floor for this GPU model"),
    ("tflops-cpu-pod-skipped", pf.Settings(), FakeProbe(names=()), "matmul_tflops", "skipped", "a CPU pod: no floor"),
    ("allreduce-right", GPU1, FakeProbe(), "allreduce", "passed", "sum right"),
    ("allreduce-wrong", GPU1, FakeProbe(reduced=pf.AllReduce(False, "wrong sum on GPU(s) 1", 0.0)), "allreduce",
     "failed", "wrong sum on GPU(s) 1"),
    ("efa-not-requested", GPU1, FakeProbe(), "efa", "skipped", "no EFA interfaces requested"),
    ("efa-all-there", P5, FakeProbe(efa=32), "efa", "passed", "32 EFA device(s), 32 requested"),
    ("efa-missing", P5, FakeProbe(efa=16), "efa", "failed", "16 EFA device(s) in /dev/infiniband, the pod requested 32"),
]


@pytest.mark.parametrize(("settings", "probe", "check", "status", "detail"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_check_passes_and_fails_as_it_should(settings, probe, check, status, detail):
    row = dict(pf.CHECKS)[check](settings, probe)
    assert (row.check, row.status) == (check, status), row
    assert detail in row.detail, row.detail


def test_every_check_has_a_failing_case_and_a_passing_or_skipped_one():
    """The table above can fail: no check is left without a case that fails it."""
    seen = {(c[3], c[4]) for c in CASES}
    for check, _ in pf.CHECKS:
        assert (check, "failed") in seen and {(check, "passed"), (check, "skipped")} & seen, check


class Raising(FakeProbe):
    def nvml(self):
        raise RuntimeError("CUDA error: unknown error\nmore lines")


def test_the_gate_runs_every_check_and_a_check_that_raises_fails_with_its_text():
    r = pf.run(GPU1, Raising(), node="gpu-node-7")
    assert [x.check for x in r.rows] == [c for c, _ in pf.CHECKS]
    assert [(x.check, x.detail) for x in r.failed] == [("nvml", "RuntimeError: CUDA error: unknown error")]
    assert r.termination_message() == ("PreflightFailed: node gpu-node-7 failed the pre-flight gate: nvml: "
                                       "RuntimeError: CUDA error: unknown error")
    assert pf.Result.from_dict(json.loads(json.dumps(r.to_dict()))) == dataclasses.replace(
        r, seconds=round(r.seconds, 3), rows=tuple(dataclasses.replace(x, seconds=round(x.seconds, 3)) for x in r.rows))
    assert not pf.run(GPU1, FakeProbe(), node="n").failed


def test_the_tests_only_injection_fails_a_check_that_passed():
    r = pf.run(dataclasses.replace(GPU1, inject="matmul_tflops"), FakeProbe(), node="n")
    assert [x.check for x in r.failed] == ["matmul_tflops"]
    assert r.failed[0].detail.startswith("injected failure ([kubetitan.preflight] inject, tests only); the check "
                                         "itself: passed: cuda:0 712 TF/s")


def test_the_exactness_check_allows_one_rounding_and_no_more():
    import torch

    exact = torch.tensor([257.0, 1000.0, -3.0, 0.0], dtype=torch.float64)
    rounded = exact.to(torch.bfloat16)  # 257 -> 256: one rounding to bf16
    assert pf._exactness(rounded, exact, torch.bfloat16)[0] == 0
    off = rounded.clone()
    off[1] += 64  # a wrong entry
    off[3] = 1  # a zero that is not
    assert pf._exactness(off, exact, torch.bfloat16)[0] == 2
    assert pf._exactness(exact.float(), exact, torch.float32) == (0, 0.0)


def test_the_real_probe_on_this_cpu_checks_the_product_and_a_gloo_all_reduce():
    r = pf.run(pf.Settings(), pf.TorchProbe(cuda=False), node="cpu-node")
    status = {x.check: x.status for x in r.rows}
    assert status == {"gpu_count": "skipped", "gpu_model": "skipped", "nvml": "skipped", "matmul": "passed",
                      "matmul_tflops": "skipped", "allreduce": "passed", "efa": "skipped"}, r.rows
    assert "a 256-cube float32 product equals its known result (65536 entries each)" in r.rows[3].detail


def test_a_gpu_pod_without_a_gpu_fails_its_gpu_checks():
    r = pf.run(pf.Settings(gpus=1, gpu_product="H100"), pf.TorchProbe(cuda=True), node="n")
    assert {x.check for x in r.failed} >= {"gpu_count", "matmul", "matmul_tflops", "allreduce"}


def test_nvml_is_installed_with_the_trainer_and_a_node_without_the_driver_library_says_so():
    """nvidia-ml-py is a trainer dependency (so the image has ``pynvml``): on a machine without the NVIDIA driver
    the NVML row says why it could not ask, not that the module is missing."""
    state = pf.nvml_state()
    assert isinstance(state, str) and state.startswith("nvmlInit failed: "), state
    row = pf.check_nvml(pf.Settings(gpus=1, gpu_product="H100"), FakeProbe(state=state))
    assert (row.status, row.detail) == ("skipped", f"NVML unavailable ({state}): ECC and row-remapping state NOT "
                                                   "checked"), row


def _rendered(tmp_path, spec: dict) -> str:
    path = tmp_path / "trainer.toml"
    path.write_text(render.trainer_toml(LlamaPretrain.model_validate(make_lpt(spec))))
    return str(path)


def test_the_settings_are_the_rendered_specs(tmp_path):
    p5 = pf.Settings.from_config(_rendered(tmp_path, {
        "resources": {"gpusPerNode": 8, "instanceType": "p5.48xlarge", "platform": "eks"}}))
    assert p5 == pf.Settings(enabled=True, gpus=8, instance_type="p5.48xlarge", efa_per_node=32)
    off = pf.Settings.from_config(_rendered(tmp_path, {"resources": {"gpusPerNode": 0},
                                                       "runPolicy": {"preflight": "Disabled"}}))
    assert off == pf.Settings(enabled=False)
    (tmp_path / "bad.toml").write_text("[kubetitan\n")
    assert pf.Settings.from_config(str(tmp_path / "bad.toml")) == pf.Settings()  # the workers report it (exit 2)


# ------------------------------------------------------------------------------------------- the launcher's side
def _pending(script: str) -> pf.Pending:
    """A GPU pod's gate as the launcher holds it, its process a shell standing in for the gate's."""
    return pf.Pending(GPU1, "unused", subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE,
                                                       start_new_session=True))


def test_the_launcher_reads_the_gate_process_s_result_and_counts_a_crash_or_a_hang_as_a_failure():
    r = pf.run(GPU1, FakeProbe(), node="n3")
    got = _pending(f"echo 'a line of noise'; echo '{json.dumps(r.to_dict())}'").end()
    assert got.node == "n3" and [x.status for x in got.rows] == [x.status for x in r.rows]
    crashed = _pending("exit 3").end()
    assert [(x.check, x.status) for x in crashed.rows] == [("gate", "failed")]
    assert "the gate process exited with code 3 without its result" in crashed.rows[0].detail
    hung = _pending("sleep 30").end(timeout=0.2)
    assert "did not finish within 0 s" in hung.failed[0].detail
    waiting = _pending("sleep 30")
    waiting.cancel()
    assert waiting.proc.returncode is not None


def test_a_failed_gate_ends_the_pod_with_exit_code_8_and_the_operator_avoids_its_node(tmp_path, monkeypatch):
    """The CPU gate as the launcher runs it (in its process), one check injected failed: no worker may start, the
    launcher's state keeps the rows, the termination message names the node and the check, and the operator reads
    the pod as PreflightFailed blaming the node, which the next attempt avoids."""
    monkeypatch.setenv(ENV_NODE_NAME, "gpu-node-7")
    state = LauncherState(str(tmp_path / "launcher.json"))
    term = tmp_path / "termination-log"
    term.write_text("")  # the kubelet creates it
    code = gate.finish(pf.Pending(pf.Settings(inject="allreduce"), "unused"), state, str(term))
    assert code == ExitCode.PREFLIGHT_FAILED == 8
    assert state.data["preflight"]["status"] == "failed" and state.data["preflight"]["waited"] > 0
    assert [r["check"] for r in state.data["preflight"]["rows"] if r["status"] == "failed"] == ["allreduce"]
    msg = term.read_text()
    assert msg.startswith("PreflightFailed: node gpu-node-7 failed the pre-flight gate: allreduce: injected failure")
    pod = PodObs(name="run-a0-1", attempt=0, rank=1, phase="Failed", exit_code=code, node_name="gpu-node-7",
                 termination_message=msg)
    f = classify_pod(pod)
    assert (f.cause, f.node_name) == ("PreflightFailed", "gpu-node-7") and "(pre-flight gate failed)" in f.message
    assert nodes_to_avoid([RestartRecord(attempt=0, cause=f.cause, time="t", node_name=f.node_name)]) == ("gpu-node-7",)


def test_a_passed_or_disabled_gate_lets_the_workers_start(tmp_path):
    state = LauncherState(str(tmp_path / "launcher.json"))
    assert gate.finish(pf.Pending(pf.Settings(), "unused"), state, str(tmp_path / "absent")) is None
    assert state.data["preflight"]["status"] == "passed" and not (tmp_path / "absent").exists()
    assert gate.finish(None, state) is None and state.data["preflight"] == {"status": "disabled", "waited": 0.0}


def test_the_launcher_starts_no_gate_when_the_spec_turns_it_off_and_none_in_a_process_on_a_cpu_pod(tmp_path):
    from kubetitan_core.contract.launcher import LauncherArgs

    off = _rendered(tmp_path, {"resources": {"gpusPerNode": 0}, "runPolicy": {"preflight": "Disabled"}})
    assert gate.start(LauncherArgs(config=off)) is None
    cpu = gate.start(LauncherArgs(config=_rendered(tmp_path, {"resources": {"gpusPerNode": 0}})))
    assert cpu is not None and cpu.proc is None and cpu.settings.enabled
    assert gate.start(LauncherArgs(config=str(tmp_path / "missing.toml"))) is None


def test_a_worker_forked_after_the_cpu_gate_runs_torch_s_parallel_ops(tmp_path):
    """The CPU gate runs in the launcher, whose workers are forked after it: its torch ops run on one thread, so no
    OpenMP pool exists at the fork (with one, the forked worker hung after building its model). The launch is forked
    from the tests' warm parent (support.warm), which has run no parallel op."""
    import os

    from support import warm
    from support.paths import REPO

    log = tmp_path / "fork.log"
    proc = warm.popen("tests.trainer.fork_after_gate", [], dict(os.environ), log, cwd=REPO)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a child forked after the CPU gate hung in torch's parallel ops")
    assert code == 0, log.read_text(errors="replace")[-2000:]
