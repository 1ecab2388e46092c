"""Observation: raw API objects and rank 0's /metrics -> the typed inputs of ``decide``.

Everything here is pure except :func:`scrape` (one HTTP GET with aiohttp). Pods and nodes arrive as
plain dicts (from kopf's index / the API); metrics arrive as Prometheus text and are parsed with
prometheus-client's parser.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kubetitan import contract, plan
from kubetitan.api import LlamaPretrainSpec, TrainingStatus
from kubetitan.decide import NodeObs, PodObs, Progress, iso


def _ts(s: str | None) -> float | None:
    if not s:
        return None
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_obs(pod: Mapping[str, Any]) -> PodObs | None:
    """The decision-relevant view of one training pod; None for a pod without our labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        attempt, rank = int(labels[plan.LABEL_ATTEMPT]), int(labels[plan.LABEL_RANK])
    except (KeyError, ValueError):
        return None
    st = pod.get("status") or {}
    cs = next((c for c in st.get("containerStatuses") or [] if c.get("name") == plan.CONTAINER_NAME),
              (st.get("containerStatuses") or [None])[0]) or {}
    state = cs.get("state") or {}
    waiting, running, term = state.get("waiting") or {}, state.get("running"), state.get("terminated")
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    sched = conds.get("PodScheduled") or {}
    unsched = None
    if sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        unsched = sched.get("message") or "Unschedulable"
    disruption = conds.get("DisruptionTarget") or {}
    return PodObs(
        name=meta.get("name", ""),
        attempt=attempt,
        rank=rank,
        phase=st.get("phase") or "Pending",
        node_name=(pod.get("spec") or {}).get("nodeName"),
        pod_ip=st.get("podIP"),
        reason=st.get("reason"),
        message=st.get("message"),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        exit_code=term.get("exitCode") if term else None,
        terminated_reason=term.get("reason") if term else None,
        termination_message=term.get("message") if term else None,
        disruption_reason=disruption.get("reason") if disruption.get("status") == "True" else None,
        unschedulable_message=unsched,
        created=_ts(meta.get("creationTimestamp")),
        running_since=_ts(running.get("startedAt")) if running else None,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def node_obs(name: str, node: Mapping[str, Any] | None) -> NodeObs:
    """Health of a node; ``node`` None means the API says it does not exist."""
    if node is None:
        return NodeObs(name=name, exists=False, ready=False, not_ready_since=None)
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None:
        return NodeObs(name=name, ready=None)
    ok = {"True": True, "False": False}.get(ready.get("status"))
    return NodeObs(name=name, ready=ok, not_ready_since=None if ok else _ts(ready.get("lastTransitionTime")))


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of rank 0's exposition, by sample name (first sample wins)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, float(s.value))
    return out


def _num(m: Mapping[str, float], key: str) -> float | None:
    v = m.get(key)
    return None if v is None or v != v else v  # NaN is "unknown"


def _int(m: Mapping[str, float], key: str) -> int | None:
    v = _num(m, key)
    return None if v is None else int(v)


@dataclass
class ProgressTracker:
    """Per-attempt memory of rank 0's step (edge state; rebuilt from the next scrape after a restart)."""

    attempt: int = -1
    step: int | None = None
    start_step: int | None = None
    last_checkpoint_step: int | None = None
    last_progress_time: float | None = None
    first_step_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def update(self, attempt: int, m: Mapping[str, float] | None, now: float) -> None:
        if attempt != self.attempt:
            self.__init__(attempt=attempt)  # type: ignore[misc]
        if not m:
            return
        scraped_attempt = _int(m, contract.M_ATTEMPT)
        if scraped_attempt is not None and scraped_attempt != attempt:
            return  # an older attempt's process is still answering: not this attempt's progress
        self.metrics = dict(m)
        step = _int(m, contract.M_STEP)
        beat = _num(m, contract.M_LAST_STEP_TIMESTAMP)
        ck = _int(m, contract.M_LAST_CHECKPOINT_STEP)
        if ck is not None:
            self.last_checkpoint_step = ck
        if step is None or step <= 0:
            return
        # After loading a checkpoint the trainer publishes the step it resumed from, with its heartbeat still 0
        # until it completes a step of its own: that step is where the attempt starts, not its first step.
        loaded_only = beat is not None and beat <= 0
        if self.start_step is None:
            self.start_step = step if loaded_only else step - 1
        if self.first_step_time is None and not loaded_only:
            self.first_step_time = beat if beat is not None else now
        if self.step is None or step > self.step:
            self.last_progress_time = now
        if beat is not None and (self.last_progress_time is None or beat > self.last_progress_time):
            self.last_progress_time = beat
        self.step = step if self.step is None else max(self.step, step)

    def progress(self) -> Progress:
        return Progress(step=self.step, start_step=self.start_step, last_checkpoint_step=self.last_checkpoint_step,
                        last_progress_time=self.last_progress_time, first_step_time=self.first_step_time)


def training_status(spec: LlamaPretrainSpec, m: Mapping[str, float], now: float,
                    old: TrainingStatus | None) -> TrainingStatus:
    """``status.training`` from rank 0's metrics (metric names in ``contract.M_*``)."""
    t = old.model_copy() if old is not None else TrainingStatus()
    step = _int(m, contract.M_STEP)
    if step is not None:
        t.step = step
    for attr, key in (("loss", contract.M_LOSS), ("tokens_per_second", contract.M_TOKENS_PER_SECOND),
                      ("tokens_per_second_per_gpu", contract.M_TOKENS_PER_SECOND_PER_GPU),
                      ("mfu", contract.M_MFU)):
        v = _num(m, key)
        if v is not None:
            setattr(t, attr, round(v, 6))
    flops = _num(m, contract.M_FLOPS_PER_GPU)
    if flops is not None:
        t.tflops_per_gpu = round(flops / 1e12, 3)
    ck = _int(m, contract.M_LAST_CHECKPOINT_STEP)
    if ck is not None:
        t.last_checkpoint_step = ck
    t.total_steps = spec.training.steps
    # goodput = productive step seconds / wall seconds since the run started
    prod, start = _num(m, contract.M_PRODUCTIVE_SECONDS), _num(m, contract.M_JOB_START_TIMESTAMP)
    if prod is not None and start is not None and now > start:
        t.goodput = round(min(1.0, max(0.0, prod / (now - start))), 4)
    dur = _num(m, contract.M_STEP_DURATION)
    if t.step is not None and dur is not None and dur > 0:
        t.eta = iso(now + max(0, spec.training.steps - t.step) * dur)
    t.progress = f"{t.step if t.step is not None else 0}/{spec.training.steps}"
    t.last_update_time = iso(now)
    return t


# ------------------------------------------------------------------ spec changes
LIVE_FIELDS = ("training.steps", "runPolicy")
"""Applied at once while running: the operator reads them every cycle (steps: from the next attempt
for the trainer, at once for the status)."""
REJECTED_FIELDS = ("model", "tokenizer", "checkpoint.storage", "checkpoint.mountPath", "checkpoint.enabled")
"""Would make the existing checkpoints unusable: refused while the run has an attempt; revert them,
or create a new LlamaPretrain."""


def _flatten(d: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leaf paths of nested dicts (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict is a leaf)."""
    out = {} if out is None else out
    if isinstance(d, dict) and d:
        for k, v in d.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = {} if isinstance(d, dict) else d
    return out


def spec_changes(applied: Mapping[str, Any], desired: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """Changed wire paths between two specs, as (live, deferred, rejected)."""
    a, b = _flatten(dict(applied)), _flatten(dict(desired))
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    live, deferred, rejected = [], [], []
    for k in changed:
        if any(k == f or k.startswith(f + ".") for f in REJECTED_FIELDS):
            rejected.append(k)
        elif any(k == f or k.startswith(f + ".") for f in LIVE_FIELDS):
            live.append(k)
        else:
            deferred.append(k)
    return live, deferred, rejected


async def scrape(session: Any, ip: str, port: int, timeout: float) -> str | None:
    """GET rank 0's /metrics; None when it does not answer (the decision treats that as no progress)."""
    import aiohttp

    try:
        async with session.get(f"http://{ip}:{port}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            return await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
