"""``KubetitanTrainer``: torchtitan's Trainer with checks at step boundaries that no hook reaches.

Everything else comes through the TrainSpec. The subclass adds, and only adds:

- **Stop and non-finite agreement** after every step: one all-reduce (MAX) of two flags, "a stop was
  requested" (the launcher's stop file exists, i.e. the pod got SIGTERM) and "my loss is not
  finite". All ranks see the same answer at the same step, so they stop together.
- **Stop** (SIGTERM): the checkpoint of that step is saved in full and synchronously (torchtitan's
  last-step save, forced on), the loop ends, and the worker exits 75.
- **Non-finite loss**: raises :class:`NonFiniteLossError` (exit 3) before anything is saved.
- **Resume** from the newest *complete* checkpoint (``kubetitan_core.contract.newest_complete_step``);
  partial newer step directories are skipped with a warning.
- **Checkpoint store** (:mod:`kubetitan_trainer.storage`): the local/PVC folder as torchtitan uses it, or an S3
  prefix (DCP's S3 writer and reader, discovery by listing, keep-latest-K by kubetitan on rank 0, a bucket that
  cannot be listed is a configuration error before the model is built).
- **Goodput state**: productive step seconds travel in the checkpoint's ``train_state``.
- **Tokens trained, at any world size**: the checkpoint's ``train_state`` also carries the job's tokens (the sum of
  every rank's ``ntokens_seen``, one all-reduce before each save); a resume splits it into per-rank shares over
  however many data-parallel ranks it has, so the cumulative count continues exactly after a resize.
- **Start-up anatomy** (:mod:`kubetitan_trainer.recovery.anatomy`): process-group init, checkpoint load and the first
  step (its compile time apart) are marked; after the first step the phases are exported and logged.
- **Step metrics**: step time, heartbeat, data-loading time, the time a checkpoint save blocked
  training, and the newest *complete* checkpoint (an async save counts once its background write ends).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import TRAIN_STATE
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from kubetitan_core import contract
from kubetitan_core.contract import ExitCode

from kubetitan_trainer import (ENV_STOP_FILE, already_complete, chunked_loss, compat, netcheck, runtime, source_loss,
                              storage)
from kubetitan_trainer.data import loaders as data, s3shards
from kubetitan_trainer.errors import ConfigError, NetworkNotEfaError, NonFiniteLossError, StorageFullError
from kubetitan_trainer.evaluation import KubetitanValidator
from kubetitan_trainer.recovery import anatomy, heartbeat, inprocess, restore_tier
from kubetitan_trainer.recovery.staging import ensure_reusable_stager


def aot_blocks() -> Any:
    """The ahead-of-time blocks' module (:mod:`kubetitan_trainer.compile.aot_precompile`) when ``[kubetitan.runtime]
    aot_compile`` is on, imported only then; None when off (the default)."""
    if not runtime.settings().aot_compile:
        return None
    from kubetitan_trainer.compile import aot_precompile

    return aot_precompile


def checkpoint_entries(folder: str | storage.CheckpointStore) -> list[tuple[str, bool]]:
    """(directory name, has DCP metadata) pairs of a checkpoint folder (or of any checkpoint store)."""
    return storage.open_store(folder).entries()


def resolve_load_step(folder: str | storage.CheckpointStore) -> int:
    """The step to resume from under the one resume rule, -1 for none; warns about partial saves."""
    store = storage.open_store(folder)
    folder = store.root
    entries = store.entries()
    newest = contract.newest_complete_step(entries)
    for step in contract.incomplete_steps(entries):
        if newest is None or step > newest:
            logger.warning(
                f"Skipped checkpoint step-{step} in {folder}: it has no {contract.DCP_METADATA_FILE} "
                "(a save that was cut off); resuming from the newest complete one instead"
            )
    return -1 if newest is None else newest


FINISHING_WRITE_SECONDS = 30.0
"""After a fault, how long an in-place restart waits for the last save's async write to end (without a restore tier):
the write's step is then complete instead of cut off."""

GLOBAL_TOKENS_KEY = "ntokens_seen_global"
"""kubetitan's ``train_state`` key: the tokens the whole job has trained (torchtitan's logged ``n_tokens_seen``, the
sum of every rank's ``ntokens_seen``), the same on every rank. torchtitan's own ``ntokens_seen`` key is this rank's
count: DCP keeps one rank's copy, and a resume at another data-parallel degree would sum it over the new ranks."""
GLOBAL_TOKENS_FQN = f"{TRAIN_STATE}.{GLOBAL_TOKENS_KEY}"
"""The key in a checkpoint's DCP metadata (checkpoints saved before it existed lack it)."""


def token_share(global_tokens: int, rank: int, ranks: int) -> int:
    """Rank ``rank``'s share of ``global_tokens`` over ``ranks`` ranks: the shares differ by at most one token and
    sum to ``global_tokens`` exactly."""
    q, r = divmod(global_tokens, ranks)
    return q + (1 if rank < r else 0)


class KubetitanTrainer(Trainer):
    """torchtitan's Trainer plus kubetitan's step-boundary checks (see the module docstring)."""

    exit_code: int = ExitCode.OK
    """Set when the loop ended for a reason other than reaching the last step (read by ``main``)."""

    def __init__(self, job_config: JobConfig):
        self.productive_seconds = 0.0
        self._global_tokens = 0  # the job's tokens at the last save (or load): GLOBAL_TOKENS_KEY
        self._loading_legacy_train_state = False  # a load from a checkpoint without GLOBAL_TOKENS_KEY
        self._stop_file = os.environ.get(ENV_STOP_FILE, "")
        self._stopping = False
        self._local_loss: torch.Tensor | None = None
        self._inprocess: inprocess.InProcessRestart | None = None
        self._restarting = False  # an in-process restart's load: nothing to load is the end of in-process restarts
        self._step_state = inprocess.StepState()  # what an in-process restart can keep (see _keep_state)
        self._replay: list = []  # a kept-state restart's microbatches not yet trained again (StepState has them all)
        self._batches: Any = None  # torchtitan's batch generator, kept through a kept-state restart
        self._tier_writer = restore_tier.BackgroundWriter()
        ck = job_config.checkpoint
        self._heartbeat = heartbeat.Writer.from_env(job_config.training.steps, ck.enable, ck.interval)
        self._store = storage.from_config(job_config)
        self._purger: storage.Purger | None = None
        self._saves = storage.SaveBudget(job_config.kubetitan.checkpoint_storage.max_failed_saves, self._store.root,
                                         ck.interval, agree=self._max_across_ranks,
                                         rank=int(os.environ.get("RANK", "0")))
        if ck.enable:  # a bucket that cannot be listed: exit 2 now, not after building the model (an outage: 6)
            storage.preflight(self._store, job_config.job.dump_folder)
        s3shards.stage_all(job_config)  # s3:// shards to node-local disk, verified, before anything is built
        super().__init__(job_config)
        self._chunk_loss(job_config)
        self._source_stats = self._per_source_losses()
        self._saves.report = self.metrics_processor.exporter.checkpoint_saves  # the failed-saves metrics
        self._saves.report(self._saves)
        self._log_float8_notes()
        if ck.enable and self._store.remote:
            self._route_checkpoints_to_store()
        self._wrap_checkpoint_save()

    def _route_checkpoints_to_store(self) -> None:
        ckpt = self.checkpointer
        compat.set_checkpoint_folder(ckpt, self._store.root)
        compat.route_checkpoints_to(ckpt, self._store)
        k = compat.checkpoint_keep_latest_k(ckpt)
        if k > 0 and self._rank_world()[0] == 0:
            self._purger = storage.Purger(self._store, k)
        logger.info(f"Checkpoints are saved to and loaded from {self._store.root}")

    def close(self) -> None:
        super().close()
        if self._purger is not None:
            self._purger.close()  # the queued keep-latest-K deletions end before the process does

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sd = {**super().state_dict(), "productive_step_seconds": self.productive_seconds}
        if not self._loading_legacy_train_state:  # what DCP loads is what this returns: no key the checkpoint lacks
            sd[GLOBAL_TOKENS_KEY] = self._global_tokens  # summed by _sum_tokens_seen before every save
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.productive_seconds = float(state_dict.get("productive_step_seconds", 0.0))
        if GLOBAL_TOKENS_KEY in state_dict:  # else: torchtitan's per-rank count as loaded (see _dcp_load)
            self._global_tokens = int(state_dict[GLOBAL_TOKENS_KEY])
            rank, ranks = self._token_rank()
            self.ntokens_seen = token_share(self._global_tokens, rank, ranks)

    def _token_rank(self) -> tuple[int, int]:
        """(this rank's index, ranks) among those whose ``ntokens_seen`` add up to the job's tokens."""
        mesh = compat.tokens_seen_mesh(self.parallel_dims)
        return (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)

    def _sum_tokens_seen(self) -> None:
        """The job's tokens into ``_global_tokens`` for the save about to happen: every rank's ``ntokens_seen``
        summed over torchtitan's ranks (one all-reduce, collective: every rank saves at the same steps)."""
        mesh = compat.tokens_seen_mesh(self.parallel_dims)
        if mesh is None:
            self._global_tokens = self.ntokens_seen
            return
        t = torch.tensor([self.ntokens_seen], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=mesh.get_group())
        self._global_tokens = int(t.item())

    def init_distributed(self):
        rec = anatomy.current()
        rec.mark("pg_begin")
        try:
            return super().init_distributed()
        finally:
            rec.mark("pg_end")

    # ------------------------------------------------------------------ loop
    def train(self):
        ck = self.job_config.checkpoint
        if ck.enable and ck.load_step == -1:
            step = resolve_load_step(self._store)
            if step >= 0:
                ck.load_step = step
                logger.info(f"Resuming from the newest complete checkpoint, step {step}")
        self._inprocess = self._in_process_restart()
        if self._inprocess is not None and isinstance(getattr(self, "validator", None), KubetitanValidator):
            self.validator.untimed = self._inprocess.untimed
        if self._inprocess is None:
            result = super().train()
        else:
            result = self._inprocess.run(self._train_iteration, process_group_ready=True)
        if (aot := aot_blocks()) is not None:
            aot.training_ended()  # a clean end: the AOT artefact's crash marker goes
        return result

    def _in_process_restart(self) -> inprocess.InProcessRestart | None:
        """The in-process restarter when ``[kubetitan] inprocess_restarts`` is on (kubetitan_trainer.recovery.inprocess)."""
        kt = self.job_config.kubetitan
        if kt.inprocess_restarts <= 0 or not dist.is_initialized():
            return None
        if not self.checkpointer.enable:
            logger.warning("In-process restarts are off: checkpoint.enable is false, so there is no state to restart "
                           "from (turn checkpoints on to use [kubetitan] inprocess_restarts)")
            return None
        rank, world = self._rank_world()
        timeout = float(self.job_config.comm.train_timeout_seconds)
        logger.info(f"In-process restarts on: up to {kt.inprocess_restarts}, collective timeout {timeout:.0f} s, "
                    f"progress timeout {kt.inprocess_progress_timeout_seconds or 'off'} (pid {os.getpid()})")
        for o in self.optimizers:  # from an optimizer step's start, the state is no whole step's until the next
            o.register_step_pre_hook(self._step_state.spoil)
        return inprocess.InProcessRestart(
            inprocess.launcher_store_factory(), rank, world, backend=dist.get_backend(),
            collective_timeout=timeout, barrier_timeout=timeout + 30, max_restarts=kt.inprocess_restarts,
            progress_timeout=float(kt.inprocess_progress_timeout_seconds) or None,
            before_teardown=self._let_the_last_write_end, state_token=self._state_token)

    def _state_token(self) -> str:
        """This rank's word for the state it holds after a fault (``InProcessRestart.state_token``): the last whole
        step, unless a restore tier's load still copies the optimizer's state in (its first step has not waited)."""
        return "" if self._tier_hooks else self._step_state.token()

    def _keep_state(self) -> bool:
        """An in-process restart where every rank kept its state (the fault came before any rank's optimizer step):
        nothing is loaded; torchtitan's loop trains the interrupted step again, on the microbatches it had drawn
        (``batch_generator`` yields them first, then goes on with the same data iterator)."""
        assert self._inprocess is not None
        faulted = self.step
        self.step = self._step_state.step
        self._replay = list(self._step_state.batches)  # all of them again, also after a fault in a retried step
        self._restarting = False
        self._inprocess.mark("state_loaded")
        logger.info(f"In-process restart: every rank kept the state of step {self.step} (the fault at step {faulted} "
                    f"came before the optimizer step): nothing to load; step {self.step + 1} trains again on its "
                    f"{len(self._replay)} microbatch(es) drawn before the fault")
        self._after_load(kept=True)
        return True

    def _let_the_last_write_end(self) -> None:
        """After a fault, before the process groups go: the last save's async write, if still in flight, is given up
        to ``FINISHING_WRITE_SECONDS`` to end on every rank (its collectives run on the async-save group, which the
        teardown destroys: cut off, its step would be lost). Not with a restore tier, which holds that step already
        (the load waits for its writer)."""
        write = compat.pending_write(self.checkpointer)
        if write is None or write.done() or self._tier:
            return
        begin = time.monotonic()
        concurrent.futures.wait([write], timeout=FINISHING_WRITE_SECONDS)
        logger.info(f"In-process restart: the last save's background write {'ended' if write.done() else 'is still running'}"
                    f" after {time.monotonic() - begin:.1f} s of waiting for it")

    def _train_iteration(self, iteration: int):
        """torchtitan's loop; after an in-process restart, first the meshes and FSDP's groups re-bound to the new
        process group and the newest saved state as the one to load (the model and its compiled code are kept)."""
        if iteration > 0:
            cut = self._saves.abandon(compat.pending_write(self.checkpointer))  # ended or left: before_teardown
            compat.clear_pending_write(self.checkpointer)
            if cut is not None:  # with a restore tier that step loads from the tier: nothing is lost
                (logger.info if self._tier else logger.warning)(
                    f"In-process restart {iteration}: the background write of the last save before the fault {cut}; "
                    + ("the restore tier holds its step" if self._tier else "the newest complete checkpoint is loaded"))
            n = compat.rebind_process_groups(self.parallel_dims, self.model_parts)
            compat.reset_fsdp_runtime(self.model_parts)  # the interrupted step's FSDP state (a fault mid-backward)
            # after the meshes' groups, in the order torchtitan made them
            remade = ", the async-save group made again" if compat.remake_checkpoint_group(self.checkpointer) else ""
            if self._inprocess is not None and self._inprocess.recoveries:
                self.metrics_processor.exporter.inprocess_restart(str(self._inprocess.recoveries[-1]["cause"]))
            ck = self.job_config.checkpoint
            kept = self._inprocess is not None and self._inprocess.kept is not None
            if not kept:
                ck.load_step = resolve_load_step(self._store)  # a newer restore tier wins inside the load (-1: none)
                self._replay, self._batches = [], None  # the loaded state has its own data position
                self._step_state.begin(-1)  # nothing whole until the loaded state's first step begins (in place:
                # the optimizers' step pre-hooks hold this object)
            self._restarting = True
            logger.info(f"In-process restart {iteration}: process groups re-bound ({n} FSDP references{remade}), "
                        f"{'keeping the state every rank holds' if kept else 'loading the newest saved state'} "
                        f"(pid {os.getpid()})")
        return super().train()

    def _after_load(self, kept: bool = False) -> None:
        """After a load (``kept``: an in-process restart that kept the state, whose step is no checkpoint's)."""
        ex = self.metrics_processor.exporter
        data.attach(self.dataloader, self.job_config, ex, lambda: self.step)
        ex.carried(self.productive_seconds)
        ex.step.set(self.step)
        if kept:
            return
        ex.resumed_from.set(self.step)
        if self.step > 0:
            # The checkpoint this attempt resumed from is its newest complete one until it saves another:
            # the operator's restart record (resumedFromStep, lostSteps) reads it if the attempt dies first.
            ex.ckpt_step.set(self.step)
        steps = self.job_config.training.steps
        if self.step >= steps and self._rank_world()[0] == 0:
            logger.warning(already_complete(self.step, steps))

    def should_continue_training(self) -> bool:
        return not self._stopping and super().should_continue_training()

    def batch_generator(self, data_iterable):
        """torchtitan's, timed, and remembered for an in-process restart that keeps the state: the interrupted
        step's microbatches first (``_replay``, counted in the tokens already), then the same iterator goes on
        (never ``yield from``: closing this generator must not close the kept one)."""
        times = self.metrics_processor.data_loading_times
        observe = self.metrics_processor.exporter.data_loading.observe
        remember = self._inprocess is not None  # the step's microbatches (StepState.begin empties them)
        while self._replay:  # popped before it is yielded: a fault in between still finds it in StepState
            input_dict, labels = self._replay.pop(0)
            yield dict(input_dict), labels  # a copy: the step moves its tensors to the device in place
        if self._batches is None:
            self._batches = super().batch_generator(data_iterable)
        batches = self._batches
        while True:
            try:
                input_dict, labels = next(batches)
                if remember:  # at once: an interrupt may come at any line after it
                    self._step_state.batches.append((dict(input_dict), labels))
            except BaseException:  # a generator that raised is finished, and so is the data position it held
                self._step_state.step = -1
                self._batches = None
                raise
            if times:
                observe(times[-1])
            yield input_dict, labels

    def _chunk_loss(self, job_config: JobConfig) -> None:
        """``precision.lossChunks``: the model returns the final norm's output, the loss projects it in chunks."""
        chunks = job_config.kubetitan.loss_chunks
        if chunks <= 1:
            return
        if self.parallel_dims.pp_enabled or self.parallel_dims.tp_enabled:
            raise ConfigError("precision.lossChunks needs tensor and pipeline parallelism off (the spec refuses it)")
        c = job_config.compile
        backend = c.backend if c.enable and "loss" in c.components else None
        chunked_loss.install(self.model_parts[0], self.loss_fn, chunks, backend)
        logger.info("Chunked loss: the output projection and the cross entropy in %d chunks of the batch's tokens%s",
                    chunks, " (compiled)" if backend else "")

    def _per_source_losses(self) -> source_loss.SourceStats | None:
        """A mixture's per-source training losses (:mod:`kubetitan_trainer.source_loss`): the stats the loss fills and
        the report the metrics processor adds to a logged step (tokens and epochs of every source, and its loss)."""
        names = source_loss.source_names(self.dataloader, self.parallel_dims)
        stats = source_loss.SourceStats(names) if names else None
        stream = getattr(self.dataloader, "stream", None)
        if stream is not None:
            group = source_loss.loss_group(self.parallel_dims)

            def report() -> dict[str, dict[str, float]]:
                rep = stream.report()
                if stats is not None:  # every rank logs the same steps: the all-reduce is collective
                    for name, v in stats.losses(group, self.device).items():
                        rep[name].update(v)
                return rep

            self.metrics_processor.report_sources(train=report)
        return stats

    def post_dataloading_process(self, input_dict, labels):
        """The loader's source tags go to the loss (the model never sees them)."""
        sources = input_dict.pop(data.SOURCE_KEY, None)
        if self._source_stats is not None and isinstance(self.loss_fn, source_loss.SourceLoss):
            self.loss_fn.tag(sources, self._source_stats if sources is not None else None)
        return super().post_dataloading_process(input_dict, labels)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        fault = None
        if self._inprocess is not None:  # test-only (KUBETITAN_TEST_FAULT)
            fault = inprocess.inject_into_backward(self.model_parts[0], self._rank_world()[0], self.step)
        try:
            loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        finally:
            if fault is not None:
                fault.remove()
        if self._inprocess is not None:
            loss = inprocess.inject(self._rank_world()[0], self.step, loss)  # test-only (KUBETITAN_TEST_FAULT)
        d = loss.detach()
        self._local_loss = d if self._local_loss is None else self._local_loss + d
        return loss

    def train_step(self, data_iterator):
        begin = time.perf_counter()
        rec = anatomy.current()
        first = rec.result is None
        if first:
            rec.mark("load_begin")  # no checkpoint load happened: the load phase is 0
            rec.mark("load_end")
            rec.first_step_begins()
        self._local_loss = None
        if self._source_stats is not None:
            self._source_stats.reset()
        if self._inprocess is not None:
            self._inprocess.step = self.step
            # the previous step passed its checks: a whole step's state (a step trained again keeps its microbatches)
            self._step_state.begin(self.step - 1, again=bool(self._replay))
        super().train_step(data_iterator)
        # After the first step every NCCL communicator exists: its log says which network it is on.
        not_efa = self._check_network() if first else False
        aot = aot_blocks()
        vote = aot.vote() if aot is not None and first else (False, False)  # the AOT blocks': (makes one, ready)
        stop, non_finite, not_efa, aot_decision = self._agree(not_efa, vote)
        seconds = time.perf_counter() - begin
        if not_efa:
            raise NetworkNotEfaError(self._network_message or "NCCL is not on EFA on another node of the run "
                                     "(see its local rank 0's log); exit code 5")
        if non_finite:
            raise NonFiniteLossError(self.step)
        self.productive_seconds += seconds
        self.metrics_processor.exporter.step_done(self.step, seconds)
        # a SIGTERM stop saves a full checkpoint on every rank, at any step: a save window for every watchdog (only
        # the launcher of the pod that got SIGTERM knows of the stop)
        self._heartbeat.step_done(self.step, seconds, saving=stop)
        if first:
            self._publish_startup(rec, aot_decision)
        if aot is not None:
            aot.step_ended()  # the artefact's crash marker goes after the second step
        if self._inprocess is not None and self._inprocess.restarts:
            self._inprocess.mark("first_step")  # once per restart (the first mark of a phase is kept)
        if stop:
            self._stopping = True
            logger.warning(f"Stop requested (SIGTERM): saving a full checkpoint at step {self.step}, then exiting")

    def _publish_startup(self, rec: anatomy.Recorder, aot_decision: tuple[bool, bool]) -> None:
        record = rec.first_step_ends(self.step, self.metrics_processor.attempt)
        aot = aot_blocks()
        # after the mark: each rank's one-off precompile (a collective when some rank makes one)
        made = aot.after_first_step(aot_decision) if aot is not None else None
        if made is not None:  # is not start-up
            record["aot_precompile"] = made
        self.metrics_processor.exporter.startup(record)
        if self.metrics_processor.rank == 0:
            logger.info(anatomy.describe(record))
            anatomy.append_log(self.job_config.job.dump_folder, record)

    _network_message: str = ""
    _tier_pending: restore_tier.Pending | None = None
    """The restore tier's copies still running in the background (restore_tier.defer_keys)."""
    _tier_hooks: list = []
    """The optimizers' step pre-hooks that wait for them (never mutated in place: replaced per load)."""

    def _check_network(self) -> bool:
        """Log the NCCL network (local rank 0) and say whether the run must end (kubetitan_trainer.netcheck)."""
        kt = self.job_config.kubetitan
        v = netcheck.startup_verdict(kt, os.environ, nccl_in_use=self.device.type == "cuda")
        if v is None:
            return False
        getattr(logger, v.level)(f"Network check: {v.message}")
        if v.fail:
            self._network_message = v.message
        return v.fail

    def _stop_requested(self) -> bool:
        return bool(self._stop_file) and os.path.exists(self._stop_file)

    def _max_across_ranks(self, value: float) -> float:
        """``value``'s maximum over every rank (one all-reduce; the value itself on a single rank)."""
        return max_across_ranks(value, self.device)

    def _agree(self, not_efa: bool = False, aot_vote: tuple[bool, bool] = (False, False)
               ) -> tuple[bool, bool, bool, tuple[bool, bool]]:
        """All ranks agree on (stop, non-finite loss, NCCL not on EFA, and the AOT blocks' decision: some rank makes
        an artefact, every rank is ready to) with one MAX all-reduce. ``aot_vote``: this rank's (makes one, ready:
        at its first step with its blocks installed)."""
        loss = self._local_loss if self._local_loss is not None else torch.zeros((), device=self.device)
        flags = torch.stack([
            torch.tensor(float(self._stop_requested()), device=self.device),
            (~torch.isfinite(loss.float().reshape(-1)).all()).float().to(self.device),
            torch.tensor(float(not_efa), device=self.device),
            torch.tensor(float(aot_vote[0]), device=self.device),
            torch.tensor(float(not aot_vote[1]), device=self.device),
        ])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, non_finite, not_efa, aot_makes, aot_not_ready = (bool(v) for v in flags.tolist())
        return stop, non_finite, not_efa, (aot_makes, not aot_not_ready)

    # ------------------------------------------------------------------ checkpoints
    def _wrap_checkpoint_save(self) -> None:
        """Route the checkpointer's ``save``, ``load`` and ``dcp_load`` through :meth:`_timed_save`,
        :meth:`_load_then_publish` and :meth:`_tier_or_dcp_load` (each is given the original bound method)."""
        compat.wrap_checkpoint_methods(
            self.checkpointer, save=lambda save: functools.partial(self._untimed, self._timed_save, save),
            load=lambda load: functools.partial(self._load_then_publish, load),
            dcp_load=lambda dcp_load: functools.partial(self._tier_or_dcp_load, dcp_load))
        compat.wrap_staging_wait(self.checkpointer, lambda wait: functools.partial(self._untimed, wait))

    def _untimed(self, fn: Callable, *args, **kwargs):
        """``fn`` outside the in-process progress timeout (a save, the wait for its staging: see
        ``InProcessRestart.untimed``)."""
        if self._inprocess is None:
            return fn(*args, **kwargs)
        with self._inprocess.untimed():
            return fn(*args, **kwargs)

    def _timed_save(self, save: Callable, curr_step: int, last_step: bool = False) -> None:
        """torchtitan's save, with the free-space check, the restore tier, the save's metrics, keep-latest-K, a
        stop's full synchronous save and exit code, and the failed-saves budget (a storage failure is one log line
        and training goes on: storage.SaveBudget)."""
        ckpt = self.checkpointer
        if self._stopping:
            # A stop save must be complete and resumable: full state, synchronous.
            last_step = True
            compat.force_full_last_save(ckpt)
        will_save = compat.will_save(ckpt, curr_step, last_step)
        if not will_save:
            save(curr_step, last_step=last_step)
            self._after_stop_save(False, curr_step)
            return
        self._sum_tokens_seen()
        if self._saves.settle(compat.pending_write(ckpt)):  # the last save's background write failed: counted
            compat.clear_pending_write(ckpt)
        earlier_write = compat.pending_write(ckpt)
        if not self._store.remote:  # object storage has no volume to fill
            check_free_space(ckpt.folder, self._checkpoint_bytes_estimate(), self._max_across_ranks)
        if not last_step:
            # torch 2.11's DefaultStager stages once (see staging.py); the staged copy goes into the staging arena
            # in the restore tier's folder when there is one (kubetitan_trainer.recovery.arena).
            ensure_reusable_stager(ckpt, arena_folder=self._tier, rank=self._rank_world()[0])
        tier = not last_step and bool(self._tier)
        staged_saves = compat.stages_in_background(ckpt)
        if tier and not staged_saves:
            # Before DCP's save: a failure during that save (a cut-off step-N, never loaded) still finds step N
            # in every rank's tier (restore_tier.agreed_newer_step), so an in-place restart loses no step.
            self._save_tier(curr_step)
        begin = time.perf_counter()
        saved = self._saves.attempt(lambda: save(curr_step, last_step=last_step), curr_step,
                                    last=last_step and not self._stopping)  # a stop save has no time for retries
        if saved and tier and staged_saves:
            self._tier_from_staged(curr_step)
        if saved:
            # An async save leaves its background write in save_future (a new one; a synchronous save,
            # the last step's included, leaves the earlier one or None): it is complete when that ends.
            write = compat.pending_write(ckpt)
            write = write if write is not earlier_write else None
            self._saves.written(curr_step, background=write is not None)
            self.metrics_processor.exporter.checkpoint_saved(curr_step, time.perf_counter() - begin, write)
            if self._purger is not None:
                self._purger.request()  # keep-latest-K over the complete steps (an in-flight one is kept)
        if not self._stopping:
            self._saves.check()  # collective: every rank saves at the same steps
        self._after_stop_save(saved, curr_step)

    def _tier_from_staged(self, step: int) -> None:
        """Pinned async saves: write the restore tier from the staged copy, in the background."""
        ckpt = self.checkpointer
        stager = compat.checkpoint_stager(ckpt)
        staged = getattr(stager, "last_staged", None)  # a staging.ReusableStager's
        if staged is None:
            self._save_tier(step)
            return
        stager.last_staged = None
        stager.before_stage = self._tier_writer.wait
        rank, world = self._rank_world()
        self._tier_writer.start(staged, self._tier, arena=getattr(stager, "arena", None), step=step, rank=rank,
                                world_size=world, checkpoint_folder=ckpt.folder)

    def _after_stop_save(self, saved: bool, step: int) -> None:
        """A stop's exit code: 75 when its checkpoint was saved, 143 (SIGTERM) without one."""
        if not self._stopping:
            return
        if saved:
            KubetitanTrainer.exit_code = ExitCode.TERMINATED_CHECKPOINTED
            logger.info(f"Saved the stop checkpoint at step {step}")
            return
        KubetitanTrainer.exit_code = contract.EXIT_SIGTERM
        logger.warning("Stopping without a checkpoint: " + ("checkpoint.enable is false" if not self.checkpointer.enable
                                                           else f"the stop save of step {step} failed (above)"))

    def _load_then_publish(self, load: Callable, step: int = -1) -> bool:
        """torchtitan's load (or the restore tier's, or the object store's), timed for the start-up anatomy."""
        if self._restarting and self._inprocess is not None and self._inprocess.kept is not None:
            return self._keep_state()
        rec = anatomy.current()
        rec.mark("load_begin")
        self._settle_tier_pending()
        if self._restarting:  # a fault right after a pinned save: the tier of that step may still be being written
            self._tier_writer.wait()
        loaded = self._load_newer_tier(step) or (self._load_from_store(step, load) if self._store.remote
                                                 else load(step))
        rec.mark("load_end")
        if self._restarting:
            self._restarting = False
            if not loaded:  # every rank alike: the load is collective
                raise inprocess.GangGaveUp(ExitCode.FAILED, "in-process restart: nothing saved yet to "
                                           "restart from; exiting for the launcher's restart")
            if self._inprocess is not None:
                self._inprocess.mark("state_loaded")
        if loaded and rec.load_source == "none":
            rec.load_source = "dcp"
        self._after_load()
        return loaded

    def _tier_or_dcp_load(self, dcp_load: Callable, state_dict, checkpoint_id, from_hf, from_quantized):
        """The restore tier's state when it holds this step, else DCP's load after the data-position check."""
        if not from_hf and self._load_tier(state_dict, checkpoint_id):
            return None
        if not from_hf:
            self._check_data_position(state_dict, checkpoint_id)
        return self._dcp_load(dcp_load, state_dict, checkpoint_id, from_hf, from_quantized)

    def _check_data_position(self, state_dict: dict, checkpoint_id: str) -> None:
        """A checkpoint without the data position this run's loader asks for (an older kubetitan's per-rank one, a
        streamed dataset's at another data-parallel degree) is a ConfigError saying why, not DCP's ``Missing key``."""
        if "dataloader" not in state_dict:
            return
        problem = data.resume_problem(self._store.saved_keys(checkpoint_id), self.dataloader)
        if problem is not None:
            raise problem

    def _dcp_load(self, dcp_load: Callable, state_dict: dict, checkpoint_id: str, from_hf: bool,
                  from_quantized: bool) -> None:
        """torchtitan's ``dcp_load``; a checkpoint saved before ``GLOBAL_TOKENS_KEY`` existed loads without it (DCP
        refuses a key the checkpoint lacks), keeping torchtitan's per-rank count, and a warning says so once."""
        legacy = (not from_hf and TRAIN_STATE in state_dict
                  and GLOBAL_TOKENS_FQN not in self._store.saved_keys(checkpoint_id))
        if legacy and self._rank_world()[0] == 0:
            logger.warning(
                f"The checkpoint {checkpoint_id} has no {GLOBAL_TOKENS_FQN} (saved by an earlier kubetitan): the "
                "job's token count continues from each rank's own count, which is right only at the data-parallel "
                "degree that saved it: after a resize the tokens trained before it count (new degree / old degree) "
                f"times in {contract.M_TOKENS} and the step log's tokens, in later checkpoints too (per-step tokens "
                "and throughput are right)")
        self._loading_legacy_train_state = legacy
        try:
            dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        finally:
            self._loading_legacy_train_state = False

    def _load_from_store(self, step: int, torchtitan_load: Callable[[int], bool]) -> bool:
        """torchtitan's ``load`` for a remote store (its own one tests a local folder with ``os.path``): the given
        step, else the newest complete one, through the (wrapped) ``dcp_load``; with none, torchtitan's own path
        (``checkpoint.initial_load_path`` or nothing)."""
        ckpt = self.checkpointer
        step = step if step >= 0 else resolve_load_step(self._store)
        if step < 0:
            return torchtitan_load(-1)  # the folder is no local path: its initial-load branch (or False)
        checkpoint_id = self._store.step_id(step)
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        ckpt.dcp_load(compat.states_to_load(ckpt, model_only=step == 0), checkpoint_id=checkpoint_id,
                      from_hf=False, from_quantized=False)
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    # ------------------------------------------------------------------ restore tier (kubetitan_trainer.recovery.restore_tier)
    @property
    def _tier(self) -> str:
        return os.environ.get(restore_tier.ENV_RESTORE_TIER, "") if self.checkpointer.enable else ""

    def _rank_world(self) -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def _save_tier(self, step: int) -> None:
        rank, world = self._rank_world()
        begin = time.perf_counter()
        try:
            n = restore_tier.save(compat.states_to_save(self.checkpointer), self._tier, step=step, rank=rank,
                                  world_size=world, checkpoint_folder=self.checkpointer.folder)
        except OSError as e:  # the tier is an optimisation: a failed write leaves DCP as the only source
            restore_tier.discard(self._tier, rank)
            logger.warning(f"Restore tier not written at step {step}: {e}")
            return
        if n:
            logger.info(f"Restore tier: step {step}, {n / 2**30:.2f} GiB in {time.perf_counter() - begin:.2f} s "
                        f"({self._tier})")

    def _load_newer_tier(self, step: int) -> bool:
        """Load the restore tier's step when every rank's holds the same one and it is newer than ``step`` (the
        newest complete DCP checkpoint, -1 for none): a save that the failure cut off. Collective on every rank."""
        ckpt = self.checkpointer
        if not self._tier or not ckpt.enable or compat.ft_dataloader_checkpoints(ckpt):
            return False
        rank, world = self._rank_world()
        newest = step if step >= 0 else resolve_load_step(ckpt.folder)
        local = restore_tier.tier_step(self._tier, rank=rank, world_size=world, checkpoint_folder=ckpt.folder)

        def min_max(v: int) -> tuple[int, int]:
            t = torch.tensor([float(v), -float(v)], device=self.device)
            if world > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t[0].item()), int(-t[1].item())

        newer = restore_tier.agreed_newer_step(local, newest, min_max)
        if newer < 0:
            return False
        logger.info(f"Every rank's restore tier holds step {newer}, newer than the newest complete checkpoint "
                    f"({newest if newest >= 0 else 'none'}; the step-{newer} save was cut off): loading it from the tier")
        begin = time.monotonic()
        if not self._load_tier(compat.states_to_load(ckpt, model_only=False), f"step-{newer}", step=newer):
            return False  # every rank agreed inside: all load through DCP instead
        logger.info(f"Finished loading step {newer} from the restore tier in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _load_tier(self, state_dict: dict, checkpoint_id: str, step: int | None = None) -> bool:
        """Load from the restore tier when every rank's holds the step being loaded; False: load through DCP."""
        folder = self._tier
        if not folder:
            return False
        rank, world = self._rank_world()
        if step is None:
            name = os.path.basename(os.path.normpath(checkpoint_id))
            step = int(name.removeprefix("step-")) if name.startswith("step-") and name[5:].isdigit() else -1
        ok, prepared = restore_tier.usable(folder, step=step, rank=rank, world_size=world,
                                           checkpoint_folder=self.checkpointer.folder), None
        if ok:
            try:
                prepared = restore_tier.prepare(state_dict, folder, rank=rank)
            except (restore_tier.TierMismatch, OSError, ValueError) as e:
                logger.warning(f"Restore tier does not fit this rank's state ({e}); loading through DCP")
                restore_tier.discard(folder, rank)
                ok = False
        flag = torch.tensor([1.0 if ok else 0.0], device=self.device)
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # all ranks from the tier, or all through DCP
        if flag.item() < 1:
            if ok or step >= 0:
                logger.info(f"Restore tier not used for step {step} (this rank's is {'fresh' if ok else 'stale or missing'},"
                            " not every rank's is): loading through DCP")
            return False
        begin = time.perf_counter()
        try:
            n = prepared.apply(defer=restore_tier.defer_keys())
            self._tier_pending = prepared.pending
        except Exception:
            restore_tier.discard(folder, rank)  # never try this tier again
            raise
        compat.finish_model_load(self.checkpointer, state_dict)  # what torchtitan's dcp_load does after dcp.load
        anatomy.current().load_source = "restore_tier"
        later = ""
        if prepared.pending is not None:
            self._wait_before_optimizer_step(prepared.pending, folder, rank)
            later = f", of which {prepared.pending.nbytes / 2**30:.2f} GiB of the optimizer's in the background"
        logger.info(f"Loaded step {step} from the restore tier: {n / 2**30:.2f} GiB in "
                    f"{time.perf_counter() - begin:.2f} s{later} ({folder})")
        return True

    def _settle_tier_pending(self) -> None:
        """Before any load (an in-process restart's comes before the last load's first optimizer step): the last
        tier load's background copies end, so neither DCP nor the tier writes into tensors they still fill, and
        their step pre-hooks go. Their error no longer fails a step (this load replaces what they wrote) but still
        deletes this rank's tier, as a failed load does."""
        pending, self._tier_pending = self._tier_pending, None
        for h in self._tier_hooks:
            h.remove()
        self._tier_hooks = []
        if pending is None:
            return
        try:
            pending.wait()
        except Exception as e:  # noqa: BLE001 - said and acted on; the load that follows replaces the state
            logger.warning(f"Restore tier: the last load's background copy failed ({e}); deleting this rank's tier")
            if self._tier:
                restore_tier.discard(self._tier, self._rank_world()[0])

    def _wait_before_optimizer_step(self, pending: restore_tier.Pending, folder: str, rank: int) -> None:
        """Every optimizer waits for the tier's deferred copies before its next step (once); a copy that failed
        deletes this rank's tier and ends the step with its error, as a failed load does."""
        handles: list = []
        self._tier_hooks = handles  # removed by _settle_tier_pending when a load comes first

        def wait(*_args) -> None:
            for h in handles:
                h.remove()
            handles.clear()
            begin = time.perf_counter()
            try:
                pending.wait()
            except Exception:
                restore_tier.discard(folder, rank)
                raise
            logger.info(f"Restore tier: the optimizer's {pending.nbytes / 2**30:.2f} GiB loaded in the background in "
                        f"{pending.seconds or 0:.2f} s; the step waited {time.perf_counter() - begin:.2f} s for it")

        handles.extend(o.register_step_pre_hook(wait) for o in self.optimizers)

    def _checkpoint_bytes_estimate(self) -> int:
        """Bytes one save writes (all ranks): the newest complete checkpoint's size, else model + AdamW state
        (parameters in fp32 plus two moments: 12 bytes per parameter)."""
        newest = newest_checkpoint_dir(self.checkpointer.folder)
        if newest is not None:
            return dir_bytes(newest)
        params = sum(p.numel() for m in self.model_parts for p in m.parameters())
        if dist.is_initialized() and dist.get_world_size() > 1:  # each rank holds its shard: the numel is local
            # On the training device: NCCL has no CPU tensors ("No backend type associated with device type
            # cpu" at the first save of every GPU run, on the H200).
            t = torch.tensor([params], dtype=torch.int64, device=self.device)
            dist.all_reduce(t)
            params = int(t.item())
        return params * 12

    def _log_float8_notes(self) -> None:
        kt = self.job_config.kubetitan
        if "quantize.linear.float8" not in self.job_config.model.converters:
            return
        f8 = self.job_config.quantize.linear.float8
        dp_shard = self.parallel_dims.dp_shard
        for asked, on, what in (
            (kt.requested_fsdp_float8_all_gather, f8.enable_fsdp_float8_all_gather, "FSDP FP8 all-gather"),
            (kt.requested_precompute_float8_scale, f8.precompute_float8_dynamic_scale_for_fsdp, "precomputed FP8 scales"),
        ):
            if asked and not on:
                logger.warning(f"{what} was requested but is off: torchtitan only uses it with dp_shard > 1 "
                               f"(this run has dp_shard={dp_shard})")
            elif on:
                logger.info(f"{what} is on (dp_shard={dp_shard})")


# ------------------------------------------------------------------ free space before a save
def max_across_ranks(value: float, device: Any = "cpu") -> float:
    """MAX all-reduce of one number over the default process group (``value`` itself without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


FREE_SPACE_MARGIN = 1.1
"""A save needs its estimate plus 10% (metadata, the tail of the previous async write)."""


def newest_checkpoint_dir(folder: str) -> str | None:
    """The newest complete checkpoint's folder (the one resume rule), or None."""
    step = contract.newest_complete_step(checkpoint_entries(folder))
    return None if step is None else os.path.join(folder, f"step-{step}")


dir_bytes = storage.dir_bytes
"""Bytes under a checkpoint folder (one helper, in ``kubetitan_trainer.storage``)."""


def check_free_space(folder: str, needed: int, max_across_ranks: Callable[[float], float] | None = None) -> None:
    """Raise StorageFullError (exit code 4) when the volume under ``folder`` cannot take ``needed`` bytes.

    Every rank writes its own shards of a save, to a shared volume or (per-node storage) to its own, and the
    save is a collective: with ``max_across_ranks`` (a MAX all-reduce) the ranks agree, so when any rank lacks
    the space every rank exits 4 before the save. A rank that went alone would leave the others blocked in the
    save's collectives until the gang is torn down, and their exit codes would not say why."""
    import shutil

    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free if probe else None
    want = int(needed * FREE_SPACE_MARGIN)
    short = float(want - free) if free is not None else float("-inf")
    worst = max_across_ranks(short) if max_across_ranks is not None else short
    if worst > 0:
        raise StorageFullError(folder, free if free is not None else -1, want,
                               other_rank=short <= 0, short_bytes=int(worst))
