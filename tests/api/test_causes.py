"""The causes table's own rules and its GPU fault detector (``kubetitan_core.causes``), as tables: which text is a GPU
fault (and which Xid), which worker failure goes where, and how restarts that blame nodes add up."""

from __future__ import annotations

import pytest

from kubetitan_core import causes
from kubetitan_core.contract import ExitCode

XID_TEXTS = [
    # (id, text, the description the detector gives, or None: not a GPU fault)
    ("kernel-79", "NVRM: Xid (PCI:0000:c6:00): 79, pid=1101234, name=python, GPU has fallen off the bus.",
     "Xid 79 (GPU has fallen off the bus)"),
    ("kernel-48", "[ 512.1] NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=python, An uncorrectable double bit error",
     "Xid 48 (double-bit ECC error)"),
    ("kernel-95-uncontained", "NVRM: Xid (PCI:0000:9a:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB",
     "Xid 95 (uncontained ECC error)"),
    ("kernel-119-gsp", "NVRM: Xid (PCI:0000:65:00): 119, pid='N/A', Timeout waiting for RPC from GSP",
     "Xid 119 (GSP RPC timeout)"),
    ("launcher-line", "GPUXidError: Xid 74 (NVLink error) (worker local rank 2, exit code 1)", "Xid 74 (NVLink error)"),
    ("cuda-ecc", "RuntimeError: CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be ...",
     "uncorrectable ECC error encountered"),
    ("cuda-nvlink", "torch.AcceleratorError: CUDA error: uncorrectable NVLink error was detected during the execution",
     "uncorrectable NVLink error"),
    ("app-13", "NVRM: Xid (PCI:0000:c6:00): 13, pid=4242, name=python, Graphics SM Warp Exception", None),
    ("app-31", "NVRM: Xid (PCI:0000:c6:00): 31, pid=4242, name=python, Ch 00000010, intr 00000000. MMU Fault", None),
    ("app-43", "NVRM: Xid (PCI:0000:c6:00): 43, pid=4242, name=python, Ch 00000008", None),
    ("longer-number", "Xid 790 is not an Xid of the table; neither is Xid 7", None),
    ("cuda-oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", None),
    ("no-text", "", None),
]


@pytest.mark.parametrize(("text", "want"), [c[1:] for c in XID_TEXTS], ids=[c[0] for c in XID_TEXTS])
def test_gpu_fault_detector(text: str, want: str | None) -> None:
    found = causes.by_message(text)
    assert (None if found is None else (found[0].id, found[1])) == (None if want is None else ("GPUXidError", want))


def test_every_gpu_fault_xid_is_detected_and_no_application_xid_is() -> None:
    for xid in causes.GPU_FAULT_XIDS:
        assert causes.by_message(f"NVRM: Xid (PCI:0000:01:00): {xid}, pid=1, name=python") is not None, xid
    for xid in causes.APPLICATION_XIDS:
        assert causes.by_message(f"NVRM: Xid (PCI:0000:01:00): {xid}, pid=1, name=python") is None, xid
    assert not set(causes.GPU_FAULT_XIDS) & set(causes.APPLICATION_XIDS)


WORKER_FAILURES = [
    # (id, exit code, report text, cause, restarted in place)
    ("exception", 1, "ValueError: bad batch", "ContainerFailed", True),
    ("killed", 137, "", "ContainerFailed", True),
    ("unknown-code", 42, "", "ContainerFailed", True),
    ("nan", int(ExitCode.NON_FINITE_LOSS), "", "NonFiniteLoss", True),
    ("hang", int(ExitCode.HANG), "", "Hang", True),
    ("stop-75", int(ExitCode.TERMINATED_CHECKPOINTED), "", "Preempted", False),
    ("config", int(ExitCode.CONFIG_ERROR), "", "ConfigError", False),
    ("config-with-an-xid-stays-config", int(ExitCode.CONFIG_ERROR), "Xid 79", "ConfigError", False),
    ("preflight-failed", int(ExitCode.PREFLIGHT_FAILED), "PreflightFailed: node n1 failed the pre-flight gate: nvml",
     "PreflightFailed", False),
    ("gpu-fault-in-report", 1, "CUDA error: unknown error\nNVRM: Xid (PCI:0000:c6:00): 79, pid=1", "GPUXidError", False),
    ("gpu-fault-beats-sigabrt", 134, "uncorrectable ECC error encountered", "GPUXidError", False),
]


@pytest.mark.parametrize(("code", "text", "cause", "in_place"), [c[1:] for c in WORKER_FAILURES],
                         ids=[c[0] for c in WORKER_FAILURES])
def test_worker_cause(code: int, text: str, cause: str, in_place: bool) -> None:
    got = causes.worker_cause(code, text)
    assert (got.cause.id, got.cause.in_place, got.by_text) == (cause, in_place, cause == "GPUXidError")


@pytest.mark.parametrize(("blamed", "want"), [
    ([("a", "NodeFailure")], ()),
    ([("a", "NodeFailure"), ("a", "NodeFailure")], ("a",)),
    ([("a", "GPUXidError")], ("a",)),
    ([("a", "PreflightFailed")], ("a",)),
    ([("a", "ContainerFailed"), ("a", "OOMKilled"), ("a", "Hang")], ()),
    ([(None, "GPUXidError"), ("b", "NodeFailure")], ()),
    ([("a", "NodeFailure"), ("b", "GPUXidError"), ("c", "NodeFailure"), ("c", "NodeFailure")], ("b", "c")),
], ids=["node-once", "node-twice", "gpu-once", "preflight-once", "crashes-never", "no-node", "mixed"])
def test_avoided_nodes(blamed, want) -> None:
    assert causes.avoided_nodes(blamed) == want


def test_rows_are_consistent() -> None:
    for c in causes.CAUSES:
        assert c.doc.endswith(".") and c.severity in ("critical", "warning", "info"), c.id
        assert c.retried or c.fix, f"{c.id}: a failure that ends the run must say how to fix it"
    assert causes.RESTART_CAUSES[-1] == causes.UNKNOWN and causes.CONTAINER_FAILED in causes.RESTART_CAUSES
    with pytest.raises(KeyError, match="known: ContainerFailed"):
        causes.by_id("Nope")
