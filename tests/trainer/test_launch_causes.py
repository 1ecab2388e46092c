"""The launcher's side of the causes table (``kubetitan_core.causes``): which worker failures it restarts in place,
and the GPU fault it finds in a worker's failure report and hands to the operator through the pod's termination
message. Plain unit tests with fake worker failures (torch elastic's ``ProcessFailure`` shape: exitcode, timestamp,
message), no torch, no process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kubetitan.decide.failure import classify_pod
from kubetitan.observation import PodObs
from kubetitan_core import causes
from kubetitan_core.contract import ExitCode
from kubetitan_trainer.launch import failures as launch_failures

XID_79_KERNEL = "NVRM: Xid (PCI:0000:c6:00): 79, pid=1101234, name=python, GPU has fallen off the bus."


def failure(exitcode: int, message: object = "<NONE>", timestamp: int = 100) -> SimpleNamespace:
    """A worker failure as torch elastic reports it (``message``: the worker's error file, a dict, or a string)."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=message)


def raised(text: str) -> dict:
    """The error file torch's ``record`` writes for a worker that raised (its ``message`` is the exception)."""
    return {"message": text, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "100"}}


@pytest.mark.parametrize(("code", "in_place"), [
    (int(ExitCode.FAILED), True), (int(ExitCode.NON_FINITE_LOSS), True), (int(ExitCode.RETRYABLE), True),
    (int(ExitCode.HANG), True), (-9, True), (-6, True),
    (int(ExitCode.CONFIG_ERROR), False), (int(ExitCode.STORAGE_FULL), False), (int(ExitCode.NETWORK_NOT_EFA), False),
    (int(ExitCode.PREFLIGHT_FAILED), False), (int(ExitCode.TERMINATED_CHECKPOINTED), False),
], ids=["1", "3-nan", "6-retryable", "7-hang", "sigkill", "sigabrt", "2-config", "4-storage", "5-not-efa",
        "8-preflight", "75-stopped"])
def test_exit_codes_restart_in_place_as_the_table_says(code, in_place) -> None:
    assert launch_failures.restartable({0: failure(code)}, stop_requested=False) is in_place
    assert launch_failures.restartable({0: failure(code)}, stop_requested=True) is False  # the pod is going away


def test_a_worker_that_reports_xid_79_is_not_restarted_in_place_and_the_operator_reads_why(tmp_path) -> None:
    """The in-place path: rank 3's worker raised with the driver's Xid 79 line in its report; its peers died of the
    broken collective (exit 1, SIGABRT). No in-place restart; the launcher writes the fault as the termination
    message, and the operator's classify_pod reads it as GPUXidError, a re-create blaming the node."""
    failures = {3: failure(1, raised(f"RuntimeError: CUDA error: unknown error\n{XID_79_KERNEL}"), timestamp=100),
                0: failure(1, raised("torch.distributed.DistBackendError: NCCL error"), timestamp=101),
                1: failure(-6, timestamp=101)}
    assert launch_failures.restartable(failures, stop_requested=False) is False
    assert launch_failures.restartable({0: failures[0], 1: failures[1]}, stop_requested=False) is True  # the collateral alone

    term = tmp_path / "termination-log"
    term.write_text("")  # the kubelet creates it; the launcher writes only where it exists
    line = launch_failures.report_detected(failures, path=str(term))
    assert line is not None and term.read_text() == line
    assert line.startswith("GPUXidError: Xid 79 (GPU has fallen off the bus) (worker local rank 3, exit code 1)")

    pod = PodObs(name="run-a0-1", attempt=0, rank=1, phase="Failed", exit_code=1, node_name="gpu-node-7",
                 termination_message=term.read_text())
    f = classify_pod(pod)
    assert f is not None and (f.cause, f.node_name) == ("GPUXidError", "gpu-node-7")
    assert causes.by_id(f.cause).avoid_node_after == 1 and not causes.by_id(f.cause).in_place


def test_nothing_is_written_for_a_failure_known_by_its_exit_code(tmp_path) -> None:
    term = tmp_path / "termination-log"
    term.write_text("")
    assert launch_failures.report_detected({0: failure(1, raised("ValueError: boom"))}, path=str(term)) is None
    assert term.read_text() == ""  # the log's tail stays the termination message (FallbackToLogsOnError)
    assert launch_failures.report_detected({0: failure(1, raised(XID_79_KERNEL))}, path=str(tmp_path / "absent")) is not None
    assert not (tmp_path / "absent").exists()  # outside a pod: logged only


def test_an_application_xid_is_restarted_in_place() -> None:
    app = failure(1, raised("RuntimeError: CUDA error: an illegal memory access was encountered\n"
                            "NVRM: Xid (PCI:0000:c6:00): 31, pid=77, name=python, Ch 00000008, MMU Fault"))
    assert launch_failures.restartable({0: app}, stop_requested=False) is True
    assert launch_failures.failure_cause(app).cause.id == causes.CONTAINER_FAILED


def test_the_xid_report_file_is_read_only_when_written_after_the_launcher_started(tmp_path) -> None:
    """A worker killed by NCCL's watchdog (SIGABRT) leaves no error file; the node's Xid report names the fault."""
    report = tmp_path / "xid.log"
    report.write_text("kernel: something else\n" + XID_79_KERNEL + "\n")
    env = {launch_failures.ENV_XID_REPORT: str(report)}
    mtime = report.stat().st_mtime
    assert launch_failures.xid_report(env, since=mtime + 60) == ""  # an old line must not blame this run's GPU
    text = launch_failures.xid_report(env, since=mtime - 1)
    assert XID_79_KERNEL in text
    aborted = failure(-6)
    assert launch_failures.restartable({0: aborted}, stop_requested=False, report=text) is False
    assert launch_failures.failure_cause(aborted, text).seen == "Xid 79 (GPU has fallen off the bus)"
    assert launch_failures.xid_report({}, since=0) == "" and launch_failures.xid_report({launch_failures.ENV_XID_REPORT: str(tmp_path / "no")}) == ""


def test_adding_the_gpu_cause_is_one_row_and_its_detector() -> None:
    """Without the GPUXidError row both paths see an ordinary crash (restarted in place; re-created with cause
    ContainerFailed); with it, both see the GPU fault."""
    without = tuple(c for c in causes.CAUSES if c.id != "GPUXidError")
    text = f"RuntimeError: CUDA error: unknown error\n{XID_79_KERNEL}"
    assert causes.worker_cause(1, text, without).cause.in_place is True
    assert causes.worker_cause(1, text).cause.id == "GPUXidError"
    pod = PodObs(name="p", attempt=0, rank=0, phase="Failed", exit_code=1, node_name="n", termination_message=text)
    assert classify_pod(pod, without).cause == causes.CONTAINER_FAILED
    assert classify_pod(pod).cause == "GPUXidError"


def _raise_a_gpu_fault() -> None:
    raise RuntimeError(f"CUDA error: unknown error\n{XID_79_KERNEL}")


@pytest.mark.xdist_group("trainer-torch")  # imports torch: on the worker that already has it
def test_torch_elastic_records_what_a_worker_raised_where_the_launcher_reads_it(tmp_path) -> None:
    """The failure report is real: a worker forked by torch elastic (as the launcher's agent forks them) that raises
    leaves its exception in the ProcessFailure's message, and the launcher finds the Xid there (a few seconds:
    torch's import and one fork)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    ctx = start_processes(name="w", entrypoint=_raise_a_gpu_fault, args={0: ()}, envs={0: {}},
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)), start_method="fork")
    result = ctx.wait()
    assert result is not None and result.is_failed()
    assert launch_failures.restartable(result.failures, stop_requested=False) is False
    found = launch_failures.failure_cause(result.failures[0])
    assert (found.cause.id, found.seen, found.by_text) == ("GPUXidError", "Xid 79 (GPU has fallen off the bus)", True)
