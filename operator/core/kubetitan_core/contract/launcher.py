"""The launcher's arguments (``python -m kubetitan_trainer.launch``), defined once.

:class:`LauncherArgs` names every flag with its type, default and help. The operator's planner renders it into the
pod's ``args`` (:meth:`LauncherArgs.to_argv`), the launcher parses them back (:meth:`LauncherArgs.from_argv`, an
argparse parser built from the fields), and ``kubetitan run`` fills it from the spec the same way the planner does
(:func:`launcher_args`). A flag that mirrors a spec field (``spec`` in its metadata) takes its default from the API
(a default ``LlamaPretrainSpec``), so the launcher run by hand behaves as a pod of a default spec.

Pure and torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from pydantic.alias_generators import to_camel

from kubetitan_core import hang
from kubetitan_core.api import HangTimeoutPolicy, LlamaPretrainSpec, processes_per_node

RENDEZVOUS_PORT = 29500
"""Port of rank 0's rendezvous (torchrun's static store, or the c10d store of in-place restarts)."""


@cache
def _default_spec() -> LlamaPretrainSpec:
    return LlamaPretrainSpec()


def spec_value(spec: LlamaPretrainSpec, path: str) -> Any:
    """The spec's value at a dotted attribute path (``run_policy.hang_timeout_seconds``)."""
    value: Any = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _flag(default: Any, help: str) -> Any:
    """A launcher flag of its own (no spec field)."""
    return field(default=default, metadata={"help": help, "spec": ""})


def _spec_flag(path: str, help: str) -> Any:
    """A launcher flag that mirrors the spec field at ``path``: its default is the API's (a default spec's value),
    never restated here, and :func:`launcher_args` fills it from the spec."""
    return field(default=spec_value(_default_spec(), path), metadata={"help": help, "spec": path})


def monitor_interval_seconds(nodes: int) -> float:
    """How often each launcher checks its workers and (in place) whether a peer waits for a new rendezvous round:
    0.05 s per node within [0.1, 1] s, so a small gang notices a failure quickly and a large one does not flood rank
    0's rendezvous store."""
    return min(1.0, max(0.1, 0.05 * nodes))


def gang_wait_seconds(spec: LlamaPretrainSpec) -> int:
    """How long a rank waits for the rest of its gang (rank 0's DNS record, the rendezvous): the scheduling
    wait plus the start-up allowance, so ``Unschedulable`` is reported before any rank gives up."""
    rp = spec.run_policy
    return int(rp.unschedulable_timeout_seconds + rp.startup_timeout_seconds)


@dataclass(frozen=True)
class LauncherArgs:
    """``python -m kubetitan_trainer.launch`` arguments: one field per ``--flag`` (``_`` becomes ``-``)."""

    config: str = field(metadata={"help": "trainer.toml rendered by the operator (required)", "spec": ""})
    nnodes: int = _flag(1, "pods (nodes) in the gang: spec.resources.nodes")
    nproc_per_node: int = _flag(1, "worker processes on this node (torchrun's --nproc-per-node)")
    node_rank: int = _flag(0, "this pod's rank in the gang (0 hosts the rendezvous)")
    master_addr: str = _flag("127.0.0.1", "rank 0's address (its DNS name through the headless Service)")
    master_port: int = _flag(RENDEZVOUS_PORT, "rank 0's rendezvous port")
    rdzv_id: str = _flag("kubetitan", "the rendezvous's id: one per attempt (<namespace>-<name>-a<attempt>)")
    max_restarts: int = _spec_flag("run_policy.max_in_place_restarts",
                                   "in-place worker restarts of the whole gang before the launcher exits (0: none, "
                                   "the static launcher; the operator re-creates the gang)")
    restore_tier: str = _flag("auto", "folder of the node-local restore tier (kubetitan_trainer.recovery.restore_tier) for "
                                      "in-place restarts: 'auto' = /dev/shm/kubetitan-restore-<rdzv-id> with "
                                      "--max-restarts > 0, 'off' = none")
    monitor_interval: float = _flag(monitor_interval_seconds(1),
                                    "seconds between the agent's worker checks (the operator: 0.05 s per node within "
                                    "[0.1, 1] s)")
    dns_timeout: float = _flag(600.0, "seconds to wait for --master-addr to resolve (the operator: the scheduling "
                                      "wait plus the start-up allowance)")
    rdzv_timeout: int | None = _flag(None, "seconds the rendezvous waits for every node to join (default: torchrun's, "
                                           "900 static and 600 c10d); the operator passes one that outlasts its "
                                           "scheduling wait")
    hang_timeout_seconds: float = _spec_flag("run_policy.hang_timeout_seconds",
                                             "for the in-place hang watchdog (kubetitan_core.hang)")
    hang_timeout_policy: HangTimeoutPolicy = _spec_flag("run_policy.hang_timeout_policy",
                                                               "for the in-place hang watchdog")
    hang_floor_seconds: float = _flag(float(hang.AUTO_HANG_FLOOR_SECONDS),
                                      "the operator's --hang-floor-seconds (Auto's floor), for the in-place hang "
                                      "watchdog")
    save_timeout_seconds: float = _spec_flag("checkpoint.save_timeout_seconds",
                                             "added to the hang limit after a checkpoint step")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # the API's integer seconds are the launcher's float seconds
            if _hints()[f.name] is float and isinstance(getattr(self, f.name), int):
                object.__setattr__(self, f.name, float(getattr(self, f.name)))

    def to_argv(self) -> list[str]:
        """``--flag=value`` for every field that has a value (``None``: the launcher's own default)."""
        return [f"--{f.name.replace('_', '-')}={_text(getattr(self, f.name))}" for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None]

    @classmethod
    def from_argv(cls, argv: list[str]) -> LauncherArgs:
        """Parse ``argv`` (argparse exits 2 with usage on a bad or unknown flag)."""
        return cls(**vars(parser().parse_args(argv)))


@cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(LauncherArgs)


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _option(hint: Any, f: dataclasses.Field) -> dict[str, Any]:
    """argparse keywords of one field: its type (``X | None`` parses as X), choices of a Literal, default, help."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        kw: dict[str, Any] = {"choices": args, "type": str}
    else:
        kw = {"type": args[0] if args else hint}
    help = f.metadata["help"]
    if f.metadata.get("spec"):
        help += f"; spec.{'.'.join(to_camel(p) for p in f.metadata['spec'].split('.'))}"
    help += " (default: %(default)s)"
    if f.default is dataclasses.MISSING:
        return {**kw, "required": True, "help": help}
    return {**kw, "default": f.default, "help": help}


def parser() -> argparse.ArgumentParser:
    """The launcher's argument parser, built from :class:`LauncherArgs`."""
    p = argparse.ArgumentParser(prog="python -m kubetitan_trainer.launch",
                                description="Pod entry point: torchrun in-process for one node of the gang.")
    for f in dataclasses.fields(LauncherArgs):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, **_option(_hints()[f.name], f))
    return p


def launcher_args(spec: LlamaPretrainSpec, *, config: str, node_rank: int, master_addr: str, rdzv_id: str,
                  master_port: int = RENDEZVOUS_PORT, hang_floor_seconds: float = hang.AUTO_HANG_FLOOR_SECONDS,
                  dns_timeout: float | None = None) -> LauncherArgs:
    """The launcher's arguments for one node of a run of ``spec``: what the operator's pods run
    (``kubetitan.plan.pod``) and what ``kubetitan run`` runs. The flags that mirror spec fields come from the spec;
    the waits outlast the scheduling wait (:func:`gang_wait_seconds`: a rank waiting for rank 0's DNS record, or rank
    0 waiting in the rendezvous for the ranks of a partly scheduled gang, must not exit, a ContainerFailed restart,
    before the operator reports Unschedulable); ``dns_timeout`` overrides the DNS wait (a local run's master is
    127.0.0.1)."""
    mirrored = {f.name: spec_value(spec, f.metadata["spec"]) for f in dataclasses.fields(LauncherArgs)
                if f.metadata.get("spec")}
    wait = gang_wait_seconds(spec)
    return LauncherArgs(config=config, nnodes=spec.resources.nodes, nproc_per_node=processes_per_node(spec),
                        node_rank=node_rank, master_addr=master_addr, master_port=master_port, rdzv_id=rdzv_id,
                        monitor_interval=monitor_interval_seconds(spec.resources.nodes),
                        dns_timeout=wait if dns_timeout is None else dns_timeout, rdzv_timeout=wait,
                        hang_floor_seconds=hang_floor_seconds, **mirrored)
