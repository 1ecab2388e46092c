"""The one module where kubetitan touches torchtitan's and torch's private or version-fragile internals.

Pinned: torch 2.11, torchtitan 0.2.2. Every other module of ``kubetitan_trainer`` calls a function or reads
a constant here instead of reaching into an ``_private`` attribute, importing an underscore name or
rebinding an attribute of someone else's module, class or object (``tests/trainer/test_compat.py`` scans
them and fails if one does). Each shim is tiny and says in its docstring what upstream thing it depends on
and why there is no public extension point. Each declares its upstream dependencies as data
(:class:`Upstream`: the symbol, the parameter names the shim relies on, the attributes it expects the
upstream code to set, the source text it expects upstream to contain); the canary tests check every one of
them against the installed torch and torchtitan, so an upgrade that changes one fails with the symbol's name
and the shim to re-check. docs/trainer.md "torchtitan internals we depend on" is generated from
:data:`SHIMS` (``python -m kubetitan_trainer.compat --write docs/trainer.md``; a test diffs it).

Nothing here imports torch or torchtitan at module import: the launcher imports this module before it
decides whether to import them (the warm-worker path must not initialise CUDA).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

TORCH_VERSION = "2.11"
TORCHTITAN_VERSION = "0.2.2"
"""The versions every shim below was written and checked against."""


@dataclasses.dataclass(frozen=True)
class Upstream:
    """One upstream thing a shim depends on: ``symbol`` is ``module:qualified.name``."""

    symbol: str
    params: tuple[str, ...] | None = None
    """The parameter names (``inspect.signature``, in order) the shim calls, overrides or mirrors; None: unchecked."""
    sets: tuple[str, ...] = ()
    """Attributes the symbol (a function: its body; a class: its ``__init__``) assigns on ``self``."""
    sets_exactly: bool = False
    """True: ``sets`` is the complete list (the shim mirrors an ``__init__`` and must set the same attributes)."""
    contains: tuple[str, ...] = ()
    """Source text the symbol must contain: a call made through a name kubetitan rebinds, a key it reads."""


SHIMS: dict[str, tuple[Upstream, ...]] = {}
"""Shim name -> the upstream things it depends on (the canary tests and the doc table iterate this)."""


def _shim(*upstream: Upstream) -> Callable:
    def register(fn: Callable) -> Callable:
        SHIMS[fn.__name__] = upstream
        return fn

    return register


CONSTANT_SUMMARIES: dict[str, str] = {}
"""Constant name -> its one-line description (the doc table's; a constant has no introspectable docstring)."""


def _declare(name: str, summary: str, *upstream: Upstream) -> None:
    SHIMS[name] = upstream
    CONSTANT_SUMMARIES[name] = summary


def _rebind(obj: Any, name: str, value: Any) -> None:
    """The one place attributes of upstream modules, classes and objects are rebound."""
    setattr(obj, name, value)


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


@_shim(Upstream("torch.distributed.distributed_c10d:_set_pg_timeout", params=("timeout", "group")))
def set_pg_timeout(timeout, group=None) -> None:
    """Set a process group's timeout after creation (what torchtitan's ``set_pg_timeouts`` calls).

    torch has no public setter: ``init_process_group``/``new_group`` take the timeout only at creation."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


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


# ====================================================================== DCP staging (kubetitan_trainer.recovery.staging)
@_shim(
    Upstream("torch.distributed.checkpoint._state_dict_stager:StateDictStager",
             params=("pin_memory", "share_memory", "pin_memory_min_bytes")),
    Upstream("torch.distributed.checkpoint._state_dict_stager:StateDictStager.close", params=("self",)),
)
def state_dict_stager_class() -> type:
    """torch's ``StateDictStager`` (the deep-copying stager inside ``DefaultStager``), from a private module.

    The per-stage ``close`` of torch 2.11's ``DefaultStager._stage`` (pytorch issue 183413) can only be
    neutralised by a subclass of it; torch exports it only from ``torch.distributed.checkpoint._state_dict_stager``."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    return StateDictStager


@_shim(
    Upstream("torch.distributed.checkpoint.staging:DefaultStager.__init__", params=("self", "config"),
             sets=("_state_dict_stager",)),
    Upstream("torch.distributed.checkpoint.staging:DefaultStager._stage", contains=("self._state_dict_stager.close()",)),
    Upstream("torch.distributed.checkpoint.staging:DefaultStager.close", contains=("self._state_dict_stager.close()",)),
)
def replace_state_dict_stager(stager, inner) -> None:
    """Replace a ``DefaultStager``'s inner ``StateDictStager`` (its private ``_state_dict_stager``).

    ``DefaultStager`` builds it in ``__init__`` and takes no argument for another one."""
    _rebind(stager, "_state_dict_stager", inner)


@_shim(Upstream("torch.distributed.checkpoint.staging:DefaultStager.__init__", sets=("_state_dict_stager",)))
def inner_state_dict_stager(stager):
    """A ``DefaultStager``'s inner ``StateDictStager`` (see :func:`replace_state_dict_stager`)."""
    return stager._state_dict_stager


_STAGER = "torch.distributed.checkpoint._state_dict_stager:StateDictStager"

STATE_DICT_STAGER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_stage_untyped_storage": ("self", "storage", "non_blocking"),
}
"""Private ``StateDictStager`` methods ``staging._KeepOpenStateDictStager`` overrides (declared with
:func:`overrides`): the staging arena (kubetitan_trainer.recovery.arena) hands out the staged storages; torch allocates
one shared, pinned storage per tensor there and has no allocator hook."""

_declare(
    "STATE_DICT_STAGER_OVERRIDES", "Private StateDictStager methods staging's stager overrides (the staging arena "
    "allocates the staged storages; torch has no allocator hook).",
    *(Upstream(f"{_STAGER}.{name}", params=params) for name, params in STATE_DICT_STAGER_OVERRIDES.items()),
    Upstream(f"{_STAGER}._stage_untyped_storage", contains=(
        "if storage in self._cached_storage_mapping:", "self._cached_storage_mapping[storage] = new_storage")),
    Upstream(f"{_STAGER}._offload_tensor", contains=("self._stage_untyped_storage(",)),
)


@_shim(
    Upstream("torch:UntypedStorage._new_shared_fd_cpu"),
    Upstream("torch.multiprocessing.reductions:rebuild_storage_fd", contains=("cls._new_shared_fd_cpu(fd, size)",)),
    Upstream("torch.multiprocessing.reductions:reduce_storage", contains=("storage._share_fd_cpu_()",)),
)
def shared_storage_from_fd(fd: int, nbytes: int) -> Any:
    """A CPU storage mapping ``nbytes`` of the file open at ``fd`` (``MAP_SHARED``; the storage keeps a duplicate of
    ``fd``): torch's own shared-memory storage, which ``torch.multiprocessing`` hands to another process by that
    file descriptor instead of copying it into fresh shared memory. The staging arena's files need exactly this
    (DCP's checkpoint process receives the staged copy through such a pipe); torch makes it only in private
    ``UntypedStorage._new_shared_fd_cpu`` (what ``rebuild_storage_fd`` calls)."""
    import torch

    return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)


@_shim(Upstream(f"{_STAGER}.__init__", sets=("_cached_storage_mapping",)))
def staged_storage_cache(stager) -> Any:
    """A ``StateDictStager``'s cache of staged storages (source storage -> staged copy, weakly keyed), which
    ``_stage_untyped_storage`` reads first; an override that allocates the copy itself must fill it as torch does."""
    return stager._cached_storage_mapping


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
    ``torchtitan.train.main`` parses without arguments: a warm launcher that imports torchtitan for forked
    workers must know it, and memoising the workers' parse means wrapping the method
    (:func:`replace_config_parse`): ``main`` builds its own ``ConfigManager``, with no parameter for a parsed
    config."""
    import inspect

    from torchtitan.config import ConfigManager

    fn = ConfigManager.parse_args
    return fn, inspect.signature(fn).parameters["args"].default


@_shim(Upstream("torchtitan.config:ConfigManager.parse_args", params=("self", "args")))
def replace_config_parse(fn: Callable) -> None:
    """Rebind ``ConfigManager.parse_args`` (see :func:`config_parse`)."""
    from torchtitan.config import ConfigManager

    _rebind(ConfigManager, "parse_args", fn)


_RDZV = "torch.distributed.rendezvous"


@_shim(
    Upstream(f"{_RDZV}:_create_c10d_store", params=("hostname", "port", "rank", "world_size", "timeout", "use_libuv")),
    Upstream(f"{_RDZV}:_env_rendezvous_handler", contains=("_create_c10d_store(",)),
)
def c10d_store_factory() -> Callable:
    """torch's ``_create_c10d_store`` (the TCPStore a worker's ``env://`` process group dials) as it is now.

    torchrun's agents share their rendezvous store with the workers under no per-restart prefix and torch has
    no knob for one: :func:`replace_c10d_store_factory` wraps the factory that ``_env_rendezvous_handler``
    looks up by module global at call time."""
    import importlib

    return importlib.import_module(_RDZV)._create_c10d_store  # the package attribute of that name is a function


@_shim(Upstream(f"{_RDZV}:_create_c10d_store"))
def replace_c10d_store_factory(fn: Callable) -> None:
    """Rebind ``torch.distributed.rendezvous._create_c10d_store`` (see :func:`c10d_store_factory`)."""
    import importlib

    _rebind(importlib.import_module(_RDZV), "_create_c10d_store", fn)


@_shim(Upstream(f"{_RDZV}:_torchelastic_use_agent_store", params=()))
def uses_agent_store() -> bool:
    """Whether this worker's process group uses torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), as
    torch decides it (a private predicate; no public one)."""
    import importlib

    return importlib.import_module(_RDZV)._torchelastic_use_agent_store()


_C10D = "torch.distributed.distributed_c10d"


@_shim(Upstream(f"{_C10D}:_abort_process_group", params=("group",), contains=("pg_to_abort.abort()",)),
       Upstream(f"{_C10D}:_World.pg_names"))
def abort_process_group(*, keep_bookkeeping: bool = False) -> None:
    """Abort every process group's communicators (NCCL: a collective stuck on the GPU returns with an error).

    torch's ``_abort_process_group()`` (experimental, NCCL only) aborts them in one NCCL group and clears c10d's world
    (``destroy_process_group`` would wait for the stuck collective). ``keep_bookkeeping``: only call each group's
    ``abort()`` and leave the world to the main thread (the in-process monitor thread's case: the main thread may be
    inside a collective of those groups). Gloo groups are left alone: their collectives end by the peer's closed
    sockets or the group's timeout (``kubetitan_trainer.recovery.inprocess``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if not keep_bookkeeping:
        c10d._abort_process_group()
        return
    for pg in sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True):
        try:
            pg.abort()
        except RuntimeError as e:  # already aborted, or a backend without abort
            logging.getLogger("kubetitan.compat").debug("abort of %s: %s", c10d._world.pg_names.get(pg), e)


_FSDP_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"


@_shim(Upstream(f"{_FSDP_COMMON}:FSDPMeshInfo.__post_init__", sets=("shard_process_group",)),
       Upstream(f"{_FSDP_COMMON}:DDPMeshInfo.__post_init__", sets=("replicate_process_group",)),
       Upstream("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup",
                sets=("mesh_info", "post_forward_mesh_info")),
       Upstream("torch.distributed.fsdp:FSDPModule._get_fsdp_state"),
       Upstream("torchtitan.distributed.parallel_dims:ParallelDims.build_mesh"),
       Upstream("torchtitan.distributed.parallel_dims:ParallelDims.world_mesh.fget", contains=("self._world_mesh",)))
def rebind_process_groups(parallel_dims: Any, model_parts: list) -> int:
    """After the default process group was destroyed and made again (an in-process restart): torchtitan's meshes
    built again, in the order of the first time, and every FSDP2 module's process groups re-bound; the number of
    group references re-bound.

    c10d names groups by a counter that the default group's destroy resets, so groups made again in the same order
    get the same names, and a ``DeviceMesh`` (the model's DTensors keep theirs) resolves its groups by name: the old
    meshes reach the new groups. FSDP2 instead keeps the group objects (``FSDPMeshInfo.shard_process_group``,
    ``DDPMeshInfo.replicate_process_group``, both in HSDP) of each param group's ``mesh_info`` and ``post_forward_mesh_info``; a
    destroyed gloo group even stays usable through such a reference, so a forgotten one would keep using the old
    connections without an error."""
    from torch.distributed.fsdp import FSDPModule

    _rebind(parallel_dims, "_world_mesh", None)
    _rebind(parallel_dims, "_world_mesh", parallel_dims.build_mesh())
    n = 0
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for info in {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}.values():
                if hasattr(info, "shard_process_group"):
                    _rebind(info, "shard_process_group", info.mesh.get_group(info.shard_mesh_dim))
                    n += 1
                if hasattr(info, "replicate_process_group"):
                    _rebind(info, "replicate_process_group", info.mesh.get_group(info.replicate_mesh_dim))
                    n += 1
    return n


_DYN = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


@_shim(
    Upstream(f"{_DYN}:_delay"),
    Upstream("torch.distributed.elastic.rendezvous.utils:_delay", params=("seconds",)),
    Upstream(f"{_DYN}:_DistributedRendezvousOpExecutor.run", contains=("_delay(seconds=1)",)),
)
def poll_rendezvous_every(seconds: float) -> None:
    """Make torch's c10d rendezvous poll its shared state every ``seconds`` where it sleeps a fixed 1 s.

    ``_DistributedRendezvousOpExecutor.run`` calls the module global ``_delay(seconds=1)`` between polls;
    the interval has no parameter. Other delays (the first round's random skew) pass through unchanged."""
    import importlib

    from torch.distributed.elastic.rendezvous import utils

    delay, poll = utils._delay, seconds
    # keyword-compatible: torch calls _delay(seconds=1)
    _rebind(importlib.import_module(_DYN), "_delay", lambda seconds: delay(poll if seconds == 1 else seconds))


@_shim(
    Upstream(f"{_DYN}:DynamicRendezvousHandler.__init__", sets=("_state_holder",)),
    Upstream(f"{_DYN}:_BackendRendezvousStateHolder", params=("backend", "settings", "cache_duration"),
             sets=("_cache_duration",)),
)
def shorten_rendezvous_cache(handler, seconds: float) -> None:
    """Serve the c10d rendezvous's shared state from its cache for at most ``seconds`` (torch: 1 s).

    ``DynamicRendezvousHandler`` builds its ``_BackendRendezvousStateHolder`` with ``cache_duration=1`` and
    ``RendezvousParameters`` has no key for it. A handler without one (static rendezvous) is left alone."""
    holder = getattr(handler, "_state_holder", None)
    if holder is not None and getattr(holder, "_cache_duration", 0) > seconds:
        holder._cache_duration = seconds


@_shim(
    Upstream("torch.distributed.elastic.rendezvous.api:RendezvousHandler.num_nodes_waiting", params=("self",)),
    Upstream("torch.distributed.elastic.agent.server.api:SimpleElasticAgent._invoke_run",
             contains=("rdzv_handler.num_nodes_waiting()",)),
)
def wrap_num_nodes_waiting(handler, wrap: Callable) -> None:
    """Wrap a rendezvous handler's ``num_nodes_waiting`` (``wrap`` takes the original and returns the new one).

    ``SimpleElasticAgent._invoke_run`` restarts healthy workers when it returns > 0; a peer's in-place restart
    announced outside torch's rendezvous (``launch.store.rejoin``) must count, and the agent takes no other signal."""
    _rebind(handler, "num_nodes_waiting", wrap(handler.num_nodes_waiting))


_AGENT = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"


@_shim(Upstream(f"{_AGENT}.__init__", sets=("_store",)), Upstream(f"{_AGENT}._rendezvous", contains=("self._store = store",)))
def agent_store(agent):
    """The agent's rendezvous store (None before its first round); torch keeps it in the private ``_store``."""
    return getattr(agent, "_store", None)


@_shim(Upstream(f"{_AGENT}.__init__", sets=("_remaining_restarts",)),
       Upstream(f"{_AGENT}._invoke_run", contains=("if self._remaining_restarts > 0:", "self._remaining_restarts -= 1")))
def remaining_restarts(agent) -> int:
    """In-place restarts the agent has left (``--max-restarts`` minus those used: private ``_remaining_restarts``)."""
    return agent._remaining_restarts


@_shim(Upstream(f"{_AGENT}.__init__", sets=("_remaining_restarts",)))
def forbid_restarts(agent) -> None:
    """Make the agent's next failure final (no restart left): the failure is one a restart cannot cure.

    ``_invoke_run`` restarts while ``_remaining_restarts > 0``; torch has no per-failure restart policy."""
    agent._remaining_restarts = 0


ELASTIC_AGENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_monitor_workers": ("self", "worker_group"),
    "_restart_workers": ("self", "worker_group"),
    "_rendezvous": ("self", "worker_group"),
}
"""Private ``LocalElasticAgent``/``SimpleElasticAgent`` methods ``launch.agent.InPlaceAgent`` overrides (declared with
:func:`overrides`): recording failures, refusing restarts that cannot help, and skipping torch's rendezvous
round for the same gang need them; torchrun's agent has no hooks."""

_declare(
    "ELASTIC_AGENT_OVERRIDES", "Private elastic-agent methods launch.agent.InPlaceAgent overrides (declared with "
    "compat.overrides; torchrun's agent has no hooks).",
    *(Upstream(f"{_AGENT}.{name}", params=params) for name, params in ELASTIC_AGENT_OVERRIDES.items()),
    Upstream("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
             params=ELASTIC_AGENT_OVERRIDES["_monitor_workers"]),
    Upstream(f"{_AGENT}._invoke_run", contains=("self._monitor_workers(self._worker_group)",
                                                "self._restart_workers(self._worker_group)")),
    Upstream(f"{_AGENT}._initialize_workers", contains=("self._rendezvous(worker_group)",)),
)

PRIVATE_OVERRIDES: dict[str, dict[str, tuple[str, ...]]] = {
    "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent": ELASTIC_AGENT_OVERRIDES,
    _STAGER: STATE_DICT_STAGER_OVERRIDES,
}
"""Upstream class -> the private methods a kubetitan subclass may override (and call through ``super()``)."""


def overrides(*names: str) -> Callable[[type], type]:
    """Class decorator of a subclass that overrides upstream *private* methods: each name must be declared in
    :data:`PRIVATE_OVERRIDES` for one of its bases, and the base's method must still take the declared
    parameters (else the class is refused at definition, naming the method: re-check the override)."""

    def check(cls: type) -> type:
        import inspect

        for name in names:
            declared = None
            for base in cls.__mro__[1:]:
                declared = PRIVATE_OVERRIDES.get(f"{base.__module__}:{base.__qualname__}", {}).get(name, declared)
            if declared is None:
                raise TypeError(f"{cls.__qualname__}.{name} overrides an upstream private method not declared in "
                                "kubetitan_trainer.compat.PRIVATE_OVERRIDES")
            upstream = getattr(super(cls, cls), name, None)
            got = tuple(inspect.signature(upstream).parameters) if upstream is not None else None
            if got != declared:
                raise TypeError(f"{cls.__qualname__}.{name}: the upstream method takes {got}, kubetitan expects "
                                f"{declared} (torch changed: re-check the override against kubetitan_trainer.compat)")
        cls.kubetitan_private_overrides = names
        return cls

    return check


# ====================================================================== S3 checkpoints (kubetitan_trainer.storage)
_S3FS = "s3torchconnector.dcp.s3_file_system"


@_shim(Upstream("s3torchconnector:S3ClientConfig",
                params=("throughput_target_gbps", "part_size", "unsigned", "force_path_style", "max_attempts",
                        "profile")))
def s3_client_config(settings) -> Any:
    """s3torchconnector's ``S3ClientConfig`` from :class:`kubetitan_trainer.storage.S3Settings`: path-style
    addressing, the client's retry attempts (its CRT standard retry strategy: exponential backoff with jitter
    on 503 SlowDown, 5xx, throttling, resets and timeouts), part size and throughput target."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(throughput_target_gbps=settings.throughput_target_gbps, part_size=settings.part_size_bytes,
                          force_path_style=settings.force_path_style, max_attempts=settings.max_attempts)


@_shim(Upstream("s3torchconnector._s3client._s3client:S3Client.__init__",
                params=("self", "region", "endpoint", "user_agent", "s3client_config")))
def s3_client(settings, config) -> Any:
    """An s3torchconnector ``S3Client`` for the settings' region and endpoint (an S3-compatible server's URL,
    or AWS's own when empty). The client class lives in the private ``s3torchconnector._s3client``; the public
    DCP writer and reader take a region but no endpoint, so a non-AWS endpoint needs this client."""
    from s3torchconnector._s3client import S3Client

    return S3Client(settings.region, endpoint=settings.endpoint or None, s3client_config=config)


@_shim(Upstream("s3torchconnector:S3ReaderConstructor.range_based", params=("buffer_size",)))
def s3_range_reader() -> Any:
    """s3torchconnector's range-based object reader without its own buffer (``buffer_size=0``): each ``readinto``
    after a ``seek`` is one ranged GET of exactly the bytes asked for (the staging of ``s3://`` shards reads parts
    of known size, :mod:`kubetitan_trainer.data.s3shards`)."""
    from s3torchconnector import S3ReaderConstructor

    return S3ReaderConstructor.range_based(buffer_size=0)


def _s3_file_system(settings, config, reader_constructor=None) -> Any:
    from s3torchconnector.dcp import S3FileSystem

    return S3FileSystem(settings.region, s3_client=s3_client(settings, config), reader_constructor=reader_constructor)


@_shim(Upstream(f"{_S3FS}:S3StorageWriter.__init__",
                params=("self", "region", "path", "s3client_config", "prefix_strategy", "thread_count", "kwargs"),
                sets=("fs", "path", "prefix_strategy")),
       Upstream(f"{_S3FS}:S3FileSystem.__init__",
                params=("self", "region", "s3_client", "s3client_config", "reader_constructor")))
def s3_storage_writer(checkpoint_id: str, settings, config) -> Any:
    """A DCP ``S3StorageWriter`` for ``checkpoint_id`` whose file system uses :func:`s3_client` (the endpoint).

    ``S3StorageWriter`` builds its ``S3FileSystem`` (attribute ``fs``) in ``__init__`` from a region and
    config only; the file system is replaced before any request is made (the client connects lazily).

    Its write errors are made the save's (:func:`_raise_stream_errors`)."""
    from s3torchconnector.dcp import S3StorageWriter

    w = S3StorageWriter(settings.region, checkpoint_id, s3client_config=config, thread_count=settings.thread_count)
    fs = _s3_file_system(settings, config)
    _rebind(w, "fs", fs)
    _rebind(w, "path", fs.init_path(checkpoint_id))
    _raise_stream_errors(w)
    return w


class _Discard:
    """A write stream that keeps nothing (:func:`_raise_stream_errors`: a file whose object could not be opened is
    written here, then the save fails with the open's error); ``tell`` is what DCP's writer records offsets with."""

    def __init__(self) -> None:
        self.position = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.position += n
        return n

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@_shim(Upstream("torch.distributed.checkpoint.filesystem:_write_files_from_queue",
                contains=('with create_stream(file_name, "wb") as stream:', "result_queue.put(write_results)")),
       Upstream("torch.distributed.checkpoint.filesystem:_FileSystemWriter._write_data",
                contains=("threading.Thread(", "target=_write_files_from_queue", "t.join()")),
       Upstream("torch.distributed.checkpoint.filesystem:_FileSystemWriter.write_data", params=("self", "plan", "planner")),
       Upstream(f"{_S3FS}:S3FileSystem.create_stream", params=("self", "path", "mode")))
def _raise_stream_errors(writer) -> None:
    """Make a failed object write fail the DCP save on this rank, whichever writer thread it happened in.

    DCP's filesystem writer writes files on ``thread_count`` threads (``_write_data``): the extra threads run
    ``_write_files_from_queue`` bare, so an S3 error there (an outage mid-save) escapes as a thread traceback on
    stderr and the save goes on without that file's write results, as if it had succeeded (only an error on the
    calling thread fails it). Here every stream's error is caught where ``create_stream`` is used (the thread
    moves on) and ``write_data`` raises the first one after the threads end, so DCP fails the save on every rank
    (``CheckpointException``) and nothing is printed."""
    import contextlib

    errors: list[BaseException] = []
    create_stream, write_data = writer.fs.create_stream, writer.write_data

    @contextlib.contextmanager
    def recording_create_stream(path, mode):
        entered = False
        try:
            with create_stream(path, mode) as stream:
                entered = True
                yield stream
        except Exception as e:  # noqa: BLE001 - kept for write_data, which raises it on the calling thread
            if mode != "wb":
                raise
            errors.append(e)
            if not entered:  # the object could not even be opened: the thread writes this file into nothing
                yield _Discard()

    def checked_write_data(plan, planner):
        errors.clear()
        result = write_data(plan, planner)
        if errors:
            raise errors[0]
        return result

    _rebind(writer.fs, "create_stream", recording_create_stream)
    _rebind(writer, "write_data", checked_write_data)


@_shim(Upstream(f"{_S3FS}:S3StorageReader.__init__",
                params=("self", "region", "path", "s3client_config", "reader_constructor"),
                sets=("fs", "path", "_reader_constructor")))
def s3_storage_reader(checkpoint_id: str, settings, config) -> Any:
    """A DCP ``S3StorageReader`` for ``checkpoint_id`` whose file system uses :func:`s3_client` (see
    :func:`s3_storage_writer`); the reader's own DCP-optimised ranged reader constructor is kept."""
    from s3torchconnector.dcp import S3StorageReader

    r = S3StorageReader(settings.region, checkpoint_id, s3client_config=config)
    fs = _s3_file_system(settings, config, reader_constructor=r._reader_constructor)
    _rebind(r, "fs", fs)
    _rebind(r, "path", fs.init_path(checkpoint_id))
    return r


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


# ====================================================================== DTensor shards (kubetitan_trainer.recovery.restore_tier)
@_shim(Upstream("torch.distributed.tensor:DTensor._local_tensor"))
def local_tensor(t):
    """A DTensor's shard on this rank (the tensor itself when it is not a DTensor), sharing its storage.

    ``DTensor.to_local()`` is the public way, but it goes through autograd (a view with a ``grad_fn`` for a
    parameter); the restore tier copies into and out of the shard's storage, so it reads ``_local_tensor``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# ====================================================================== the AOTAutograd cache (kubetitan_trainer.compile.aot_cache)
@_shim(Upstream("torch._functorch._aot_autograd.autograd_cache:check_node_safe", params=("node",),
                contains=("unsafe_marked_cacheable_functions",)),
       Upstream("torch._inductor.config:unsafe_marked_cacheable_functions"))
def mark_cacheable(names: dict[str, str]) -> None:
    """Let the AOTAutograd cache key graphs that call these functions (``module.qualname`` -> a version string
    that goes into the key).

    torch 2.11 refuses to cache a graph with any ``call_function`` target outside its allow-list and bypasses
    the cache instead: every process then traces the joint forward/backward graph again. Its one knob is
    ``torch._inductor.config.unsafe_marked_cacheable_functions`` (a private module); entries are added, never
    removed."""
    import torch._inductor.config as inductor_config

    inductor_config.unsafe_marked_cacheable_functions.update(names)


@_shim(Upstream("torch._dynamo.variables.misc:produce_trampoline_autograd_apply", params=("fn_cls",),
                contains=("trampoline_autograd_apply._origin = produce_trampoline_autograd_apply",)),
       Upstream("torch._dynamo.symbolic_convert:InliningInstructionTranslator.check_inlineable",
                contains=("func.fn._origin is produce_trampoline_autograd_apply",)),
       Upstream("torch._dynamo.variables.misc:AutogradFunctionVariable.call_method",
                contains=("produce_trampoline_autograd_apply(",)))
def name_autograd_trampolines(namespace: Any, on_new: Callable[[str, type], None]) -> Callable[[type], Callable]:
    """Make Dynamo's stand-in for an allowed-in-graph ``autograd.Function`` a function of ``namespace`` named
    after the class, instead of a fresh closure per call site; returns the producer (to create stand-ins ahead).

    When Dynamo meets ``Fn.apply`` for a Function allowed in the graph (torchao's float8 casts and matmul are),
    it puts ``produce_trampoline_autograd_apply(Fn)`` (a local closure) in the graph; the AOTAutograd cache
    can neither allow-list nor pickle a closure, so every graph with an FP8 linear bypasses the cache. The
    stand-in here calls ``Fn.apply`` as torch's closure does; it is created once per class, set on ``namespace``
    under a name made of the class's module and qualified name (so pickle finds it by reference), and
    ``on_new(name, Fn)`` is called for it (to mark it cacheable). A class whose name is taken by another class
    (classes made by a factory share a qualified name) gets torch's own closure: its graphs bypass the cache as
    before, and no stand-in ever runs another class's code. Dynamo recognises its trampolines by ``_origin``,
    which is set to the producer Dynamo now looks up. The producer is a module function Dynamo calls through its
    module; there is no hook, so the module attribute is rebound."""
    import torch._dynamo.variables.misc as misc

    current = misc.produce_trampoline_autograd_apply
    if getattr(current, "_kubetitan_named", False):
        return current
    original = current

    def produce(fn_cls: Any) -> Callable:
        name = f"apply__{fn_cls.__module__}__{fn_cls.__qualname__}".replace(".", "_").replace("<", "_").replace(">", "_")
        fn = getattr(namespace, name, None)
        if fn is not None and getattr(fn, "_kubetitan_cls", None) is fn_cls:
            return fn
        if fn is not None or "<locals>" in fn_cls.__qualname__:  # not a unique, importable name
            closure = original(fn_cls)
            closure._origin = produce
            return closure

        def fn(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)

        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = namespace.__name__
        fn._origin = produce
        fn._kubetitan_cls = fn_cls
        setattr(namespace, name, fn)
        on_new(name, fn_cls)
        return fn

    produce._kubetitan_named = True
    _rebind(misc, "produce_trampoline_autograd_apply", produce)
    return produce


# ====================================================================== compile time (kubetitan_trainer.recovery.anatomy)
@_shim(Upstream("torch._dynamo.utils:calculate_time_spent", params=(), contains=('"total_wall_time"',)))
def compile_time_parts() -> dict[str, float]:
    """Seconds this process has spent in each part of torch.compile so far ({} when torch._dynamo is not loaded, or
    on any error): ``total_wall_time`` and torch's own phases (``entire_frame_compile``, ``backend_compile``,
    ``inductor_compile``, ``code_gen``, ``async_compile.wait``, ...).

    torch records them in ``torch._dynamo.utils`` (``calculate_time_spent()``) and has no public accessor; the
    start-up anatomy separates the first step's compile time, and its parts, with it."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    try:
        return {str(k): float(v) for k, v in utils.calculate_time_spent().items()}
    except Exception:  # noqa: BLE001 - a private API: never let it break training
        return {}


@_shim(Upstream("torch._dynamo.utils:counters"),
       Upstream("torch._dynamo.output_graph:OutputGraph.compile_and_call_fx_graph", contains=('"unique_graphs"',)),
       Upstream("torch._functorch._aot_autograd.autograd_cache:AOTAutogradCache.try_load",
                contains=('"autograd_cache_hit"',)),
       Upstream("torch._inductor.codecache:FxGraphCache.load_with_key", contains=('"fxgraph_cache_hit"',)))
def compile_counts() -> dict[str, int]:
    """This process's torch.compile counters so far that say what a warm start reused ({} when torch._dynamo is not
    loaded, or on any error): Dynamo's ``stats.unique_graphs`` (graphs traced) and ``stats.calls_captured``, and
    every ``*cache*`` counter of ``aot_autograd`` (``autograd_cache_hit`` / ``_miss`` / ``_bypass``) and
    ``inductor`` (``fxgraph_cache_hit`` / ``_miss`` / ``_bypass``, ...), as ``group.name``.

    torch keeps them in ``torch._dynamo.utils.counters`` (a dict of Counters) with no public accessor; the start-up
    anatomy records the first step's share next to its compile seconds."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    try:
        out = {f"stats.{k}": int(v) for k, v in utils.counters.get("stats", {}).items()
               if k in ("unique_graphs", "calls_captured")}
        for group in ("aot_autograd", "inductor"):
            out.update({f"{group}.{k}": int(v) for k, v in utils.counters.get(group, {}).items() if "cache" in k})
        return out
    except Exception:  # noqa: BLE001 - a private API: never let it break training
        return {}


# ====================================================================== AOT-precompiled blocks (kubetitan_trainer.compile.aot_precompile)
@_shim(Upstream("torch._dynamo.eval_frame:OptimizedModule.__init__", params=("self", "mod", "dynamo_ctx"),
                sets=("_orig_mod", "dynamo_ctx")),
       Upstream("torch._dynamo.eval_frame:OptimizedModule._initialize", sets=("forward",)))
def compiled_module_parts(module: Any) -> tuple[Any, Any] | None:
    """``(the module torch.compile wrapped, the wrapper's compiled forward)`` for a ``torch.compile(module)``
    wrapper (an ``OptimizedModule``, as torchtitan's ``apply_compile`` makes of each block); None for anything
    else. torch exposes neither attribute publicly."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, OptimizedModule):
        return None
    return module._orig_mod, module.forward


_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@_shim(Upstream("torch.nn.modules.module:Module._call_impl",
                contains=tuple(f"self.{k}" for k in _CALL_HOOKS) + tuple(f"_global{k}" for k in _CALL_HOOKS)),
       Upstream("torch.nn.modules.module:_global_forward_hooks"),
       Upstream("torch.nn.modules.module:_global_forward_pre_hooks"),
       Upstream("torch.nn.modules.module:_global_backward_hooks"),
       Upstream("torch.nn.modules.module:_global_backward_pre_hooks"))
def module_call_hooks(module: Any) -> list[str]:
    """The hooks ``__call__`` runs around the forward of ``module`` or of a module inside it (``forward_hooks``,
    ``forward_pre_hooks on attention.wq``, ...), and those registered for every module (``global ...``): ``nn.Module``
    keeps them in private dicts and offers no public way to ask whether any are set."""
    from torch.nn.modules import module as torch_module

    found = ["global " + k.strip("_") for k in _CALL_HOOKS if getattr(torch_module, "_global" + k)]
    if any(getattr(m, k, None) for m in module.modules() for k in _CALL_HOOKS):  # on every block call: names only then
        found[:0] = [k.strip("_") + (f" on {name}" if name else "")
                     for name, m in module.named_modules() for k in _CALL_HOOKS if getattr(m, k, None)]
    return found


@_shim(Upstream("torch._dynamo.eval_frame:OptimizedModule._initialize", sets=("forward",)))
def set_compiled_forward(module: Any, forward: Callable) -> None:
    """Make ``forward`` the wrapper's forward (torch sets the compiled one as an instance attribute when it
    initialises the wrapper; ``nn.Module.__call__`` calls it after the wrapper's hooks, FSDP's included)."""
    _rebind(module, "forward", forward)


@_shim(Upstream("torch._dynamo.aot_compile:aot_compile_module", params=("model", "inputs", "hooks", "backend")),
       Upstream("torch._dynamo.aot_compile:ModelInput", params=("args", "kwargs", "contexts")),
       Upstream("torch._dynamo.eval_frame:OptimizedModule._aot_compile",
                contains=("self.dynamo_ctx._hooks", "innermost_backend(self.dynamo_ctx.callback)")),
       Upstream("torch._dynamo.config:enable_aot_compile"))
def aot_compile_module(wrapper: Any, args: tuple, kwargs: dict, contexts: list) -> Any:
    """Compile ``wrapper``'s module (a ``torch.compile`` wrapper, fullgraph) ahead of time for one input signature:
    Dynamo, AOTAutograd (forward and backward) and Inductor, as its first call would, into an object that
    :func:`aot_serialize` turns into bytes; the wrapper's own forward is left as it is.

    torch 2.11's ahead-of-time compile of a module is experimental: ``OptimizedModule._aot_compile`` calls this
    function with the wrapper's hooks and backend and replaces the wrapper's forward, which kubetitan does not
    want (the compiled region keeps its own forward as the fallback), so the same call is made here."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.aot_compile import ModelInput, aot_compile_module as compile_module
    from torch._dynamo.eval_frame import innermost_backend

    _fix_defaults_source_pickling()
    # a copy: aot_compile_fullgraph sets its own guard filter on the hooks it is given, and the wrapper's own
    # compiles (an evaluation, another shape) must keep their full guards
    hooks = copy.copy(wrapper.dynamo_ctx._hooks)
    with dynamo_config.patch(enable_aot_compile=True):
        return compile_module(wrapper._orig_mod, [ModelInput(args=args, kwargs=kwargs, contexts=contexts)],
                              hooks, innermost_backend(wrapper.dynamo_ctx.callback))


@_shim(Upstream("torch._dynamo.aot_compile:AOTCompiledModel.serialize", params=("self",)))
def aot_serialize(compiled: Any) -> bytes:
    """The bytes of an :func:`aot_compile_module` result (its guards, bytecode and compiled graphs)."""
    return compiled.serialize()


@_shim(Upstream("torch._dynamo.aot_compile:AOTCompiledModel.deserialize", params=("model", "data")),
       Upstream("torch._dynamo.aot_compile:AOTCompiledFunction.disable_guard_check", params=("self",)))
def aot_deserialize(data: bytes) -> Any:
    """:func:`aot_serialize`'s bytes loaded, bound to no module yet (:func:`aot_run` passes it at each call). Safe
    on a thread of its own: it reads no module's state. Each graph's own guard check on call is turned off:
    :func:`aot_run` checks the guards once before it calls one (the graph's ``__call__`` would check them again)."""
    from torch._dynamo.aot_compile import AOTCompiledModel

    compiled = AOTCompiledModel.deserialize(None, data)
    for result in compiled.compiled_results:
        result.disable_guard_check()
    return compiled


@_shim(Upstream("torch._dynamo.aot_compile:AOTCompiledModel", sets=()),
       Upstream("torch._dynamo.aot_compile:AOTCompiledFunction.guard_check", params=("self", "args", "kwargs")),
       Upstream("torch._dynamo.aot_compile:AOTCompiledFunction.__call__", params=("self", "args", "kwargs")))
def aot_run(compiled: Any, module: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, module's forward on these arguments through the first of the compiled graphs whose guards pass)``,
    or ``(False, None)`` when none pass (the caller then runs its own compiled forward).

    ``AOTCompiledModel.__call__`` does the same but raises when no guards pass; its graphs are in
    ``compiled_results`` and take the module as their first argument."""
    for result in compiled.compiled_results:
        if result.guard_check(module, *args, **kwargs):
            return True, result(module, *args, **kwargs)
    return False, None


@_shim(Upstream("torch._dynamo.aot_compile:AOTCompiledFunction.prepare_f_locals", params=("self", "args", "kwargs")),
       Upstream("torch._dynamo.aot_compile:AOTCompiledFunction", sets=()))
def aot_guard_failure(compiled: Any, module: Any, args: tuple, kwargs: dict) -> str:
    """Why the first of the compiled graphs refuses these arguments: the guard manager's verbose check (the failed
    guard and its source), for the start-up record; "(could not tell: ...)" when it cannot tell."""
    try:
        result = compiled.compiled_results[0]
        f_locals = result.prepare_f_locals(module, *args, **kwargs)
        return str(result._artifacts.guard_manager.check_verbose(f_locals))
    except Exception as e:  # noqa: BLE001 - a diagnostic of an experimental API: never let it break training
        return f"(could not tell: {type(e).__name__}: {e})"


@_shim(Upstream("torch._dynamo.source:DefaultsSource", params=("base", "idx_key", "is_kw")),
       Upstream("torch._guards:dataclass_with_cached_hash", contains=("__reduce__",)))
def _fix_defaults_source_pickling() -> None:
    """Pickle ``DefaultsSource`` by its ``__init__`` fields only.

    torch 2.11's ``dataclass_with_cached_hash`` gives guard sources a ``__reduce__`` that passes every field to the
    class, ``init=False`` ones too, so a guard on a function's default argument (a block's ``positions=None``)
    saves but fails to load (``DefaultsSource.__init__() takes from 3 to 4 positional arguments but 6 were given``).
    The fix has to be in the saving process: it is what is written. Applied once; the canary in
    tests/trainer/test_aot_precompile.py says when torch no longer needs it."""
    from torch._dynamo.source import DefaultsSource

    if getattr(DefaultsSource.__reduce__, "_kubetitan", False):
        return

    def reduce(self: Any) -> tuple:
        return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init)

    reduce._kubetitan = True
    _rebind(DefaultsSource, "__reduce__", reduce)


# ====================================================================== the doc table
DOC_BEGIN = "<!-- compat:begin (generated by python -m kubetitan_trainer.compat --write docs/trainer.md) -->"
DOC_END = "<!-- compat:end -->"


def _summary(name: str) -> str:
    if name in CONSTANT_SUMMARIES:
        return CONSTANT_SUMMARIES[name]
    return " ".join(globals()[name].__doc__.strip().split("\n\n")[0].split()).replace("``", "`").replace(":func:", "")


def doc_table() -> str:
    """The Markdown table of docs/trainer.md "torchtitan internals we depend on" (between the markers)."""
    rows = [f"| compat name | upstream (torch {TORCH_VERSION} / torchtitan {TORCHTITAN_VERSION}) | what (why: its docstring) |",
            "|---|---|---|"]
    for name, ups in SHIMS.items():
        symbols = sorted({u.symbol for u in ups})
        rows.append(f"| `{name}` | {'<br>'.join(f'`{s}`' for s in symbols)} | {_summary(name).replace('|', '/')} |")
    return "\n".join([DOC_BEGIN, *rows, DOC_END])


def write_doc(path: str) -> bool:
    """Replace the generated table in ``path``; True when the file changed."""
    with open(path) as f:
        text = f.read()
    begin, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
    new = text[:begin] + doc_table() + text[end:]
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m kubetitan_trainer.compat", description="print or write the doc table")
    p.add_argument("--write", metavar="FILE", help="replace the table between the compat markers in FILE")
    a = p.parse_args()
    if a.write:
        print(f"{a.write}: {'updated' if write_doc(a.write) else 'unchanged'}")
    else:
        print(doc_table())
