"""Which network NCCL really uses, logged at start-up and enforced where EFA was asked for.

A pod on a p5 gets ``vpc.amazonaws.com/efa`` devices and ``FI_PROVIDER=efa``, but NCCL only uses them
through the aws-ofi-nccl net plugin (on libfabric's ``efa`` provider). Without the plugin in the image,
or with libfabric falling back to another provider, NCCL silently uses TCP sockets, and a multi-node
run trains its collectives at a fraction of EFA's bandwidth. Nothing in torch says which network NCCL
chose, but NCCL's own INFO log does (NCCL 2.2x wording)::

    NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.22.0
    NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)
    NCCL INFO Using network AWS Libfabric          <- or "Using network Socket" without the plugin

So each node's local rank 0 sends its NCCL INFO log (subsystems INIT and NET only) to a file
(:func:`prepare_env`, before the process group exists), and after the first step, when every
communicator exists, reads it back (:func:`parse`), logs what it found, copies NCCL's warnings to the
log, and judges it (:func:`judge`): on ``eks``/``hyperpod`` with EFA requested, anything but the
plugin on the ``efa`` provider ends the run with exit code 5 (``ExitCode.NETWORK_NOT_EFA``, not
retried) unless ``spec.resources.networkFallback`` is ``AllowSockets``. All ranks stop together
(the trainer's step-boundary all-reduce carries the verdict).

Pure except :func:`prepare_env` (writes the environment it is given) and :func:`read_log`.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from kubetitan_core.contract import ExitCode

LOG_ENV = "KUBETITAN_NCCL_LOG"
"""Where local rank 0's NCCL INFO log goes (``%h``/``%p`` expanded by NCCL); set by :func:`prepare_env`."""

_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w.-]+)")
_PLUGIN = re.compile(r"NET/OFI Initializing (aws-ofi-nccl\s*\S*)|NET/Plugin\s*:?\s*Loaded net plugin (.+?)\s*$", re.M)
_WARN = re.compile(r"^.*NCCL WARN .*$", re.M)


@dataclass(frozen=True)
class NcclNet:
    """What NCCL's log says: the network it uses, the net plugin it loaded, libfabric's provider."""

    network: str | None = None
    plugin: str | None = None
    provider: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def on_efa(self) -> bool:
        """The aws-ofi-nccl plugin (a "Libfabric" network) on libfabric's ``efa`` provider."""
        return bool(self.network and "libfabric" in self.network.lower() and self.provider == "efa")

    def describe(self) -> str:
        return (f"network {self.network or 'unknown'}, net plugin {self.plugin or 'none'}, "
                f"libfabric provider {self.provider or 'none'}")


@dataclass(frozen=True)
class Verdict:
    fail: bool
    """End the run with :attr:`exit_code`."""
    level: str
    """``info`` or ``warning``/``error``: how to log :attr:`message`."""
    message: str
    exit_code: int = ExitCode.NETWORK_NOT_EFA


def parse(text: str) -> NcclNet:
    """The last network, plugin and provider NCCL logged, and its WARN lines."""
    networks = _NETWORK.findall(text)
    providers = _PROVIDER.findall(text)
    plugins = [a or b for a, b in _PLUGIN.findall(text)]
    return NcclNet(networks[-1] if networks else None, plugins[-1].strip() if plugins else None,
                   providers[-1] if providers else None, tuple(_WARN.findall(text)))


def enforced(platform: str, efa_per_node: int) -> bool:
    """EFA is a promise on eks/hyperpod pods that requested EFA interfaces."""
    return platform in ("eks", "hyperpod") and efa_per_node > 0


def judge(net: NcclNet | None, *, platform: str, efa_per_node: int, fallback: str) -> Verdict:
    """The start-up verdict. ``net`` is None when NCCL is not in use (no GPU: gloo)."""
    if net is None:
        return Verdict(False, "info", "NCCL is not in use (no GPU: collectives run on gloo over TCP)")
    what = f"NCCL is using {net.describe()}"
    if not enforced(platform, efa_per_node):
        return Verdict(False, "info", what)
    if net.on_efa:
        return Verdict(False, "info", f"{what}: on EFA as requested ({efa_per_node} interfaces per pod)")
    why = ("NCCL logged no network (its INFO log was empty or unreadable)" if net.network is None else
           "the aws-ofi-nccl plugin is missing from the image" if "libfabric" not in net.network.lower() else
           f"libfabric chose provider {net.provider or 'none'}, not efa")
    if fallback == "AllowSockets":
        return Verdict(False, "warning", f"{what}: NOT on EFA ({why}); training goes on because "
                       "spec.resources.networkFallback is AllowSockets")
    return Verdict(True, "error", f"{what}: NOT on EFA although spec.resources asked for {efa_per_node} EFA "
                   f"interfaces on {platform} ({why}). Fix: use an image with libfabric and aws-ofi-nccl "
                   "(images/trainer.Dockerfile), or set spec.resources.networkFallback: AllowSockets to train "
                   "over TCP sockets")


def prepare_env(env: dict[str, str] | os._Environ, local_rank: int, log_dir: str) -> str | None:
    """On local rank 0, send NCCL's INIT/NET INFO log to a file; returns its pattern (None elsewhere).

    Must run before NCCL initialises (it reads its environment once). A user's own ``NCCL_DEBUG_FILE``
    is kept (and read back)."""
    if local_rank != 0:
        return None
    path = env.get("NCCL_DEBUG_FILE") or os.path.join(log_dir, "nccl-%h-%p.log")
    if env.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    env["NCCL_DEBUG_FILE"] = path
    env[LOG_ENV] = path
    return path


def startup_verdict(kt, env: dict[str, str] | os._Environ, nccl_in_use: bool,
                    pid: int | None = None) -> Verdict | None:
    """The verdict of this process after the first step; None on processes that keep no NCCL log (local
    ranks above 0: the step-boundary all-reduce gives them local rank 0's verdict). ``kt`` is the
    ``[kubetitan]`` config table (platform, efa_per_node, network_fallback)."""
    if not nccl_in_use:
        net = None
    else:
        pattern = env.get(LOG_ENV)
        if not pattern:
            return None
        net = parse(read_log(pattern, pid))
    return judge(net, platform=kt.platform, efa_per_node=kt.efa_per_node, fallback=kt.network_fallback)


def read_log(pattern: str, pid: int | None = None) -> str:
    """The text of this process's NCCL log (``%p`` = ``pid``); every match of the pattern if none is."""
    pid = os.getpid() if pid is None else pid
    concrete = pattern.replace("%p", str(pid))
    paths = sorted(glob.glob(concrete.replace("%h", "*")))
    out = []
    for p in paths:
        try:
            with open(p, errors="replace") as f:
                out.append(f.read())
        except OSError:
            continue
    return "\n".join(out)


def probe(log_dir: str) -> NcclNet | None:
    """Start NCCL here (one process, every visible GPU used by one all-reduce) and parse what it logged;
    None without a GPU. What ``python -m kubetitan_trainer.netcheck`` prints."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return None
    pattern = prepare_env(os.environ, 0, log_dir)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    return parse(read_log(pattern or ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m kubetitan_trainer.netcheck [--log FILE] [--platform P --efa N --fallback F]``: print the
    NCCL network, net plugin and libfabric provider (from FILE, an NCCL INFO log, or from starting NCCL on
    this machine) and the verdict the trainer would reach; exit code 5 when it would fail the run."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m kubetitan_trainer.netcheck", description=main.__doc__)
    ap.add_argument("--log", help="an NCCL INFO log to read instead of starting NCCL here")
    ap.add_argument("--platform", default="generic", choices=("generic", "eks", "hyperpod"))
    ap.add_argument("--efa", type=int, default=0, help="EFA interfaces the pod requested")
    ap.add_argument("--fallback", default="Fail", choices=("Fail", "AllowSockets"))
    a = ap.parse_args(argv)
    if a.log:
        with open(a.log, errors="replace") as f:
            net: NcclNet | None = parse(f.read())
    else:
        with tempfile.TemporaryDirectory() as d:
            net = probe(d)
    if net is not None:
        for w in net.warnings:
            print(w.strip())
    v = judge(net, platform=a.platform, efa_per_node=a.efa, fallback=a.fallback)
    print(f"netcheck {v.level}: {v.message}")
    return int(v.exit_code) if v.fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
