"""The worker's CUDA context made on a side thread at start-up (kubetitan_trainer.recovery.cuda_context), with a stand-in
driver: the calls, the device, the start not waiting for them, the knob, the errors, the start-up record."""

from __future__ import annotations

import ctypes
import logging
import threading

import pytest

from kubetitan_trainer.recovery import anatomy, cuda_context



class Driver:
    """The three driver calls, recorded; ``gate`` holds the context's creation until it is set."""

    def __init__(self, rc: dict[str, int] | None = None, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, object, str]] = []
        self.rc, self.gate = rc or {}, gate

    def _call(self, name: str, arg: object) -> int:
        self.calls.append((name, arg, threading.current_thread().name))
        return self.rc.get(name, 0)

    def cuInit(self, flags):  # noqa: N802 - the driver's names
        return self._call("cuInit", flags)

    def cuDeviceGet(self, device, ordinal):  # noqa: N802
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int)).contents.value = 40 + ordinal
        return self._call("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, context, device):  # noqa: N802
        if self.gate is not None:
            assert self.gate.wait(10)
        return self._call("cuDevicePrimaryCtxRetain", device.value)


@pytest.fixture(autouse=True)
def no_early(monkeypatch):
    monkeypatch.setattr(cuda_context, "EARLY", None)


def test_the_context_of_the_local_ranks_device_is_retained_on_a_side_thread_and_start_does_not_wait():
    gate = threading.Event()
    driver = Driver(gate=gate)
    early = cuda_context.start({"LOCAL_RANK": "3"}, driver=lambda: driver, on=True)
    assert early is not None and early.wait(0.05) is None  # start returned while the retain is held
    gate.set()
    result = early.wait(10)
    assert [c[:2] for c in driver.calls] == [("cuInit", 0), ("cuDeviceGet", 3), ("cuDevicePrimaryCtxRetain", 43)]
    assert {c[2] for c in driver.calls} == {"kubetitan-cuda-context"}
    assert result["rc"] == 0 and result["device"] == 3 and result["failed_call"] is None and result["seconds"] >= 0


@pytest.mark.parametrize(("env", "on"), [({}, None), ({}, False), ({"LOCAL_RANK": "x"}, True)])
def test_off_by_default_or_no_device_index_starts_nothing(env, on):
    """Off unless ``[kubetitan.runtime] early_cuda_context`` (None: this process's setting, off by default)."""
    driver = Driver()
    assert cuda_context.start(env, driver=lambda: driver, on=on) is None
    assert driver.calls == []


def test_no_driver_library_starts_nothing():
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert cuda_context.start({}, driver=missing, on=True) is None


def test_a_driver_error_stops_at_that_call_and_is_warned_about_once(caplog, monkeypatch):
    driver = Driver(rc={"cuDeviceGet": 101})
    monkeypatch.setattr(cuda_context, "EARLY", cuda_context.start({"LOCAL_RANK": "1"}, driver=lambda: driver, on=True))
    with caplog.at_level(logging.WARNING, logger=cuda_context.log.name):
        first = cuda_context.settled(10)
        cuda_context.settled(10)
    assert [c[0] for c in driver.calls] == ["cuInit", "cuDeviceGet"]
    assert first["rc"] == 101 and first["failed_call"] == "cuDeviceGet"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "cuDeviceGet" in warned[0] and cuda_context.SETTING in warned[0]


def test_no_visible_gpu_is_not_warned_about(caplog, monkeypatch):
    driver = Driver(rc={"cuInit": cuda_context.NO_DEVICE})
    monkeypatch.setattr(cuda_context, "EARLY", cuda_context.start({}, driver=lambda: driver, on=True))
    with caplog.at_level(logging.WARNING, logger=cuda_context.log.name):
        assert cuda_context.settled(10)["rc"] == cuda_context.NO_DEVICE
    assert not caplog.records


def test_begin_starts_once_a_process(monkeypatch):
    started = []
    monkeypatch.setattr(cuda_context, "start", lambda env=None: started.append(env) or object())
    first = cuda_context.begin()
    assert cuda_context.begin() is first and len(started) == 1  # an in-place restart keeps its context


def test_the_start_up_record_carries_the_early_context(monkeypatch):
    driver = Driver()
    monkeypatch.setattr(cuda_context, "EARLY", cuda_context.start({"LOCAL_RANK": "0"}, driver=lambda: driver, on=True))
    cuda_context.EARLY.wait(10)
    record = anatomy.Recorder({"restarts": 0, "failures": [], "started": 1.0}, now=2.0).first_step_ends(4, 0, t=3.0)
    assert record["cuda_context"]["rc"] == 0 and record["cuda_context"]["device"] == 0
    assert "CUDA context on a side thread" in anatomy.describe(record)
    monkeypatch.setattr(cuda_context, "EARLY", None)
    record = anatomy.Recorder({"restarts": 0, "failures": [], "started": 1.0}, now=2.0).first_step_ends(4, 0, t=3.0)
    assert "cuda_context" not in record and "CUDA context" not in anatomy.describe(record)
