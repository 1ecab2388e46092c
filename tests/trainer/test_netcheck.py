"""The start-up NCCL network check (kubetitan_trainer.netcheck), with NCCL's log faked: what it parses,
the verdict per platform/EFA/fallback, the env it prepares, the standalone command, and the exit code 5
the operator maps to a failed run."""

from __future__ import annotations

import types

import pytest

from kubetitan import conditions as C
from kubetitan_core.contract import ExitCode
from kubetitan_trainer import netcheck

# NCCL 2.2x INFO lines as NCCL and aws-ofi-nccl print them (wording from their sources).
EFA_LOG = """\
host:1:1 [0] NCCL INFO NCCL_DEBUG_SUBSYS set by environment to INIT,NET.
host:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)
host:1:1 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.22.0
host:1:1 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)
host:1:1 [0] NCCL INFO Using network AWS Libfabric
"""
SOCKET_LOG = """\
host:1:1 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
host:1:1 [0] NCCL INFO NET/IB : No device found.
host:1:1 [0] NCCL WARN NET/Socket : no usable interface found
host:1:1 [0] NCCL INFO Using network Socket
"""
TCP_PROVIDER_LOG = EFA_LOG.replace("provider is efa, fabric is efa-direct", "provider is tcp, fabric is 10.0.0.0/24")


def test_parse_reads_network_plugin_provider_and_warnings():
    efa = netcheck.parse(EFA_LOG)
    assert (efa.network, efa.plugin, efa.provider, efa.on_efa) == ("AWS Libfabric", "aws-ofi-nccl 1.22.0", "efa", True)
    sock = netcheck.parse(SOCKET_LOG)
    assert (sock.network, sock.plugin, sock.provider, sock.on_efa) == ("Socket", None, None, False)
    assert sock.warnings == ("host:1:1 [0] NCCL WARN NET/Socket : no usable interface found",)
    assert netcheck.parse(TCP_PROVIDER_LOG).on_efa is False  # the plugin, but libfabric fell back to tcp
    assert netcheck.parse("").network is None


@pytest.mark.parametrize("log,platform,efa,fallback,fail,level,says", [
    (SOCKET_LOG, "eks", 32, "Fail", True, "error", "aws-ofi-nccl plugin is missing"),
    (SOCKET_LOG, "hyperpod", 32, "Fail", True, "error", "networkFallback: AllowSockets"),
    (TCP_PROVIDER_LOG, "eks", 32, "Fail", True, "error", "provider tcp, not efa"),
    ("", "eks", 32, "Fail", True, "error", "logged no network"),
    (SOCKET_LOG, "eks", 32, "AllowSockets", False, "warning", "NOT on EFA"),
    (SOCKET_LOG, "generic", 0, "Fail", False, "info", "network Socket"),
    (SOCKET_LOG, "eks", 0, "Fail", False, "info", "network Socket"),  # efaPerNode: 0 asks for no EFA
    (EFA_LOG, "eks", 32, "Fail", False, "info", "on EFA as requested (32 interfaces"),
])
def test_judge(log, platform, efa, fallback, fail, level, says):
    v = netcheck.judge(netcheck.parse(log), platform=platform, efa_per_node=efa, fallback=fallback)
    assert (v.fail, v.level) == (fail, level) and says in v.message
    assert v.exit_code == ExitCode.NETWORK_NOT_EFA == 5


def test_no_nccl_is_never_a_failure():
    v = netcheck.judge(None, platform="eks", efa_per_node=32, fallback="Fail")
    assert not v.fail and "gloo" in v.message


def test_prepare_env_only_on_local_rank_0_and_keeps_the_users_debug_file(tmp_path):
    env: dict[str, str] = {}
    assert netcheck.prepare_env(env, 1, str(tmp_path)) is None and env == {}
    path = netcheck.prepare_env(env, 0, str(tmp_path))
    assert path == str(tmp_path / "nccl-%h-%p.log") == env["NCCL_DEBUG_FILE"] == env[netcheck.LOG_ENV]
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    mine = {"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_FILE": "/x/n.%p"}
    assert netcheck.prepare_env(mine, 0, str(tmp_path)) == "/x/n.%p"
    assert mine["NCCL_DEBUG"] == "TRACE" and "NCCL_DEBUG_SUBSYS" not in mine


def test_startup_verdict_reads_this_processes_log(tmp_path):
    env: dict[str, str] = {}
    pattern = netcheck.prepare_env(env, 0, str(tmp_path))
    (tmp_path / "nccl-node0-4242.log").write_text(SOCKET_LOG)
    (tmp_path / "nccl-node0-9999.log").write_text(EFA_LOG)  # another process's log is not read
    kt = types.SimpleNamespace(platform="eks", efa_per_node=32, network_fallback="Fail")
    v = netcheck.startup_verdict(kt, env, nccl_in_use=True, pid=4242)
    assert pattern and v is not None and v.fail and "network Socket" in v.message
    assert netcheck.startup_verdict(kt, env, nccl_in_use=True, pid=9999).fail is False
    assert netcheck.startup_verdict(kt, {}, nccl_in_use=True) is None  # local rank > 0: no log of its own
    assert netcheck.startup_verdict(kt, {}, nccl_in_use=False).fail is False


def test_standalone_command_prints_the_finding_and_exits_5(tmp_path, capsys):
    log = tmp_path / "nccl.log"
    log.write_text(SOCKET_LOG)
    assert netcheck.main(["--log", str(log), "--platform", "eks", "--efa", "32"]) == 5
    out = capsys.readouterr().out
    assert "NCCL WARN NET/Socket" in out and "netcheck error: NCCL is using network Socket" in out
    log.write_text(EFA_LOG)
    assert netcheck.main(["--log", str(log), "--platform", "eks", "--efa", "32"]) == 0
    assert "netcheck info: NCCL is using network AWS Libfabric, net plugin aws-ofi-nccl 1.22.0" in capsys.readouterr().out


def test_operator_fails_the_run_on_exit_5_without_restart():
    from kubetitan.decide.failure import classify_pod
    from kubetitan.observation import PodObs

    f = classify_pod(PodObs(name="j-a0-0", attempt=0, rank=0, phase="Failed", exit_code=5, node_name="n0"))
    assert f is not None and f.cause is None and f.fatal_reason == C.NETWORK_NOT_EFA  # cause None: never retried
    assert "networkFallback: AllowSockets" in f.message


def test_launcher_does_not_restart_exit_5_in_place():
    from types import SimpleNamespace

    from kubetitan_trainer.launch.failures import restartable

    for code in (ExitCode.NETWORK_NOT_EFA, ExitCode.STORAGE_FULL):
        assert not restartable({0: SimpleNamespace(exitcode=int(code), timestamp=1, message="<NONE>")}, False)
