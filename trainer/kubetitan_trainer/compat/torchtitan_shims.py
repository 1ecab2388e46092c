"""Shims of torchtitan's internals: the device globals, the TrainSpec registry, CheckpointManager, datasets,
the Validator, metrics and MFU, the Trainer and MetricsProcessor methods kubetitan overrides, the config parse
(torchtitan 0.2.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubetitan_trainer.compat.registry import Upstream, _declare, _rebind, _shim


# ====================================================================== CPU bridges (kubetitan_trainer.cpu_bridge)
DEVICE_GLOBALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchtitan.tools.utils", ("device_type", "device_module")),
    ("torchtitan.components.metrics", ("device_type", "device_module")),
    ("torchtitan.distributed.parallel_dims", ("device_type",)),
    ("torchtitan.distributed.utils", ("device_type", "device_module")),
    ("torchtitan.tools.profiling", ("device_module",)),
)
"""torchtitan's modules holding a copy of the device chosen at import, and which of the two names each has."""


@_shim(
    *(Upstream(f"{mod}:{name}") for mod, names in DEVICE_GLOBALS for name in names),
    Upstream("torchtitan.train:Trainer.__init__", contains=("utils.device_module, utils.device_type",)),
)
def rebind_device_to_cpu() -> None:
    """Set torchtitan's import-time device (``"cuda"`` without a GPU) to ``"cpu"`` / ``torch.cpu``.

    ``torchtitan.tools.utils`` evaluates ``torch._utils._get_available_device_type() or "cuda"`` when it is
    imported and the modules of :data:`DEVICE_GLOBALS` copy it (``from torchtitan.tools.utils import
    device_type``); ``Trainer.__init__`` reads ``utils.device_type`` and calls ``device_module.set_device``.
    torchtitan has no setting for the device: the module globals are rebound."""
    import importlib

    import torch

    values = {"device_type": "cpu", "device_module": torch.cpu}
    for mod, names in DEVICE_GLOBALS:
        module = importlib.import_module(mod)
        for name in names:
            _rebind(module, name, values[name])


@_shim(
    Upstream("torchtitan.distributed.utils:set_pg_timeouts", params=("timeout", "parallel_dims")),
    Upstream("torchtitan.train:Trainer.train", contains=("dist_utils.set_pg_timeouts(",)),
)
def replace_set_pg_timeouts(fn: Callable) -> None:
    """Replace ``torchtitan.distributed.utils.set_pg_timeouts``, which ``Trainer.train`` calls after step 1.

    torchtitan 0.2.2's version runs ``barrier(device_ids=[...])`` (gloo refuses it) and
    ``device_module.synchronize()``. The call sits inside ``Trainer.train``, no hook reaches it, and
    ``Trainer.train`` looks it up as a module attribute at call time, so the module attribute is rebound."""
    from torchtitan.distributed import utils as dist_utils

    _rebind(dist_utils, "set_pg_timeouts", fn)


# ====================================================================== TrainSpec registry (kubetitan_trainer.train_spec)
@_shim(
    Upstream("torchtitan.protocols.train_spec:_extra_train_specs"),
    Upstream("torchtitan.protocols.train_spec:register_train_spec", params=("name", "train_spec"),
             contains=("_extra_train_specs[name] = train_spec",)),
)
def train_spec_registered(name: str) -> bool:
    """Whether a TrainSpec of that name was registered (``register_train_spec`` refuses a second one).

    torchtitan's only lookup, ``get_train_spec``, falls back to importing ``torchtitan.models.<name>`` and
    raises for an unknown name; the registry dict itself is the only way to ask without side effects."""
    from torchtitan.protocols import train_spec

    return name in train_spec._extra_train_specs


# ====================================================================== CheckpointManager (kubetitan_trainer.trainer, .staging)
_CKPT = "torchtitan.components.checkpoint:CheckpointManager"


@_shim(Upstream(f"{_CKPT}._should_save", params=("self", "curr_step", "last_step")))
def will_save(checkpointer, curr_step: int, last_step: bool = False) -> bool:
    """Whether ``CheckpointManager.save(curr_step, last_step)`` will save (interval, last step, enabled).

    kubetitan checks free space and writes the restore tier only before a save that happens; torchtitan
    decides that in the private predicate ``_should_save`` and exposes no public one."""
    return checkpointer._should_save(curr_step, last_step)


@_shim(Upstream(f"{_CKPT}._flattened_model_states_sd", params=("self", "state_dict")))
def states_to_save(checkpointer) -> dict[str, Any]:
    """The state dict a full save writes (model flattened, optimizer, dataloader, train state).

    The restore tier writes exactly what DCP writes; torchtitan builds it in the private
    ``_flattened_model_states_sd`` inside ``save`` and returns it from nowhere public."""
    return checkpointer._flattened_model_states_sd()


@_shim(Upstream(f"{_CKPT}._states_to_load", params=("self", "model_only")))
def states_to_load(checkpointer, model_only: bool = False) -> dict[str, Any]:
    """The state dict a load fills (what ``CheckpointManager.load`` passes to ``dcp_load``).

    Loading a newer restore-tier step fills the same structure as DCP would; torchtitan builds it in the
    private ``_states_to_load``."""
    return checkpointer._states_to_load(model_only)


@_shim(
    Upstream(f"{_CKPT}.save", params=("self", "curr_step", "last_step")),
    Upstream(f"{_CKPT}.load", params=("self", "step"), contains=("self.dcp_load(",)),
    Upstream(f"{_CKPT}.dcp_load", params=("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized")),
    Upstream("torchtitan.train:Trainer.train", contains=("self.checkpointer.save(", "self.checkpointer.load(step=")),
)
def wrap_checkpoint_methods(checkpointer, *, save: Callable, load: Callable, dcp_load: Callable) -> None:
    """Wrap one ``CheckpointManager``'s ``save``, ``load`` and ``dcp_load``: each argument takes the
    original bound method and returns its replacement (called with the same parameters).

    The Trainer builds its ``CheckpointManager`` inside ``Trainer.__init__`` (the TrainSpec has no builder
    for it) and calls ``self.checkpointer.save/load`` from ``Trainer.train``; ``load`` calls ``self.dcp_load``.
    Timing a save, loading from the restore tier and publishing the resumed step need those calls, so the
    instance's methods are wrapped."""
    _rebind(checkpointer, "save", save(checkpointer.save))
    _rebind(checkpointer, "load", load(checkpointer.load))
    _rebind(checkpointer, "dcp_load", dcp_load(checkpointer.dcp_load))


@_shim(Upstream(f"{_CKPT}.__init__", sets=("save_future",)),
       Upstream(f"{_CKPT}.save", contains=("self.save_future = ",)))
def pending_write(checkpointer):
    """The Future of the newest async save's background write (None: none yet, or a disabled manager).

    torchtitan keeps it in the attribute ``save_future`` and documents no accessor; a disabled manager
    returns from ``__init__`` before it sets it."""
    return getattr(checkpointer, "save_future", None)


@_shim(Upstream(f"{_CKPT}.__init__", sets=("save_future",)),
       Upstream(f"{_CKPT}._async_wait", contains=("self.save_future.result()",)))
def clear_pending_write(checkpointer) -> None:
    """Forget the newest async save's background write once kubetitan has waited for it and counted its failure
    (``kubetitan_trainer.storage.SaveBudget``).

    ``_async_wait`` (called first by every ``save``) re-raises a failed write's exception from ``save_future`` and,
    in pinned-memory mode, never clears it: one failed write would fail every later save. No public call clears it."""
    checkpointer.save_future = None


@_shim(Upstream(f"{_CKPT}.__init__", sets=("last_save_model_only",)),
       Upstream(f"{_CKPT}._save_last_step", contains=("self.last_save_model_only",)))
def force_full_last_save(checkpointer) -> None:
    """Make the last-step save write the full state, not the model only (``checkpoint.last_save_model_only``).

    A stop save (SIGTERM) must be resumable; the flag is read from the manager's attribute at save time and
    no save parameter overrides it."""
    checkpointer.last_save_model_only = False


@_shim(Upstream(f"{_CKPT}.__init__", sets=("enable_staging",)))
def stages_in_background(checkpointer) -> bool:
    """Whether saves stage into host memory and write in the background (``async_with_pinned_mem``)."""
    return bool(getattr(checkpointer, "enable_staging", False))


@_shim(Upstream(f"{_CKPT}.__init__", sets=("enable_ft_dataloader_checkpoints",)))
def ft_dataloader_checkpoints(checkpointer) -> bool:
    """Whether torchft per-replica dataloader checkpoints are on (the restore tier stays off then)."""
    return bool(getattr(checkpointer, "enable_ft_dataloader_checkpoints", False))


@_shim(Upstream(f"{_CKPT}.__init__", sets=("stager", "async_mode")),
       Upstream(f"{_CKPT}.save", contains=("if self.stager is None:",)))
def checkpoint_stager(checkpointer):
    """The manager's DCP stager (None until its first pinned save creates one).

    torchtitan creates a ``DefaultStager`` lazily in ``save`` (``if self.stager is None``) and offers no
    parameter for another one; :func:`set_checkpoint_stager` sets it first."""
    return getattr(checkpointer, "stager", None)


@_shim(Upstream(f"{_CKPT}.__init__", sets=("stager",)))
def set_checkpoint_stager(checkpointer, stager) -> None:
    """Give the manager a stager before its first pinned save (see :func:`checkpoint_stager`)."""
    checkpointer.stager = stager


@_shim(Upstream(f"{_CKPT}.__init__", sets=("pg",)),
       Upstream(f"{_CKPT}.dcp_save", contains=("process_group=self.pg",)))
def remake_checkpoint_group(checkpointer) -> bool:
    """After an in-process restart: the gloo group torchtitan makes once for async saves (``CheckpointManager.pg``,
    passed to every ``dcp.async_save``) made again on the new default group; False when the manager has none
    (synchronous saves). Collective: every rank calls it, in the same order relative to its other groups.

    The old group died with the default one: c10d no longer knows it, and the first async save after the restart
    failed on an H100 with "Process group ... is not initialized in the world group map" (a gloo group can even
    stay usable through the stale reference, on the old connections). There is no parameter to pass another."""
    import torch.distributed as dist

    if getattr(checkpointer, "pg", None) is None:
        return False
    _rebind(checkpointer, "pg", dist.new_group(backend="gloo"))
    return True


@_shim(Upstream(f"{_CKPT}.maybe_wait_for_staging", params=("self",)),
       Upstream("torchtitan.train:Trainer.train_step", contains=("self.checkpointer.maybe_wait_for_staging()",)))
def wrap_staging_wait(checkpointer, wrap: Callable) -> None:
    """Wrap one manager's ``maybe_wait_for_staging`` (``wrap`` takes the bound method, returns its replacement).

    ``Trainer.train_step`` calls it before the optimizer step after a pinned save: the wait for that save's copy
    into host memory (over 10 s for a first save of a 3B model's 40 GiB on an H100), which the in-process
    progress timeout must not take for a hang."""
    _rebind(checkpointer, "maybe_wait_for_staging", wrap(checkpointer.maybe_wait_for_staging))


@_shim(Upstream(f"{_CKPT}.__init__", sets=("async_mode",)))
def checkpoint_async_mode(checkpointer):
    """The manager's ``AsyncMode`` (from ``checkpoint.async_mode``)."""
    return checkpointer.async_mode


@_shim(Upstream(f"{_CKPT}.dcp_load", contains=("self.states[MODEL].load_state_dict(state_dict)",)))
def finish_model_load(checkpointer, state_dict: dict) -> None:
    """What ``dcp_load`` does after ``dcp.load``: hand the flattened model state to the model wrapper.

    A load from the restore tier replaces ``dcp.load`` and must end the same way."""
    from torchtitan.components.checkpoint import MODEL

    if MODEL in checkpointer.states:
        checkpointer.states[MODEL].load_state_dict(state_dict)


# ====================================================================== datasets (kubetitan_trainer.data)
HF_TEXT_DATASET_ATTRIBUTES = ("dataset_name", "_data", "_tokenizer", "seq_len", "infinite", "_text_processor",
                              "_sample_idx", "_token_buffer")
"""What torchtitan 0.2.2's ``HuggingFaceTextDataset.__init__`` sets (its iteration and state read them)."""


@_shim(Upstream("torchtitan.hf_datasets.text_datasets:HuggingFaceTextDataset",
                params=("dataset_name", "dataset_path", "tokenizer", "seq_len", "dp_rank", "dp_world_size", "infinite"),
                sets=HF_TEXT_DATASET_ATTRIBUTES, sets_exactly=True))
def init_hf_text_dataset(dataset, *, dataset_name: str, data, tokenizer, seq_len: int, infinite: bool,
                         text_processor: Callable) -> None:
    """Set up a ``HuggingFaceTextDataset`` subclass instance as the base ``__init__`` would, for any dataset.

    The base ``__init__`` accepts only datasets of torchtitan's fixed registry (``_validate_dataset``); its
    iteration, packing and checkpoint state are what kubetitan wants, so the same attributes are set here."""
    values = {"dataset_name": dataset_name, "_data": data, "_tokenizer": tokenizer, "seq_len": seq_len,
              "infinite": infinite, "_text_processor": text_processor, "_sample_idx": 0, "_token_buffer": []}
    for name in HF_TEXT_DATASET_ATTRIBUTES:
        _rebind(dataset, name, values[name])


VALIDATOR_ATTRIBUTES = ("job_config", "tokenizer", "parallel_dims", "loss_fn", "validation_dataloader",
                        "validation_context", "maybe_enable_amp", "metrics_processor", "pp_schedule",
                        "pp_has_first_stage", "pp_has_last_stage")
"""What torchtitan 0.2.2's ``Validator.__init__`` sets (its ``validate`` reads them)."""


_declare("VALIDATOR_ATTRIBUTES", "What Validator.__init__ sets; evaluation.KubetitanValidator sets the same through "
         "init_validator (with kubetitan's held-out loader).",
         Upstream("torchtitan.components.validate:Validator", sets=VALIDATOR_ATTRIBUTES, sets_exactly=True))


@_shim(Upstream("torchtitan.components.validate:Validator",
                params=("job_config", "dp_world_size", "dp_rank", "tokenizer", "parallel_dims", "loss_fn",
                        "validation_context", "maybe_enable_amp", "metrics_processor", "pp_schedule",
                        "pp_has_first_stage", "pp_has_last_stage"),
                sets=VALIDATOR_ATTRIBUTES, sets_exactly=True),
       Upstream("torchtitan.components.validate:Validator.validate", params=("self", "model_parts", "step"),
                contains=("self.validation_dataloader", "ntokens_since_last_log", "log_validation")))
def init_validator(validator, **values: Any) -> None:
    """Set up a ``Validator`` subclass instance as the base ``__init__`` would, with kubetitan's held-out loader.

    The base ``__init__`` builds its loader with ``build_text_validation_dataloader`` (torchtitan's fixed dataset
    registry); its ``validate`` loop is what kubetitan wants, so the same attributes are set here."""
    for name in VALIDATOR_ATTRIBUTES:
        _rebind(validator, name, values[name])


# ====================================================================== MFU without a peak (kubetitan_trainer.metrics)
PEAK_FALLBACK_LOG = "fallback to A100"
"""torchtitan's warning when it knows no peak for the device (CPU included): it then divides by an A100's."""


PEAK_USED_LOG = "Peak FLOPS used for computing MFU"
"""torchtitan's log line of the peak it divides by."""


STEP_LOG_MFU = r"\s+mfu: -?[0-9.]+%"
"""The MFU field of torchtitan's step log line (a regular expression)."""


STEP_METRIC_MFU = "mfu(%)"
"""The MFU key torchtitan hands its metric loggers (TensorBoard, W&B)."""


_declare("PEAK_FALLBACK_LOG", "torchtitan's warning when no peak is known (then it divides by an A100's); "
         "metrics.NoPeakLogFilter drops it.",
         Upstream("torchtitan.tools.utils:get_peak_flops", contains=(PEAK_FALLBACK_LOG,)))


_declare("PEAK_USED_LOG", "torchtitan's log line of its MFU peak; metrics.NoPeakLogFilter rewrites it when kubetitan "
         "knows no peak.", Upstream("torchtitan.train:Trainer.__init__", contains=(PEAK_USED_LOG,)))


_declare("STEP_LOG_MFU", "The MFU field of torchtitan's step line; metrics.NoPeakLogFilter shows it as n/a without a "
         "peak.", Upstream("torchtitan.components.metrics:MetricsProcessor.log", contains=("mfu: {mfu:.2f}%",)))


_declare("STEP_METRIC_MFU", "torchtitan's MFU key for TensorBoard/W&B; dropped without a peak.",
         Upstream("torchtitan.components.metrics:MetricsProcessor.log", contains=(f'"{STEP_METRIC_MFU}"',)))


# ====================================================================== metrics (kubetitan_trainer.metrics)
METRICS_PROCESSOR_ATTRIBUTES = ("logger", "parallel_dims", "job_config", "device_memory_monitor", "color",
                                "gpu_peak_flops", "ntokens_since_last_log", "data_loading_times", "time_last_log",
                                "num_flops_per_token", "optimizers", "lr_schedulers", "model_parts")
"""What torchtitan 0.2.2's ``MetricsProcessor.__init__`` sets; ``KubetitanMetricsProcessor.__init__`` mirrors it
(it picks the memory monitor itself: the base's ``build_device_memory_monitor`` needs CUDA)."""


_declare("METRICS_PROCESSOR_ATTRIBUTES", "What MetricsProcessor.__init__ sets; KubetitanMetricsProcessor.__init__ sets "
         "the same (it builds its own memory monitor: the base's needs CUDA).",
         Upstream("torchtitan.components.metrics:MetricsProcessor", params=("job_config", "parallel_dims", "tag"),
                  sets=METRICS_PROCESSOR_ATTRIBUTES, sets_exactly=True))


@_shim(Upstream("torchtitan.components.metrics:_build_metric_logger", params=("job_config", "parallel_dims", "tag")))
def build_metric_logger(job_config, parallel_dims, tag: str | None = None):
    """torchtitan's console/TensorBoard/W&B logger container, as ``MetricsProcessor.__init__`` builds it.

    A processor that does not call the base ``__init__`` (see :data:`METRICS_PROCESSOR_ATTRIBUTES`) needs the
    same logger; torchtitan builds it only in this private function."""
    from torchtitan.components.metrics import _build_metric_logger

    return _build_metric_logger(job_config, parallel_dims, tag)


# ====================================================================== public methods kubetitan overrides
TRAINER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "init_distributed": ("self",),
    "train": ("self",),
    "should_continue_training": ("self",),
    "batch_generator": ("self", "data_iterable"),
    "forward_backward_step": ("self", "input_dict", "labels", "global_valid_tokens"),
    "train_step": ("self", "data_iterator"),
    "state_dict": ("self",),
    "load_state_dict": ("self", "state_dict"),
}
"""``torchtitan.train.Trainer`` methods ``KubetitanTrainer`` overrides, with the parameters it expects: the
step-boundary checks have no hook (a test also checks the subclass's own signatures against these)."""


_declare("TRAINER_OVERRIDES", "Trainer methods KubetitanTrainer overrides, with the parameters it expects.",
         *(Upstream(f"torchtitan.train:Trainer.{name}", params=params) for name, params in TRAINER_OVERRIDES.items()))


@_shim(
    Upstream("torchtitan.train:Trainer.batch_generator", contains=("self.ntokens_seen += ntokens_batch",)),
    Upstream("torchtitan.train:Trainer.train_step", contains=(
        "if parallel_dims.dp_cp_enabled:", 'loss_mesh = parallel_dims.get_optional_mesh("loss")',
        "self.ntokens_seen, dtype=torch.int64, device=self.device", '"n_tokens_seen": global_ntokens_seen')),
    Upstream("torchtitan.train:Trainer.__init__", contains=('states={"train_state": self}',)),
    Upstream("torchtitan.train:Trainer.load_state_dict", contains=('self.ntokens_seen = state_dict["ntokens_seen"]',)),
)
def tokens_seen_mesh(parallel_dims):
    """The ranks whose ``Trainer.ntokens_seen`` torchtitan sums into the job's tokens (the logged ``n_tokens_seen``):
    the ``"loss"`` mesh with data or context parallelism, else None (one rank's count is the job's).

    ``Trainer.ntokens_seen`` is this rank's count, checkpointed per rank under ``train_state`` (DCP keeps one copy of
    the equal values) and summed over that mesh inline in ``train_step``, which exposes neither the sum nor the
    mesh choice. kubetitan checkpoints the sum and splits it on load (``KubetitanTrainer.load_state_dict``), so a
    resume at another data-parallel degree continues the count: it must sum over the same ranks."""
    return parallel_dims.get_optional_mesh("loss") if parallel_dims.dp_cp_enabled else None


METRICS_PROCESSOR_OVERRIDES: dict[str, tuple[str, ...]] = {
    "log": ("self", "step", "global_avg_loss", "global_max_loss", "grad_norm", "extra_metrics"),
}
"""``MetricsProcessor`` methods ``KubetitanMetricsProcessor`` overrides (``log`` reads the interval's counters
before the base resets them: ``ntokens_since_last_log``, ``time_last_log``)."""


_declare("METRICS_PROCESSOR_OVERRIDES", "MetricsProcessor.log, overridden to read the interval's counters before "
         "the base resets them.",
         *(Upstream(f"torchtitan.components.metrics:MetricsProcessor.{name}", params=params,
                    contains=("self.ntokens_since_last_log = 0", "self.time_last_log = "))
           for name, params in METRICS_PROCESSOR_OVERRIDES.items()))


# ====================================================================== torchrun internals (kubetitan_trainer.launch)
@_shim(
    Upstream("torchtitan.config:ConfigManager.parse_args", params=("self", "args")),
    Upstream("torchtitan.train:main", contains=("config_manager.parse_args()",)),
)
def config_parse() -> tuple[Callable, Any]:
    """``ConfigManager.parse_args`` as it is now, and its ``args`` default.

    torchtitan 0.2.2 binds that default (``sys.argv[1:]``) when the module is imported, and
    ``torchtitan.train.main`` parses without arguments: each worker binds it to its own (:func:`bind_config_args`),
    and memoising the workers' parse means wrapping the method
    (:func:`replace_config_parse`): ``main`` builds its own ``ConfigManager``, with no parameter for a parsed
    config."""
    import inspect

    from torchtitan.config import ConfigManager

    fn = ConfigManager.parse_args
    return fn, inspect.signature(fn).parameters["args"].default


@_shim(
    Upstream("torchtitan.config:ConfigManager.parse_args", params=("self", "args")),
    Upstream("torchtitan.train:main", contains=("config_manager.parse_args()",)),
)
def bind_config_args(argv: list[str]) -> None:
    """Make ``argv`` the default of ``ConfigManager.parse_args`` (see :func:`config_parse`), which
    ``torchtitan.train.main`` parses with: bound when torchtitan was imported, it holds the argv of whichever
    process imported it first (a launcher that warmed up for other arguments, a parent that forked this one)."""
    from torchtitan.config import ConfigManager

    ConfigManager.parse_args.__defaults__ = (list(argv),)


@_shim(Upstream("torchtitan.config:ConfigManager.parse_args", params=("self", "args")))
def replace_config_parse(fn: Callable) -> None:
    """Rebind ``ConfigManager.parse_args`` (see :func:`config_parse`)."""
    from torchtitan.config import ConfigManager

    _rebind(ConfigManager, "parse_args", fn)


@_shim(Upstream(f"{_CKPT}.__init__", contains=("self.folder = os.path.join(base_folder, checkpoint_config.folder)",)),
       Upstream(f"{_CKPT}._create_checkpoint_id", params=("self", "step", "folder"),
                contains=('os.path.join(folder, f"step-{step}")',)))
def set_checkpoint_folder(checkpointer, root: str) -> None:
    """Point the manager at ``root`` (an ``s3://`` URI): torchtitan joins ``job.dump_folder`` and
    ``checkpoint.folder`` into its attribute ``folder`` in ``__init__`` and names each save
    ``os.path.join(folder, "step-N")`` (an URI joins the same way)."""
    checkpointer.folder = root


@_shim(
    Upstream(f"{_CKPT}.dcp_save", params=("self", "state_dict", "checkpoint_id", "async_mode",
                                          "enable_garbage_collection", "to_hf"),
             contains=("process_group=self.pg,", "async_checkpointer_type=AsyncCheckpointerType.PROCESS,",
                       "async_stager=self.stager,", "checkpoint_id=checkpoint_save_id,",
                       'GarbageCollection.collect("GC collection invoked by checkpointer.")')),
    Upstream(f"{_CKPT}.dcp_load", params=("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"),
             contains=("dcp.load(state_dict, checkpoint_id=checkpoint_id)",
                       "self.states[MODEL].load_state_dict(state_dict)")),
    Upstream(f"{_CKPT}._purge_stale_checkpoints", params=("self",)),
    Upstream(f"{_CKPT}.__init__", sets=("pg", "stager", "keep_latest_k")),
    Upstream("torch.distributed.checkpoint:async_save",
             params=("state_dict", "checkpoint_id", "storage_writer", "planner", "process_group",
                     "async_checkpointer_type", "async_stager", "no_dist", "use_collectives")),
)
def route_checkpoints_to(checkpointer, store) -> None:
    """Make one ``CheckpointManager`` save to and load from ``store`` (a remote
    :class:`kubetitan_trainer.storage.CheckpointStore`) with its DCP writer and reader, and leave keep-latest-K
    to kubetitan (``store.purge``; torchtitan's purge lists and ``rmtree`` s a local folder).

    ``dcp_save``/``dcp_load`` call ``dcp.save``/``async_save``/``load`` with ``storage_writer=None`` and a
    ``checkpoint_id`` path, and DCP picks a writer only for filesystem paths; there is no parameter for a
    writer. The replacements mirror their DCP (non-HF) branches with the store's writer and reader: async
    saves on the manager's gloo group, pinned saves through its stager in a background process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torchtitan.components.checkpoint import MODEL, AsyncMode
    from torchtitan.tools.utils import GarbageCollection

    def dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            raise ValueError("checkpoint.last_save_in_hf is not supported with checkpoints in object storage")
        writer = store.writer(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=checkpointer.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=checkpointer.pg, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                 async_stager=checkpointer.stager)
        else:
            ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            raise ValueError("loading a Hugging Face checkpoint from object storage is not supported")
        dcp.load(state_dict, storage_reader=store.reader(checkpoint_id), checkpoint_id=checkpoint_id)
        if MODEL in checkpointer.states:
            checkpointer.states[MODEL].load_state_dict(state_dict)

    _rebind(checkpointer, "dcp_save", dcp_save)
    _rebind(checkpointer, "dcp_load", dcp_load)
    _rebind(checkpointer, "_purge_stale_checkpoints", lambda: None)


@_shim(Upstream(f"{_CKPT}.__init__", sets=("keep_latest_k",)))
def checkpoint_keep_latest_k(checkpointer) -> int:
    """``checkpoint.keep_latest_k`` as the manager read it (0 for a disabled manager)."""
    return int(getattr(checkpointer, "keep_latest_k", 0))
