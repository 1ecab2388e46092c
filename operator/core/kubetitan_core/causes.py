"""Why an attempt (or a worker generation) ended: one table, :data:`CAUSES`, one row per cause.

Each row says how the cause is recognised (exit codes, the kubelet's reasons, patterns in the pod's termination
message or in a worker's failure report), what follows (the launchers restart the workers in place; the operator
re-creates the gang; or the run fails), what it counts against, how severe it is, what it means (docs/api.md)
and where the runbook explains it (docs/runbook.md). Everything else reads this table:

- ``kubetitan.decide.failure.classify_pod`` (a failed pod: which row, in its fixed order of evidence) and
  ``nodes_to_avoid`` (rows that blame the node);
- ``kubetitan_trainer.launch.launcher.restartable`` (may the launchers restart a failed worker in place?:
  :func:`worker_cause`);
- the CRD's enum of ``status.restarts[].cause`` (``kubetitan_core.api.RestartCause``), the cause table of
  docs/api.md (``kubetitan.apidoc``), the per-cause sections of docs/runbook.md (checked by tests/docs) and the
  alerts that name causes (``kubetitan.monitoring.alerts``).

A new cause is a new row; when it is recognised by text, its detector is the row's ``message_patterns`` (RE, matched
with :func:`re.search`), checked after the exit codes of the causes that end a run and before every other exit code.
Pure and torch-free: the operator and the trainer import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kubetitan_core.contract import EXIT_SIGKILL, EXIT_SIGTERM, ExitCode

Severity = Literal["critical", "warning", "info"]
"""Who acts (kubernetes-mixin): critical pages someone now, warning goes to the work queue, info is context."""


@dataclass(frozen=True)
class Cause:
    """One cause: how it is recognised, what follows, and what the docs say."""

    id: str
    """``status.restarts[].cause`` (and the ``cause`` label of ``kubetitan_operator_restarts_total``) of a cause that
    is retried; the ``Failed`` condition's reason of one that ends the run."""
    doc: str = field(repr=False)
    """What it means (docs/api.md's cause table)."""
    in_place: bool
    """A worker failure of this cause is restarted in place by the launchers (same pods, every rank's workers),
    while ``runPolicy.maxInPlaceRestarts`` lasts. False: the launcher exits and the pod fails."""
    recreate: bool
    """The operator re-creates the gang (the next attempt resumes from the newest checkpoint). False: the run fails
    with reason ``id`` and nothing is retried (a restart cannot cure it)."""
    severity: Severity = "warning"
    observed: str = ""
    """What the operator's message adds after "pod P (rank R) exited with code N" (the termination message
    follows)."""
    fix: str = field(default="", repr=False)
    """What to do, at the end of the operator's message (causes that end the run, and text-detected ones)."""
    exit_codes: frozenset[int] = frozenset()
    """Trainer (container or worker) exit codes of this cause."""
    waiting_reasons: frozenset[str] = frozenset()
    """Trainer container ``state.waiting.reason`` values (the kubelet cannot start it)."""
    pod_reasons: frozenset[str] = frozenset()
    """Pod ``status.reason`` values."""
    terminated_reasons: frozenset[str] = frozenset()
    """Trainer container ``state.terminated.reason`` values."""
    disruption_reasons: frozenset[str] = frozenset()
    """Reasons of the pod's ``DisruptionTarget`` condition."""
    message_patterns: tuple[str, ...] = ()
    """Regular expressions searched in the pod's termination message and in a failed worker's report (the
    detector of a cause known by text). A named group ``xid`` marks an NVIDIA Xid number (:data:`GPU_FAULT_XIDS`
    names it in messages)."""
    avoid_node_after: int | None = None
    """The cause blames the node: a node blamed by this many restarts of the run (of this or another cause that
    blames nodes; the smallest such number of the causes seen on it applies) is kept out of later attempts
    (required anti-affinity). None: the node is not blamed (a crashed container says nothing about its node)."""
    alert: str = ""
    """Name of the Prometheus alert of this cause's own, if any (``kubetitan.monitoring.alerts``)."""
    resize: bool = False
    """A planned change of the gang's size (``runPolicy.elastic``), decided by the operator from the nodes, never read
    from a pod: it counts toward ``elastic.maxResizes`` instead of ``maxRestarts``/``maxRestartsWithoutProgress``, and
    the next attempt starts without backoff."""
    _compiled: tuple[re.Pattern[str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(p) for p in self.message_patterns))

    @property
    def retried(self) -> bool:
        """A restart of some kind follows (so the id is a ``RestartCause``)."""
        return self.in_place or self.recreate

    @property
    def summary(self) -> str:
        """The first sentence of ``doc`` (alert descriptions)."""
        head, dot, _ = self.doc.partition(". ")
        return head + "." if dot else self.doc

    @property
    def runbook(self) -> str:
        """The anchor of the cause's section in docs/runbook.md (its heading is the id)."""
        return self.id.lower()

    def budgets(self) -> str:
        """What a restart of this cause counts against (docs)."""
        if not self.retried:
            return "none: the run fails"
        if self.resize:
            return "`runPolicy.elastic.maxResizes` (not `maxRestarts`); at most one resize per the operator's " \
                "`--resize-min-interval-seconds`"
        out = ["`maxRestarts`", "`maxRestartsWithoutProgress`"]
        if self.in_place:
            out.append("`maxInPlaceRestarts` (in place)")
        if self.avoid_node_after is not None:
            n = self.avoid_node_after
            out.append(f"the node's: avoided after {n} such restart{'s' if n > 1 else ''}")
        return ", ".join(out)

    def search(self, text: str | None) -> re.Match[str] | None:
        """The first match of the row's detector in ``text``, or None."""
        if not text:
            return None
        for pattern in self._compiled:
            if (m := pattern.search(text)) is not None:
                return m
        return None


# ----------------------------------------------------------------------------------------------- NVIDIA Xids
GPU_FAULT_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded; a GPU reset applies it",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
"""NVIDIA Xid errors that mean the GPU (or its node) needs a reset, a reboot or a replacement, from NVIDIA's Xid
catalog (docs.nvidia.com/deploy/xid-errors): uncorrectable memory errors (48; 94/95 on A100 and later, which contain
the error to the processes that used the memory, or not; 63/64: a row remap or page retirement recorded, which needs
a GPU reset to apply, or failed), the NVLink fabric (74), the PCIe link (79: the GPU is gone until the node is power
cycled) and the GPU System Processor's firmware (119/120). A restart on the same GPU meets the same fault."""
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
}
"""Xids that a program's own bug causes (an illegal address, an exception in a kernel) or that follow another error:
not GPU faults. They are left to the exit code (``ContainerFailed``: a restart, in place when allowed)."""
_XID = r"\bXid\b(?:\s*\([^)\n]*\))?\s*:?\s*(?P<xid>{})\b".format("|".join(str(x) for x in GPU_FAULT_XIDS))
"""An Xid as the kernel driver logs it (``NVRM: Xid (PCI:0000:c6:00): 79, pid=..., GPU has fallen off the bus.``) and
as the launcher reports it (``Xid 79``)."""
_CUDA_FAULTS = (r"uncorrectable ECC error encountered", r"uncorrectable NVLink error")
"""CUDA's own errors for the same faults (``CUDA_ERROR_ECC_UNCORRECTABLE``, ``CUDA_ERROR_NVLINK_UNCORRECTABLE``), as
a worker's exception text carries them."""

_XID_LIST = ", ".join(f"{x} {d.split(';')[0]}" for x, d in GPU_FAULT_XIDS.items())

# ---------------------------------------------------------------------------------------------------- the table
CONTAINER_FAILED = "ContainerFailed"
UNKNOWN = "Unknown"

CAUSES: tuple[Cause, ...] = (
    # --- retried causes (status.restarts[].cause); the enum's order
    Cause(CONTAINER_FAILED, "A trainer container exited with a retryable error: exit code 1, 6 (`RETRYABLE`), a "
          "signal (137, 143) or any other non-zero code not listed below.", in_place=True, recreate=True,
          exit_codes=frozenset({int(ExitCode.FAILED), int(ExitCode.RETRYABLE), EXIT_SIGKILL, EXIT_SIGTERM})),
    Cause("OOMKilled", "The kernel's OOM killer stopped a trainer container (terminated reason `OOMKilled`).",
          in_place=False, recreate=True, observed=": OOMKilled", fix="raise spec.resources.memory or lower the batch",
          terminated_reasons=frozenset({"OOMKilled"})),
    Cause("Evicted", "The kubelet evicted a pod (node pressure).", in_place=False, recreate=True,
          pod_reasons=frozenset({"Evicted"})),
    Cause("Preempted", "A pod was preempted by the scheduler, or the trainer exited with code 75 after "
          "saving a checkpoint on SIGTERM.", in_place=False, recreate=True, severity="info",
          observed=" (SIGTERM, checkpoint saved)", exit_codes=frozenset({int(ExitCode.TERMINATED_CHECKPOINTED)}),
          disruption_reasons=frozenset({"PreemptionByScheduler", "PreemptionByKubeScheduler"})),
    Cause("NodeFailure", "A node became NotReady or disappeared (its pods deleted by the pod garbage collector "
          "included), or its taint manager or kubelet terminated the pod.", in_place=False, recreate=True, avoid_node_after=2,
          disruption_reasons=frozenset({"DeletionByTaintManager", "TerminationByKubelet", "DeletionByPodGC"})),
    Cause("GPUXidError", "A GPU of the pod failed and needs a reset or a replacement. The pod's termination message "
          "(the launcher writes the failed worker's) names an NVIDIA Xid of a GPU fault "
          f"({_XID_LIST}), or CUDA's uncorrectable ECC/NVLink error. Not restarted in place (the same GPU would fail "
          "again): the gang is re-created and the node is kept out of the run's later attempts at once. Application "
          "Xids (13, 31, 43, 45) are a program's bug, not a GPU fault: they stay "
          "`ContainerFailed`.", in_place=False, recreate=True,
          fix="the gang is re-created without this node; drain it and have its GPU checked (nvidia-smi -q, DCGM "
          "diagnostics) or replaced", message_patterns=(_XID, *_CUDA_FAULTS), avoid_node_after=1,
          alert="KubeTitanGPUXidError"),
    Cause("PreflightFailed", "A pod's pre-flight gate (`runPolicy.preflight`) found its node unfit before the "
          "attempt's workers started (exit code 8): fewer GPUs than `resources.gpusPerNode`, another GPU model than "
          "the spec names, uncorrectable ECC errors or a pending or failed row remap (NVML), a matrix product with a "
          "wrong result or below the card's floor, a failed local all-reduce, or fewer EFA devices than requested. "
          "The termination message names the node and each failed check. The gang is re-created and the node is "
          "kept out of the run's later attempts at once.", in_place=False, recreate=True,
          observed=" (pre-flight gate failed)",
          fix="the gang is re-created without this node; drain it and have it checked (nvidia-smi -q, DCGM "
          "diagnostics, the EFA devices), or turn the gate off with runPolicy.preflight: Disabled",
          exit_codes=frozenset({int(ExitCode.PREFLIGHT_FAILED)}), avoid_node_after=1),
    Cause("Hang", "The step did not advance for the hang limit (`runPolicy.hangTimeoutSeconds` / "
          "`hangTimeoutPolicy`): a launcher stopped its workers (exit code 7; in place while `maxInPlaceRestarts` "
          "last), or, when no launcher did, the operator re-created the gang.", in_place=True, recreate=True,
          observed=": its launcher stopped a worker whose step stood still for the hang limit and had no in-place "
          "restart left", exit_codes=frozenset({int(ExitCode.HANG)})),
    Cause("StartupTimeout", "No first step within `runPolicy.startupTimeoutSeconds` after all pods ran.",
          in_place=False, recreate=True),
    Cause("NonFiniteLoss", "The loss became NaN or infinite (exit code 3).", in_place=True, recreate=True,
          observed=": the loss became NaN/inf", exit_codes=frozenset({int(ExitCode.NON_FINITE_LOSS)})),
    Cause("PodDeleted", "A pod of the attempt was deleted by someone other than the operator (by hand, a script) "
          "after the operator had seen it, with no `DisruptionTarget` that names another cause.",
          in_place=False, recreate=True, severity="info"),
    Cause("Shrink", "`runPolicy.elastic`: a node of the gang was lost (or a pod of it could not be placed) and too few "
          "schedulable nodes could replace it for `shrinkAfterSeconds`: the next attempt runs on the largest number "
          "that fits (at least `minNodes`), resuming the newest checkpoint with the same global batch.",
          in_place=False, recreate=True, severity="info", resize=True),
    Cause("Grow", "`runPolicy.elastic`: more nodes have been Ready and schedulable for the pods for "
          "`growCheckSeconds`: right after the attempt's next complete checkpoint its pods save again on SIGTERM and "
          "the gang is re-created larger (up to `maxNodes`), resuming that save.", in_place=False, recreate=True,
          severity="info", resize=True),
    Cause(UNKNOWN, "The attempt ended and no cause could be attributed.", in_place=True, recreate=True),
    # --- causes that end the run (the launcher does not restart them in place; the operator does not retry)
    Cause("ImagePullFailed", "The kubelet cannot pull the trainer image (`ErrImagePull`, `ImagePullBackOff`, "
          "`InvalidImageName`, `ErrImageNeverPull`). The run fails.", in_place=False, recreate=False,
          fix="fix spec.resources.image (or imagePullSecrets)",
          waiting_reasons=frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})),
    Cause("ConfigError", "The trainer refused its configuration (exit code 2), or the kubelet cannot create the "
          "container (`CreateContainerConfigError`, `CreateContainerError`: a missing Secret/ConfigMap key). The run "
          "fails.", in_place=False, recreate=False, observed=" (configuration error)", fix="fix the spec and re-apply",
          exit_codes=frozenset({int(ExitCode.CONFIG_ERROR)}),
          waiting_reasons=frozenset({"CreateContainerConfigError", "CreateContainerError"})),
    Cause("StorageFull", "The checkpoint volume has too little free space for a save (exit code 4). The run fails: "
          "a restart would write into the same full volume.", in_place=False, recreate=False,
          observed=": the checkpoint volume has too little free space for a save",
          fix="free space or enlarge the volume (or lower checkpoint.keepLatestK), then re-create the run",
          exit_codes=frozenset({int(ExitCode.STORAGE_FULL)}), alert="KubeTitanStorageFull"),
    Cause("NetworkNotEFA", "EFA was requested but NCCL is not using it (exit code 5). The run fails.",
          in_place=False, recreate=False, observed=": EFA was requested but NCCL is not using it",
          fix="use an image with libfabric and aws-ofi-nccl (images/trainer.Dockerfile) or set "
          "spec.resources.networkFallback: AllowSockets",
          exit_codes=frozenset({int(ExitCode.NETWORK_NOT_EFA)}), alert="KubeTitanNetworkNotEFA"),
)
"""Every cause: the retried ones (the CRD's enum, in this order), then those that end the run. The order is the docs';
which piece of evidence is read first is ``classify_pod``'s (no exit code or reason belongs to two rows)."""

RESTART_CAUSES: tuple[str, ...] = tuple(c.id for c in CAUSES if c.retried)
"""The values of ``status.restarts[].cause``."""
RESIZE_CAUSES: frozenset[str] = frozenset(c.id for c in CAUSES if c.resize)
"""Restarts that change the gang's size (``Shrink``, ``Grow``): their own budget, ``runPolicy.elastic.maxResizes``."""


def by_id(cause_id: str, table: Sequence[Cause] = CAUSES) -> Cause:
    """The row of ``cause_id`` (KeyError names the known ones)."""
    for c in table:
        if c.id == cause_id:
            return c
    raise KeyError(f"no restart cause {cause_id!r}; known: {', '.join(c.id for c in table)}")


def _first(table: Iterable[Cause], attr: str, value: object) -> Cause | None:
    if value is None:
        return None
    return next((c for c in table if value in getattr(c, attr)), None)


def by_waiting_reason(reason: str | None, table: Sequence[Cause] = CAUSES) -> Cause | None:
    return _first(table, "waiting_reasons", reason)


def by_pod_reason(reason: str | None, table: Sequence[Cause] = CAUSES) -> Cause | None:
    return _first(table, "pod_reasons", reason)


def by_terminated_reason(reason: str | None, table: Sequence[Cause] = CAUSES) -> Cause | None:
    return _first(table, "terminated_reasons", reason)


def by_disruption(reason: str | None, table: Sequence[Cause] = CAUSES) -> Cause | None:
    return _first(table, "disruption_reasons", reason)


def by_exit_code(code: int | None, table: Sequence[Cause] = CAUSES) -> Cause | None:
    return _first(table, "exit_codes", code)


def by_message(text: str | None, table: Sequence[Cause] = CAUSES) -> tuple[Cause, str] | None:
    """The first row whose detector finds ``text`` (a termination message, a worker's failure report), with what it
    found (:func:`describe`); None when none does."""
    for c in table:
        if (m := c.search(text)) is not None:
            return c, describe(m)
    return None


def describe(m: re.Match[str]) -> str:
    """What a detector found, for messages: ``Xid 79 (GPU has fallen off the bus)``, or the matched text."""
    xid = m.groupdict().get("xid")
    if xid is not None:
        return f"Xid {xid} ({GPU_FAULT_XIDS.get(int(xid), 'see the NVIDIA Xid catalog')})"
    return m.group(0).strip()


class WorkerCause(NamedTuple):
    """Why a worker failed (:func:`worker_cause`)."""

    cause: Cause
    seen: str
    """What was seen: ``exit code N``, or what the row's detector found in the text (:func:`describe`)."""
    by_text: bool
    """Found by the row's detector in the text (not by the exit code)."""


def worker_cause(exit_code: int | None, text: str | None = None, table: Sequence[Cause] = CAUSES) -> WorkerCause:
    """Why a worker (a process a launcher runs) failed: its exit code and its failure report's text (the
    exception torch elastic recorded, an Xid report). The order is ``classify_pod``'s for a container: an exit code
    whose cause ends the run, then a cause detected in the text, then the exit code's cause, else
    ``ContainerFailed``."""
    coded = by_exit_code(exit_code, table)
    if coded is not None and not coded.retried:
        return WorkerCause(coded, f"exit code {exit_code}", False)
    found = by_message(text, table)
    if found is not None:
        return WorkerCause(*found, True)
    return WorkerCause(coded or by_id(CONTAINER_FAILED, table), f"exit code {exit_code}", False)


def avoided_nodes(blamed: Iterable[tuple[str | None, str]], table: Sequence[Cause] = CAUSES) -> tuple[str, ...]:
    """Nodes to keep out of later attempts, from (node, cause id) of the run's restarts: a node is avoided once the
    restarts that blame it reach the smallest ``avoid_node_after`` of their causes."""
    counts: dict[str, int] = {}
    limit: dict[str, int] = {}
    rows = {c.id: c for c in table}
    for node, cause in blamed:
        row = rows.get(cause)
        if not node or row is None or row.avoid_node_after is None:
            continue
        counts[node] = counts.get(node, 0) + 1
        limit[node] = min(limit.get(node, row.avoid_node_after), row.avoid_node_after)
    return tuple(sorted(n for n, k in counts.items() if k >= limit[n]))


__all__ = [
    "APPLICATION_XIDS", "CAUSES", "CONTAINER_FAILED", "Cause", "GPU_FAULT_XIDS", "RESIZE_CAUSES", "RESTART_CAUSES",
    "UNKNOWN",
    "avoided_nodes", "by_disruption", "by_exit_code", "by_id", "by_message", "by_pod_reason", "by_terminated_reason",
    "by_waiting_reason", "describe", "WorkerCause", "worker_cause",
]
