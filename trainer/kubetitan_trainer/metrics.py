"""Prometheus metrics served by the trainer, and the MetricsProcessor that feeds them.

Who serves: each pod's **local rank 0** serves ``/metrics`` on ``[kubetitan] metrics_port`` with
its own rank's numbers (throughput, FLOP/s, memory, timings), plus the values torchtitan already
reduces over all ranks (the loss is the global average, the token count the global total). The
operator scrapes rank 0's pod for the status; Prometheus may scrape every pod (PodMonitor) to see
per-node stragglers. Other local ranks export nothing (a null exporter).

MFU (computed by kubetitan, also with FP8 on)::

    flops_per_second_per_gpu = num_flops_per_token * tokens_per_second_per_gpu
    mfu_ratio                = flops_per_second_per_gpu / peak_bf16_flops_per_second

``num_flops_per_token`` is torchtitan's own (``model_args.get_nparams_and_flops``: 6 x parameters
(embedding excluded) + 12 x layers x heads x head_dim x seq_len, i.e. forward + backward, PaLM
appendix B). ``tokens_per_second_per_gpu`` is torchtitan's ``tps`` (this rank's tokens over the
log interval, divided by the non-data-parallel degree). The peak is the dense bf16 tensor-core
peak of ``kubetitan_core.catalog.ACCELERATORS``, matched on the CUDA device name (else the spec's
``gpuProduct``). FP8 runs are still divided by the bf16 peak, so FP8 speed-ups show as a higher
MFU (the seeds' convention). On CPU, or on an unknown GPU, there is no peak: the
``mfu_ratio`` and ``peak_flops_per_second_per_gpu`` series are not exported at all (absent rather
than a made-up number or NaN).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from torchtitan.components.metrics import MetricsProcessor, build_device_memory_monitor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from kubetitan_core import contract
from kubetitan_core.catalog import ACCELERATORS, accelerator_for, product_of
from kubetitan_core.contract.failure import FailureReport

from kubetitan_trainer import compat, cpu_bridge

try:  # prometheus-client >= 0.18: no `_created` series for counters/histograms.
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover
    pass

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
DATA_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)
CKPT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def peak_flops_for(device_name: str | None, gpu_product: str = "", instance_type: str = "") -> float | None:
    """Dense bf16 peak FLOP/s of one GPU, or None when unknown (CPU, unlisted GPU)."""
    if (key := product_of(device_name)) is not None:
        return ACCELERATORS[key].peak_bf16_tflops * 1e12
    acc = accelerator_for(instance_type or None, gpu_product or None)
    return acc.peak_bf16_tflops * 1e12 if acc else None


def mfu_ratio(flops_per_token: float, tokens_per_second_per_gpu: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation, 0-1: achieved model FLOP/s of one GPU over its bf16 peak."""
    if not peak_flops or peak_flops <= 0:
        return None
    return flops_per_token * tokens_per_second_per_gpu / peak_flops


def eval_perplexity(loss: float) -> float:
    """Perplexity of a mean per-token loss in nats: exp(loss); inf when that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


MEDIAN_WINDOW = 50
"""Steps in the rolling median of ``kubetitan_trainer_step_duration_median_seconds``."""


def restart_generation() -> tuple[int, FailureReport | None]:
    """(worker generation, the failure that began it: None in generation 0) from the launcher's environment
    (contract.ENV_RESTART_*)."""
    gen = int(os.environ.get(contract.ENV_RESTART_GENERATION, "0") or 0)
    return gen, FailureReport.from_env(os.environ)


class NullExporter:
    """Exporter of ranks that do not serve (every local rank but 0): every attribute and call is a no-op."""

    enabled = False
    port = 0

    def __getattr__(self, name: str) -> "NullExporter":
        return self

    def __call__(self, *args, **kwargs) -> None:
        return None


class Exporter:
    """kubetitan's trainer metrics in one registry, served over HTTP by local rank 0."""

    enabled = True

    def __init__(self, *, peak_flops: float | None, total_steps: int, attempt: int, job_start: float,
                 checkpoint_interval: int = 0) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.port = 0
        self._step_metrics(r, peak_flops)
        self._progress_metrics(r)
        self._restart_metrics(r)
        self.total_steps.set(total_steps)
        self.attempt.set(attempt)
        self.job_start.set(job_start)
        self.ckpt_interval.set(checkpoint_interval)
        self._tokens_seen = 0
        self._recent: list[float] = []
        self._first_step_done = False

    def _step_metrics(self, r: CollectorRegistry, peak_flops: float | None) -> None:
        """What a logged step measured: loss, gradients, throughput, FLOPs, step and data-wait times, eval, memory."""
        self.step = Gauge(contract.M_STEP, "Last completed optimizer step (steps).", registry=r)
        self.total_steps = Gauge(contract.M_TOTAL_STEPS, "Optimizer steps the run trains for (steps).", registry=r)
        # Registered at the first logged step (set_loss): before it there is no loss, and a 0 would be read as one.
        self.loss = Gauge(contract.M_LOSS, "Training loss averaged over all ranks' tokens at the last logged step (nats per token).", registry=None)
        self._loss_registered = False
        self.grad_norm = Gauge(contract.M_GRAD_NORM, "Global L2 norm of the gradients before clipping at the last logged step (ratio).", registry=r)
        self.lr = Gauge("kubetitan_trainer_learning_rate", "Learning rate of the last logged step (ratio).", registry=r)
        self.tps_total = Gauge(contract.M_TOKENS_PER_SECOND, "Training throughput of the whole job over the last log interval (tokens per second).", registry=r)
        self.tps_gpu = Gauge(contract.M_TOKENS_PER_SECOND_PER_GPU, "Training throughput of this rank over the last log interval, divided by the non-data-parallel degree (tokens per second).", registry=r)
        self.flops_gpu = Gauge(contract.M_FLOPS_PER_GPU, "Achieved model FLOP/s of this rank's device over the last log interval (FLOP per second).", registry=r)
        self.mfu = self.peak = None
        if peak_flops:
            self.mfu = Gauge(contract.M_MFU, "Model FLOPs utilisation: achieved model FLOP/s over the device's dense bf16 peak (ratio 0-1).", registry=r)
            self.peak = Gauge("kubetitan_trainer_peak_flops_per_second_per_gpu", "Dense bf16 peak of one device used as the MFU denominator (FLOP per second).", registry=r)
            self.peak.set(peak_flops)
        self.step_duration = Histogram(contract.M_STEP_DURATION, "Wall time of one optimizer step including its collectives (seconds).", buckets=STEP_BUCKETS, registry=r)
        self.data_loading = Histogram(contract.M_DATA_LOADING_DURATION, "Time the train loop waited for one micro-batch from the data loader; rate of the sum over wall time is the share of time spent waiting for data (seconds).", buckets=DATA_BUCKETS, registry=r)
        self.data_tokens_total = Counter(contract.M_DATA_TOKENS.removesuffix("_total"), "Tokens each data source (label "
                                         "source) gave the job's global stream, carried across attempts through the "
                                         "checkpoint's data position (tokens).", ["source"], registry=r)
        self._data_tokens: dict[str, int] = {}
        self.data_epochs_gauge = Gauge(contract.M_DATA_EPOCHS, "Passes over each data source's (label source) "
                                       "training sequences so far: its samples over its sequences; above 1, a source "
                                       "repeats (epochs).", ["source"], registry=r)
        # Registered with their first value: before it there is no loss, and a 0 would be read as one.
        self.source_loss = Gauge(contract.M_SOURCE_LOSS, "Training loss of each data source (label source) of a "
                                 "mixture at the last logged step, averaged over that source's tokens of the step on "
                                 "every rank (nats per token).", ["source"], registry=None)
        self.source_eval_loss = Gauge(contract.M_SOURCE_EVAL_LOSS, "Held-out loss of each data source (label "
                                      "source) of a mixture at the last evaluation, averaged over its held-out "
                                      "tokens (nats per token).", ["source"], registry=None)
        self._source_registered: set[str] = set()
        self.data_weight = Gauge(contract.M_DATA_WEIGHT, "Share of the samples of the current step each data source "
                                 "(label source) gives, from the mixture's weights at that step: constant, or as its "
                                 "weight schedule says (ratio 0-1).", ["source"], registry=r)
        # Registered at the first evaluation (eval_done): before it there is no eval loss, and a 0 would be read as one.
        self.eval_loss = Gauge(contract.M_EVAL_LOSS, "Loss on the held-out samples at the last evaluation, averaged "
                               "over their tokens (nats per token).", registry=None)
        self.eval_perplexity = Gauge(contract.M_EVAL_PERPLEXITY, "Perplexity on the held-out samples at the last "
                                     "evaluation, exp of the eval loss (ratio).", registry=None)
        self.eval_step = Gauge(contract.M_EVAL_STEP, "Step of the last evaluation on the held-out samples (steps).",
                               registry=None)
        self._eval_registered = False
        self.mem_active = Gauge(contract.M_MEMORY_MAX_ACTIVE, "Peak active device memory over the last log interval; peak host RSS on CPU (bytes).", registry=r)
        self.mem_reserved = Gauge(contract.M_MEMORY_MAX_RESERVED, "Peak reserved device memory over the last log interval; peak host RSS on CPU (bytes).", registry=r)

    def _progress_metrics(self, r: CollectorRegistry) -> None:
        """What the run has kept and when: checkpoints, tokens, goodput, heartbeats, this generation's start-up."""
        self.ckpt_duration = Histogram(contract.M_CHECKPOINT_SAVE_DURATION, "Time training was blocked by a checkpoint save (staging only with async saves) (seconds).", buckets=CKPT_BUCKETS, registry=r)
        self.ckpt_step = Gauge(contract.M_LAST_CHECKPOINT_STEP, "Step of the newest complete checkpoint this attempt saved or resumed from; async saves count once their background write has finished (steps).", registry=r)
        self.resumed_from = Gauge(contract.M_RESUMED_FROM_STEP, "Step this worker generation resumed from: the "
                                  "checkpoint it loaded, 0 for a fresh start, -1 until its state is loaded (steps).",
                                  registry=r)
        self.resumed_from.set(-1)
        self.ckpt_ts = Gauge(contract.M_LAST_CHECKPOINT_TIMESTAMP, "Unix time the newest checkpoint save completed, background write included (seconds).", registry=r)
        self.tokens = Counter(contract.M_TOKENS.removesuffix("_total"), "Tokens trained on by the whole job, carried across attempts through the checkpoint at any data-parallel degree (tokens).", registry=r)
        self.attempt = Gauge(contract.M_ATTEMPT, "Attempt number of this gang; restarts seen = attempt (count).", registry=r)
        self.heartbeat = Gauge(contract.M_LAST_STEP_TIMESTAMP, "Unix time the last optimizer step completed; the heartbeat for hang detection (seconds).", registry=r)
        self.first_step_ts = Gauge(contract.M_FIRST_STEP_TIMESTAMP, "Unix time this worker generation completed "
                                   "its first optimizer step, 0 before it: where a restart's downtime ends, exact "
                                   "however late the first scrape comes (seconds).", registry=r)
        self.productive = Counter(contract.M_PRODUCTIVE_SECONDS.removesuffix("_total"), "Wall time of optimizer steps kept in checkpoints, carried across attempts (seconds).", registry=r)
        self.job_start = Gauge(contract.M_JOB_START_TIMESTAMP, "Unix time the run's first attempt started; goodput = productive seconds / (now - this) (seconds).", registry=r)
        # Alerts judge checkpoint age in intervals; 0 means checkpoints are off.
        self._failed_saves_metrics(r)
        self.ckpt_interval = Gauge(contract.M_CHECKPOINT_INTERVAL, "Configured steps between two checkpoint "
                                   "saves; 0 when checkpoints are off (steps).", registry=r)
        self.startup_phase = Gauge(
            contract.M_STARTUP_PHASE_SECONDS, "Start-up of this worker generation split into phases, from the launcher's "
            "start (or its detection of the failure an in-place restart answers) to the end of the first step; the "
            "phases sum to kubetitan_trainer_startup_seconds (seconds).", ["phase"], registry=r)
        self.startup_total = Gauge(contract.M_STARTUP_SECONDS, "Start-up of this worker generation: from the launcher's "
                                   "start or its detection of the failure to the end of the first step (seconds).", registry=r)

    def _failed_saves_metrics(self, r: CollectorRegistry) -> None:
        """Checkpoint saves that failed with a storage error (storage.SaveBudget): training goes on until
        spec.checkpoint.maxFailedSaves of them in a row; the operator's CheckpointSaveFailing condition reads these."""
        self.saves_failed = Counter(contract.M_CHECKPOINT_SAVES_FAILED.removesuffix("_total"), "Checkpoint saves of "
                                    "this worker generation that failed with a storage error (saves).", registry=r)
        self.saves_failed_in_a_row = Gauge(contract.M_CHECKPOINT_SAVES_FAILED_IN_A_ROW, "Checkpoint saves that failed "
                                           "in a row since the last complete one; 0 after a save completes (saves).",
                                           registry=r)
        self.max_failed_saves = Gauge(contract.M_CHECKPOINT_MAX_FAILED_SAVES, "Checkpoint saves in a row that may "
                                      "fail before the attempt ends with exit code 6: spec.checkpoint.maxFailedSaves "
                                      "(saves).", registry=r)
        self.last_failed_save_step = Gauge(contract.M_CHECKPOINT_LAST_FAILED_SAVE_STEP, "Step of the newest checkpoint "
                                           "save that failed; -1 before any (steps).", registry=r)
        self.last_failed_save_step.set(-1)
        self.save_failure = Gauge(contract.M_CHECKPOINT_SAVE_FAILURE, "1 for the newest failed save's error (label "
                                  "error: an errno name such as ENOSPC, or the exception's type) while saves fail in "
                                  "a row; no sample otherwise (info).", ["error"], registry=r)
        self._saves_failed_seen = 0

    def inprocess_restart(self, cause: str) -> None:
        """One in-process restart of this worker process, for a fault of ``cause``."""
        self.inprocess_restarts.labels(cause).inc()

    def checkpoint_saves(self, budget: Any) -> None:
        """The failed-saves budget's counts (a ``storage.SaveBudget``) after a save was counted."""
        self.max_failed_saves.set(budget.budget)
        if budget.total_failed > self._saves_failed_seen:
            self.saves_failed.inc(budget.total_failed - self._saves_failed_seen)
            self._saves_failed_seen = budget.total_failed
        self.saves_failed_in_a_row.set(budget.in_a_row)
        self.save_failure.clear()
        if budget.in_a_row:
            self.save_failure.labels(budget.last_error_class or "unknown").set(1)
            if budget.failed_steps:
                self.last_failed_save_step.set(budget.failed_steps[-1])

    def _restart_metrics(self, r: CollectorRegistry) -> None:
        """In-place restarts (launch.py --max-restarts): which worker generation this is, and the failure that began it."""
        self.restart_generation = Gauge(contract.M_RESTART_GENERATION, "Worker generation within this attempt: 0 for the "
                                "first workers, +1 per in-place restart of every rank's workers (count).", registry=r)
        self.restart_exit_code = Gauge(contract.M_RESTART_EXIT_CODE, "Exit code of the worker failure that began "
                                       "this generation (128 + signal for a signal); -1 in generation 0 (code).",
                                       registry=r)
        self.restart_node_rank = Gauge(contract.M_RESTART_NODE_RANK, "Node rank (pod rank) whose worker failure "
                                       "began this generation; -1 in generation 0 (rank).", registry=r)
        self.restart_ts = Gauge(contract.M_RESTART_TIMESTAMP, "Unix time a launcher saw the worker failure that "
                                "began this generation; 0 in generation 0 (seconds).", registry=r)
        self.restart_previous_step = Gauge(contract.M_RESTART_PREVIOUS_STEP, "Last step the previous worker "
                                           "generation trained, from rank 0's step heartbeat (the work an in-place "
                                           "restart loses is the steps past the checkpoint it resumes from); -1 in "
                                           "generation 0 or when unknown (step).", registry=r)
        self.inprocess_restarts = Counter(contract.M_INPROCESS_RESTARTS.removesuffix("_total"), "In-process "
                                          "restarts of this worker process (runPolicy.inProcessRestarts), by the "
                                          "fault's cause (label cause: ContainerFailed, NonFiniteLoss, Hang, ...) "
                                          "(restarts).", ["cause"], registry=r)
        self.step_median = Gauge(contract.M_STEP_DURATION_MEDIAN, "Median wall time of this generation's last "
                                 f"{MEDIAN_WINDOW} optimizer steps; the operator's automatic hang timeout scales "
                                 "with it (seconds).", registry=r)
        gen, failure = restart_generation()
        self.restart_generation.set(gen)
        # generation 0 (no failure): -1, -1, 0, -1, as the help texts say
        self.restart_exit_code.set(failure.exit_code if failure else -1)
        self.restart_node_rank.set(failure.node_rank if failure else -1)
        self.restart_ts.set(failure.time if failure else 0)
        self.restart_previous_step.set(failure.previous_step if failure and failure.previous_step is not None else -1)

    def startup(self, record: dict) -> None:
        """The start-up anatomy of this worker generation (:mod:`kubetitan_trainer.recovery.anatomy`)."""
        for phase, seconds in record["phases"].items():
            self.startup_phase.labels(phase=phase).set(seconds)
        self.startup_total.set(record["total_seconds"])
        self.restart_generation.set(record["generation"])  # the same shared generation the launcher set

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics. ``0.0.0.0`` (the default) binds dual-stack ``::`` where the kernel has IPv6, so the
        operator's scrape reaches rank 0 on IPv4, IPv6 and dual-stack clusters alike."""
        if port <= 0:
            return
        if host == "0.0.0.0" and socket.has_ipv6:
            try:
                start_http_server(port, addr="::", registry=self.registry)  # IPV6_V6ONLY off: IPv4 too
                host = "[::]"
            except OSError:  # no IPv6 on this host (disabled in the kernel): IPv4 only
                start_http_server(port, addr=host, registry=self.registry)
        else:
            start_http_server(port, addr=host, registry=self.registry)
        self.port = port
        logger.info(f"Serving Prometheus metrics on http://{host}:{port}/metrics")

    def set_loss(self, loss: float) -> None:
        """The loss of a logged step; the loss metric appears on /metrics with the first one."""
        self.loss.set(loss)
        if not self._loss_registered:
            self.registry.register(self.loss)
            self._loss_registered = True

    def data_tokens(self, totals: dict[str, int]) -> None:
        """Tokens each source has given the job so far (absolute; the counters advance by the difference)."""
        for source, total in totals.items():
            seen = self._data_tokens.get(source, 0)
            if total > seen:
                self.data_tokens_total.labels(source=source).inc(total - seen)
                self._data_tokens[source] = total

    def data_epochs(self, epochs: dict[str, float]) -> None:
        """Each source's epochs so far (fractional)."""
        for source, e in epochs.items():
            self.data_epochs_gauge.labels(source=source).set(e)

    def _per_source(self, name: str, gauge: Gauge, values: dict[str, float]) -> None:
        for source, v in values.items():
            gauge.labels(source=source).set(v)
        if values and name not in self._source_registered:
            self.registry.register(gauge)
            self._source_registered.add(name)

    def source_losses(self, losses: dict[str, float]) -> None:
        """Each source's training loss at the last logged step; the series appear with the first one."""
        self._per_source(contract.M_SOURCE_LOSS, self.source_loss, losses)

    def source_eval_losses(self, losses: dict[str, float]) -> None:
        """Each source's held-out loss at the last evaluation; the series appear with the first one."""
        self._per_source(contract.M_SOURCE_EVAL_LOSS, self.source_eval_loss, losses)

    def data_weights(self, shares: dict[str, float]) -> None:
        """Each source's share of the current step's samples."""
        for source, share in shares.items():
            self.data_weight.labels(source=source).set(share)

    def eval_done(self, step: int, loss: float) -> None:
        """A held-out evaluation at ``step``; the eval series appear on /metrics with the first one."""
        self.eval_loss.set(loss)
        self.eval_perplexity.set(eval_perplexity(loss))
        self.eval_step.set(step)
        if not self._eval_registered:
            for g in (self.eval_loss, self.eval_perplexity, self.eval_step):
                self.registry.register(g)
            self._eval_registered = True

    def step_done(self, step: int, seconds: float) -> None:
        self.step.set(step)
        self.step_duration.observe(seconds)
        self._recent = [*self._recent[-(MEDIAN_WINDOW - 1):], seconds]
        self.step_median.set(statistics.median(self._recent))
        self.productive.inc(seconds)
        now = time.time()
        self.heartbeat.set(now)
        if not self._first_step_done:
            self.first_step_ts.set(now)
            self._first_step_done = True

    def carried(self, productive_seconds: float) -> None:
        """Productive seconds restored from the checkpoint (earlier attempts' kept work)."""
        self.productive.inc(productive_seconds)

    def tokens_seen(self, global_tokens: int) -> None:
        if global_tokens > self._tokens_seen:
            self.tokens.inc(global_tokens - self._tokens_seen)
            self._tokens_seen = global_tokens

    def checkpoint_saved(self, step: int, blocked_seconds: float, pending: Future | None = None) -> None:
        """A save of ``step`` returned after blocking training for ``blocked_seconds``.

        ``pending`` is the background write of an async save: the checkpoint is published as the newest
        complete one only when it finishes (a write that fails publishes nothing: resume skips it too).
        """
        self.ckpt_duration.observe(blocked_seconds)
        if pending is None:
            self._checkpoint_complete(step)
        else:
            pending.add_done_callback(lambda f: f.exception() is None and self._checkpoint_complete(step))

    def _checkpoint_complete(self, step: int) -> None:
        self.ckpt_step.set(step)
        self.ckpt_ts.set(time.time())


class NoPeakLogFilter(logging.Filter):
    """Without a known peak (CPU, an unlisted GPU) torchtitan divides by an A100's and logs an MFU anyway: this filter
    on its (root) logger drops the fallback warning, says once that MFU is not computed, and shows the step line's
    MFU as n/a (the texts are ``compat``'s, each with a canary)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self._mfu = re.compile(compat.STEP_LOG_MFU)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if compat.PEAK_FALLBACK_LOG in msg:
            return False
        if compat.PEAK_USED_LOG in msg:
            record.msg, record.args = (f"MFU is not computed: no bf16 peak is known for this device ({self.device}); "
                                       f"{contract.M_MFU} is not exported"), ()
            return True
        if "mfu: " in msg and self._mfu.search(msg):
            record.msg, record.args = self._mfu.sub("  mfu: n/a", msg), ()
        return True


class _WithoutKeys:
    """A metric logger (torchtitan's container) that leaves ``keys`` out of what it logs."""

    def __init__(self, inner: Any, keys: set[str]) -> None:
        self.inner, self.keys = inner, keys

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log({k: v for k, v in metrics.items() if k not in self.keys}, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _job_start() -> float:
    try:
        return float(os.environ.get(contract.ENV_JOB_START_TIME, ""))
    except ValueError:
        return time.time()


class KubetitanMetricsProcessor(MetricsProcessor):
    """torchtitan's processor (console, TensorBoard) plus the Prometheus exporter and a step log.

    ``__init__`` mirrors the base class's (it sets every attribute of ``compat.METRICS_PROCESSOR_ATTRIBUTES``), but
    picks the memory monitor itself: the CPU bridge's :class:`~kubetitan_trainer.cpu_bridge.CpuMemoryMonitor`
    when there is no GPU (bridge 2).
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag: str | None = None):
        self.logger = compat.build_metric_logger(job_config, parallel_dims, tag)
        self.parallel_dims = parallel_dims
        self.job_config = job_config
        self.device_memory_monitor = (
            cpu_bridge.CpuMemoryMonitor() if cpu_bridge.needed() else build_device_memory_monitor()
        )
        self.color = utils.NoColor() if job_config.metrics.disable_color_printing else utils.Color()
        kt = job_config.kubetitan
        self.peak_flops = peak_flops_for(
            None if cpu_bridge.needed() else self.device_memory_monitor.device_name,
            kt.gpu_product,
            kt.instance_type,
        )
        # torchtitan divides by this for its own console MFU; it must not be zero.
        self.gpu_peak_flops = self.peak_flops or 1e12
        if self.peak_flops is None:
            device = "cpu" if cpu_bridge.needed() else (self.device_memory_monitor.device_name or "unknown")
            self._no_peak_filter = NoPeakLogFilter(device)
            logging.getLogger().addFilter(self._no_peak_filter)  # torchtitan logs through the root logger
            self.logger = _WithoutKeys(self.logger, {compat.STEP_METRIC_MFU})
        self.ntokens_since_last_log = 0
        self.data_loading_times = []
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()
        self.num_flops_per_token = -1
        self.optimizers = None
        self.lr_schedulers = None
        self.model_parts = None

        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        attempt = int(os.environ.get(contract.ENV_ATTEMPT, "0") or 0)
        if local_rank == 0:
            self.exporter: Exporter | NullExporter = Exporter(
                peak_flops=self.peak_flops,
                total_steps=job_config.training.steps,
                attempt=attempt,
                job_start=_job_start(),
                checkpoint_interval=job_config.checkpoint.interval if job_config.checkpoint.enable else 0,
            )
            self.exporter.serve(kt.metrics_port, kt.metrics_host)
        else:
            self.exporter = NullExporter()
        self.source_report: Callable[[], dict[str, dict[str, float]]] | None = None
        """The trainer's, for a global-stream loader (:meth:`report_sources`): per source, its tokens and epochs (and,
        in a mixture, its loss at the logged step); called on every rank at every logged step (it may all-reduce)."""
        self.eval_source_report: Callable[[], dict[str, dict[str, float]]] | None = None
        """The validator's, for a mixture's held-out split: per source, its held-out loss (every rank calls it)."""
        self.step_log: Path | None = None
        self.attempt = attempt
        self.generation = restart_generation()[0]
        if self.rank == 0:
            self.step_log = Path(job_config.job.dump_folder) / "kubetitan" / "steps.jsonl"
            self.step_log.parent.mkdir(parents=True, exist_ok=True)

    def report_sources(self, train: Callable[[], dict[str, dict[str, float]]] | None = None,
                       held_out: Callable[[], dict[str, dict[str, float]]] | None = None) -> None:
        """Where logged steps (``train``) and evaluations (``held_out``) get their per-source numbers from."""
        if train is not None:
            self.source_report = train
        if held_out is not None:
            self.eval_source_report = held_out

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        # Read the interval's counters before torchtitan's log() resets them.
        time_delta = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        flops = self.num_flops_per_token * tps
        mfu = mfu_ratio(self.num_flops_per_token, tps, self.peak_flops)
        mem = self.device_memory_monitor.get_peak_stats()
        extra = dict(extra_metrics or {})
        global_tokens = int(extra.get("n_tokens_seen", 0))
        ex = self.exporter
        ex.set_loss(global_avg_loss)
        ex.grad_norm.set(grad_norm)
        if "lr" in extra:
            ex.lr.set(float(extra["lr"]))
        ex.tps_gpu.set(tps)
        ex.tps_total.set(tps * self.parallel_dims.world_size)
        ex.flops_gpu.set(flops)
        if mfu is not None and getattr(ex, "mfu", None) is not None:
            ex.mfu.set(mfu)
        ex.mem_active.set(mem.max_active_gib * 2**30)
        ex.mem_reserved.set(mem.max_reserved_gib * 2**30)
        ex.tokens_seen(global_tokens)
        if mfu is not None:
            extra["kubetitan/mfu_ratio"] = mfu
        sources = self.source_report() if self.source_report is not None else None
        if sources:
            ex.source_losses({name: v["loss"] for name, v in sources.items() if "loss" in v})
            extra.update({f"kubetitan/loss/{name}": v["loss"] for name, v in sources.items() if "loss" in v})
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        if self.step_log is not None:
            rec = {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm, "tokens_per_second_per_gpu": tps,
                   "flops_per_second_per_gpu": flops, "mfu_ratio": mfu, "tokens": global_tokens, "time": time.time(),
                   "attempt": self.attempt, "generation": self.generation}
            if sources:
                rec["sources"] = sources
            with open(self.step_log, "a") as f:
                f.write(json.dumps(rec) + "\n")


    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        """torchtitan's validation log line, plus the eval metrics and a line in ``kubetitan/evals.jsonl``."""
        loss = float(loss)
        self.exporter.eval_done(step, loss)
        sources = self.eval_source_report() if self.eval_source_report is not None else None
        extra = {**(extra_metrics or {}), "validation_metrics/perplexity": eval_perplexity(loss)}
        if sources:
            self.exporter.source_eval_losses({name: v["loss"] for name, v in sources.items() if "loss" in v})
            extra.update({f"validation_metrics/loss/{name}": v["loss"] for name, v in sources.items() if "loss" in v})
        super().log_validation(loss, step, extra_metrics=extra)
        if self.step_log is not None:
            rec = {"step": step, "eval_loss": loss, "eval_perplexity": eval_perplexity(loss), "time": time.time(),
                   "attempt": self.attempt, "generation": self.generation}
            if sources:
                rec["sources"] = {name: {"eval_loss": v["loss"], "eval_tokens": v["loss_tokens"]}
                                  for name, v in sources.items() if "loss" in v}
            with open(self.step_log.with_name("evals.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")


def build_metrics_processor(job_config: JobConfig, parallel_dims: ParallelDims, model_args=None, tag: str | None = None):
    """TrainSpec ``build_metrics_processor_fn``."""
    return KubetitanMetricsProcessor(job_config, parallel_dims, tag)
