"""The trainer's side of the operator edge (issue 14): metrics reachable on IPv4 and IPv6 from one bind, and a
full checkpoint volume detected before a save (exit code 4, ``ExitCode.STORAGE_FULL``)."""

from __future__ import annotations

import os
import socket
import urllib.request
from collections import namedtuple

import pytest

from kmockx.harness import free_port
from kubetitan_core.contract import ExitCode


@pytest.mark.skipif(not socket.has_ipv6, reason="this Python has no IPv6")
def test_metrics_bind_is_dual_stack() -> None:
    from prometheus_client import CollectorRegistry, Gauge

    from kubetitan_trainer import metrics as M

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("the kernel has no IPv6 loopback here")
    ex = M.Exporter.__new__(M.Exporter)  # only serve() is under test: no torchtitan state needed
    ex.registry = CollectorRegistry()
    Gauge("kubetitan_test_up", "test gauge (ratio)", registry=ex.registry).set(1)
    port = free_port()
    ex.serve(port)  # the default host 0.0.0.0
    for url in (f"http://127.0.0.1:{port}/metrics", f"http://[::1]:{port}/metrics"):
        assert "kubetitan_test_up 1.0" in urllib.request.urlopen(url, timeout=5).read().decode()


def test_full_volume_is_detected_before_a_save(tmp_path, monkeypatch) -> None:
    import shutil

    from kubetitan_trainer import trainer as T
    from kubetitan_trainer.errors import StorageFullError

    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / ".metadata").write_bytes(b"m")
    (tmp_path / "step-10" / "__0_0.distcp").write_bytes(b"x" * 4000)
    (tmp_path / "step-20").mkdir()  # a cut-off save: not the size estimate
    (tmp_path / "step-20" / "__0_0.distcp").write_bytes(b"x" * 99)
    assert T.newest_checkpoint_dir(str(tmp_path)) == str(tmp_path / "step-10")
    needed = T.dir_bytes(T.newest_checkpoint_dir(str(tmp_path)))
    assert needed == 4001
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4000, 4000))
    with pytest.raises(StorageFullError) as e:
        T.check_free_space(str(tmp_path / "not-yet"), needed)  # a missing folder: its volume is checked
    assert e.value.exit_code == ExitCode.STORAGE_FULL == 4 and "keepLatestK" in str(e.value)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, 10**6))
    T.check_free_space(str(tmp_path), needed)  # enough: no error
    assert os.path.isdir(tmp_path)


def _estimator(tmp_path, n_params: int):
    import torch

    from kubetitan_trainer.trainer import KubetitanTrainer

    t = KubetitanTrainer.__new__(KubetitanTrainer)  # only what _checkpoint_bytes_estimate reads
    t.checkpointer = namedtuple("C", "folder")(str(tmp_path / "checkpoint"))
    t.model_parts = [torch.nn.Linear(n_params, 1, bias=False)]
    t.device = torch.device("cpu")
    return t


def test_checkpoint_estimate_on_one_rank_issues_no_collective(tmp_path, monkeypatch) -> None:
    """One GPU (world size 1, NCCL): no all-reduce; it used to all-reduce a CPU tensor, which NCCL refuses,
    and every GPU run with checkpoints died at its first save."""
    from kubetitan_trainer import trainer as T

    def refuse(t, *a, **k):
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setattr(T.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(T.dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(T.dist, "all_reduce", refuse)
    assert _estimator(tmp_path, 1000)._checkpoint_bytes_estimate() == 1000 * 12


def test_checkpoint_estimate_sums_the_shards_of_all_ranks_on_the_training_device(tmp_path, monkeypatch) -> None:
    from kubetitan_trainer import trainer as T

    est = _estimator(tmp_path, 1000)
    seen = []

    def all_reduce(t, *a, **k):  # two ranks with equal shards
        seen.append(t.device)
        t.mul_(2)

    monkeypatch.setattr(T.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(T.dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(T.dist, "all_reduce", all_reduce)
    assert est._checkpoint_bytes_estimate() == 2 * 1000 * 12
    assert seen == [est.device]


def test_free_space_is_agreed_across_ranks(tmp_path) -> None:
    """Two real ranks (gloo): rank 1's volume lacks the space, rank 0's has plenty; both exit 4 before the save
    (one MAX all-reduce), rank 0 saying another rank's volume is short. Alone, rank 0 would enter the save."""
    from support import warm
    from support.paths import REPO

    # each rank forked from the tests' warm parent (support.warm: torch imported once per test process)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [warm.popen("tests.trainer.agree_rank", [str(tmp_path)], {**os.environ, "OMP_NUM_THREADS": "1",
                                                                      "RANK": str(r)}, logs[r], cwd=REPO)
             for r in range(2)]
    codes = warm.wait_all(procs, timeout=240, ok=(0, ExitCode.STORAGE_FULL))
    outs = [log.read_text(errors="replace") for log in logs]
    assert codes == [ExitCode.STORAGE_FULL] * 2, outs
    assert "other_rank=True: Another rank's checkpoint volume lacks" in outs[0], outs[0]
    assert "other_rank=False: The checkpoint volume at" in outs[1], outs[1]
    assert "saving" not in outs[0] + outs[1]
