"""The launcher's arguments across the packages: what the operator's pods pass is what the launcher parses (one
dataclass, kubetitan_core.contract.launcher.LauncherArgs), and ``kubetitan run`` passes the spec's run policy the
same way. No process is started."""

from __future__ import annotations

import pytest

from kubetitan import plan
from kubetitan_core.contract.launcher import LauncherArgs
from kubetitan_trainer import local
from kubetitan_trainer.launch import launcher as launch

from support.specs import tiny_lpt

SPECS = {
    "default": {},
    "in-place-off": {"runPolicy": {"maxInPlaceRestarts": 0}},
    "fixed-hang-limit-long-save": {"runPolicy": {"hangTimeoutPolicy": "Fixed", "hangTimeoutSeconds": 77},
                                   "checkpoint": {"saveTimeoutSeconds": 1200}},
    "gang-of-4": {"resources": {"nodes": 4}, "parallelism": {"dataParallelShardDegree": 8}},
}


@pytest.mark.parametrize("overrides", list(SPECS.values()), ids=list(SPECS))
def test_the_pods_launcher_args_round_trip_through_the_launchers_parser(overrides):
    obj = tiny_lpt(overrides)
    for rank in range(obj.spec.resources.nodes):
        args = plan.pod(obj, 2, rank, hang_floor_seconds=12)["spec"]["containers"][0]["args"]
        parsed = launch.parse_args(args)
        assert parsed == plan.launcher_args(obj, 2, rank, hang_floor_seconds=12)
        rp, ck = obj.spec.run_policy, obj.spec.checkpoint
        assert (parsed.node_rank, parsed.max_restarts, parsed.hang_timeout_policy, parsed.hang_timeout_seconds,
                parsed.save_timeout_seconds, parsed.hang_floor_seconds) == \
            (rank, rp.max_in_place_restarts, rp.hang_timeout_policy, rp.hang_timeout_seconds,
             ck.save_timeout_seconds, 12)


class FakeLauncher:
    """``subprocess.Popen`` for run_local: records the command and exits 0 at once."""

    pid = 1
    cmd: list[str] = []

    def __init__(self, cmd, **kwargs) -> None:
        FakeLauncher.cmd = list(cmd)

    def poll(self) -> int:
        return 0

    def wait(self) -> int:
        return 0


def test_kubetitan_run_passes_the_specs_run_policy_to_the_launcher(tmp_path, monkeypatch, capsys):
    obj = tiny_lpt({"runPolicy": {"maxInPlaceRestarts": 5, "hangTimeoutPolicy": "Fixed", "hangTimeoutSeconds": 42},
                    "checkpoint": {"saveTimeoutSeconds": 900}})
    monkeypatch.setattr(local.subprocess, "Popen", FakeLauncher)
    assert local.run_local(obj, output_dir=str(tmp_path)) == 0
    assert FakeLauncher.cmd[1:3] == ["-m", "kubetitan_trainer.launch"]
    a = launch.parse_args(FakeLauncher.cmd[3:])
    assert (a.max_restarts, a.hang_timeout_policy, a.hang_timeout_seconds, a.save_timeout_seconds) == \
        (5, "Fixed", 42.0, 900.0)
    assert (a.nnodes, a.nproc_per_node, a.master_addr, a.config) == (1, 2, "127.0.0.1", str(tmp_path / "trainer.toml"))
    default = local.local_launcher_args(tiny_lpt(), tmp_path / "trainer.toml", 1234)
    assert default.max_restarts == LauncherArgs(config="c").max_restarts  # the API's maxInPlaceRestarts default
