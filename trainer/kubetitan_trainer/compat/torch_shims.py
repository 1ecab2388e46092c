"""Shims of torch's private or version-fragile internals: process groups and c10d stores, torchrun's rendezvous
and elastic agent, DCP staging, DTensor shards, Dynamo, the AOTAutograd cache and AOT compile (torch 2.11)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from kubetitan_trainer.compat.registry import Upstream, _declare, _rebind, _shim


@_shim(Upstream("torch.distributed.distributed_c10d:_set_pg_timeout", params=("timeout", "group")))
def set_pg_timeout(timeout, group=None) -> None:
    """Set a process group's timeout after creation (what torchtitan's ``set_pg_timeouts`` calls).

    torch has no public setter: ``init_process_group``/``new_group`` take the timeout only at creation."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, group)


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


_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


@_shim(Upstream(f"{_PARAM_GROUP}:FSDPParamGroup", sets=(
           "_training_state", "_all_gather_result", "_post_reduce_event", "_reshard_after_forward_event",
           "_partial_reduce_output", "_all_reduce_state", "_post_forward_indices", "comm_ctx", "fsdp_params")),
       Upstream(f"{_PARAM_GROUP}:FSDPParamGroup._to_sharded", params=("self",)),
       Upstream(f"{_PARAM_GROUP}:FSDPCommContext.lazy_init", sets=(
           "all_gather_state", "reduce_scatter_state", "post_forward_order")),
       Upstream("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", sets=(
           "_training_state", "_state_ctx", "_fsdp_param_group")),
       Upstream("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPStateContext", sets=(
           "iter_forward_root", "post_backward_final_callback_queued", "post_optim_event")),
       Upstream("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam", sets=("unsharded_accumulated_grad",)),
       Upstream("torch.distributed.fsdp._fully_shard._fsdp_common:TrainingState"))
def reset_fsdp_runtime(model_parts: list) -> int:
    """After a fault in the middle of a forward or backward (an in-process restart): every FSDP2 module's runtime
    state back to "between steps", the number of parameter groups reset.

    FSDP2 keeps per-step state on its modules and parameter groups (training states left at ``FORWARD`` or
    ``PRE_BACKWARD``, the backward's final callback marked as queued, the all-gather and reduce-scatter results of
    the interrupted step, gradients on the unsharded parameters, groups left unsharded) and clears it only in the
    backward's final callback, which an exception skips. Left as it is, the next step's collectives do not match
    the other ranks' (gloo: "collective mismatch") or some parameters never get a gradient again. A load through
    ``state_dict`` reshards the groups but resets none of the rest."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    n = 0
    for part in model_parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            state._training_state = TrainingState.IDLE
            ctx = state._state_ctx
            ctx.iter_forward_root, ctx.post_backward_final_callback_queued, ctx.post_optim_event = None, False, None
            group = state._fsdp_param_group
            if group is None:
                continue
            group._training_state = TrainingState.IDLE
            group._all_gather_result = group._post_reduce_event = group._reshard_after_forward_event = None
            group._partial_reduce_output = group._all_reduce_state = None
            group._post_forward_indices.clear()
            comm = group.comm_ctx
            comm.all_gather_state = comm.reduce_scatter_state = None
            if hasattr(comm, "post_forward_order"):  # set by lazy_init: absent before the first forward
                comm.post_forward_order.clear()
            for p in group.fsdp_params:
                if hasattr(p, "_unsharded_param"):
                    p._unsharded_param.grad = None
                p.unsharded_accumulated_grad = None
            group._to_sharded()
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


_SPAWN = "torch.multiprocessing.spawn:ProcessContext"


@_shim(Upstream("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent.__init__",
                sets=("_pcontext",)))
def workers_context(agent) -> Any:
    """The elastic agent's process context of its running workers (``None`` before the first start)."""
    return getattr(agent, "_pcontext", None)


@_shim(Upstream(f"{_SPAWN}.__init__", params=("self", "processes", "error_files"),
                sets=("error_files", "processes", "sentinels")),
       Upstream(f"{_SPAWN}.join", params=("self", "timeout", "grace_period"),
                contains=("os.access(self.error_files[error_index], os.R_OK)", "pickle.load(fh)")),
       Upstream("torch.multiprocessing.spawn:ProcessExitedException.__init__",
                params=("self", "msg", "error_index", "error_pid", "exit_code", "signal_name")),
       Upstream("torch.distributed.elastic.multiprocessing.api:MultiprocessContext._poll",
                contains=("self._pc.join(-1)", "except (mp.ProcessRaisedException, mp.ProcessExitedException)")))
def tolerate_torn_error_files(pcontext) -> None:
    """A worker that raises writes its traceback to its error file; killed in the middle of that write (the hang
    watchdog's SIGKILL racing a collective that failed when a peer died), it leaves the file empty or torn, and
    torch's ``ProcessContext.join`` then dies in ``pickle.load`` (``EOFError``), which takes the whole launcher down
    instead of reporting a failed worker. Wraps the join of ``pcontext``'s process context (elastic's
    ``MultiprocessContext``; a no-op for other contexts and once installed) so that an unreadable error file reads
    as what it is: the worker's death by its exit code or signal, the ``ProcessExitedException`` elastic handles."""
    import pickle
    import signal

    from torch.multiprocessing.spawn import ProcessExitedException

    pc = getattr(pcontext, "_pc", None)
    join = getattr(pc, "join", None)
    if join is None or getattr(join, "tolerates_torn_error_files", False):
        return

    def torn(path) -> bool:
        try:
            with open(path, "rb") as fh:
                pickle.load(fh)
        except FileNotFoundError:
            return False
        except Exception:  # noqa: BLE001 - EOFError, UnpicklingError and friends: what join itself could not read
            return True
        return False

    def tolerant_join(timeout=None, grace_period=None):
        try:
            return join(timeout, grace_period)
        except (EOFError, pickle.UnpicklingError, ValueError, TypeError):
            index = next((i for i, path in enumerate(pc.error_files) if path and torn(path)), None)
            if index is None:
                raise
            process = pc.processes[index]
            code = process.exitcode if process.exitcode is not None else 1
            name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else None
            how = f"signal {name}" if name else f"exit code {code:d}"
            raise ProcessExitedException(
                f"process {index:d} terminated with {how} while writing its error file", error_index=index,
                error_pid=process.pid, exit_code=code, signal_name=name) from None

    tolerant_join.tolerates_torn_error_files = True
    _rebind(pc, "join", tolerant_join)


ELASTIC_AGENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "_monitor_workers": ("self", "worker_group"),
    "_restart_workers": ("self", "worker_group"),
    "_rendezvous": ("self", "worker_group"),
    "_shutdown": ("self", "death_sig"),
}
"""Private ``LocalElasticAgent``/``SimpleElasticAgent`` methods ``launch.agent.InPlaceAgent`` overrides (declared with
:func:`overrides`): recording failures, refusing restarts that cannot help, skipping torch's rendezvous
round for the same gang, and ending what stopped workers left running need them; torchrun's agent has no hooks."""


_declare(
    "ELASTIC_AGENT_OVERRIDES", "Private elastic-agent methods launch.agent.InPlaceAgent overrides (declared with "
    "compat.overrides; torchrun's agent has no hooks).",
    *(Upstream(f"{_AGENT}.{name}", params=params) for name, params in ELASTIC_AGENT_OVERRIDES.items()),
    Upstream("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
             params=ELASTIC_AGENT_OVERRIDES["_monitor_workers"]),
    Upstream(f"{_AGENT}._invoke_run", contains=("self._monitor_workers(self._worker_group)",
                                                "self._restart_workers(self._worker_group)")),
    Upstream(f"{_AGENT}._initialize_workers", contains=("self._rendezvous(worker_group)",)),
    Upstream("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._shutdown",
             params=ELASTIC_AGENT_OVERRIDES["_shutdown"], contains=("self._pcontext.close(death_sig)",)),
    Upstream("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._stop_workers",
             contains=("self._shutdown()",)),
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


# ====================================================================== local checkpoint writes (kubetitan_trainer.storage)
LOCAL_WRITER_THREADS = 1
"""Writer threads of the DCP writer a save to a local folder or a mounted volume (claim, hostPath) gets: torchtitan's
non-HF ``dcp_save`` passes no writer, and DCP builds ``FileSystemWriter(checkpoint_id)`` with its default thread count,
one. One thread is what keeps a failed write a failed save there: ``_FileSystemWriter._write_data`` runs the other
``thread_count - 1`` on bare threads, whose exception is printed and dropped, and the save then writes ``.metadata``
over a missing or short file (the S3 writer, with 4 threads, is fixed by ``compat._raise_stream_errors``). On the
calling thread a failed write raises: DCP fails the save on every rank, no ``.metadata`` is written, and
``storage.SaveBudget`` counts it (``tests/trainer/test_local_save_errors.py``)."""


_declare(
    "LOCAL_WRITER_THREADS", "A local or volume save's DCP writer has one thread (DCP's default when torchtitan passes no "
    "writer), so a failed write fails the save; extra writer threads would drop it.",
    Upstream("torch.distributed.checkpoint._storage_utils:_storage_setup", contains=("storage = target(checkpoint_id)",)),
    Upstream("torch.distributed.checkpoint.filesystem:FileSystemWriter.__init__",
             contains=("thread_count: int = 1,", "thread_count=thread_count,")),
    Upstream("torch.distributed.checkpoint.filesystem:_FileSystemWriter._write_data",
             contains=("for _ in range(1, self.thread_count):", "target=_write_files_from_queue")),
    Upstream("torchtitan.components.checkpoint:CheckpointManager.dcp_save",
             contains=("storage_writer: HuggingFaceStorageWriter | None = None", "storage_writer=storage_writer,")),
)


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


@_shim(Upstream("torch._inductor.config:dynamic_scale_rblock"),
       Upstream("torch._inductor.codegen.triton:TritonKernel.inductor_meta_common", contains=('"dynamic_scale_rblock"',)),
       Upstream("torch._inductor.runtime.triton_heuristics:CachingAutotuner._dynamic_scale_rblock",
                contains=('inductor_meta.get("dynamic_scale_rblock", True)',)),
       Upstream("torch._inductor.runtime.triton_heuristics:check_autotune_cache", contains=("len(configs) > 1",)))
def fix_reduction_blocks(env: Mapping[str, str] | None = None) -> None:
    """Compile reductions with the block size their heuristics chose, without a second, smaller one added when a
    process loads the kernel; left to torch when ``TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK`` is set in ``env`` (the
    process's environment by default: a user's explicit choice).

    torch 2.11 gives a register-heavy reduction (the recipe's FP8 amax reductions in its blocks, a backward fused
    with SiLU) one configuration at compile time. When a process loads the kernel, ``_dynamic_scale_rblock`` adds a
    configuration with half the reduction block (for occupancy), compiles it and benchmarks both on the first call.
    Inductor keeps its choice in a ``.best_config`` file only for kernels compiled with several configurations
    (``check_autotune_cache``), so every new process does it again: 1.12-1.23 s of each warm restart's first step with
    the H100 recipe (docs/reliability.md). There the compiled block won or tied: 2048 against 1024 for the two
    costliest kernels in every process (0.44 against 0.50 ms), within 0.5-14 % either way for the amax reductions.
    ``torch._inductor.config.dynamic_scale_rblock`` (read at code generation into each kernel's ``inductor_meta``)
    turns the addition off for every reduction compiled after this call, in this process: the blocks, the head,
    the loss. The block, and so the order of each sum, is then the same in every process."""
    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK" not in (os.environ if env is None else env):
        inductor_config.dynamic_scale_rblock = False


@_shim(Upstream("torch._inductor.config:dynamic_scale_rblock"))
def inductor_key() -> str:
    """The Inductor settings kubetitan may change that generated kernels carry (:func:`fix_reduction_blocks`): part
    of an AOT artefact's name, so a kernel compiled under other settings is never loaded as if it were the same."""
    import torch._inductor.config as inductor_config

    return f"dynamic_scale_rblock={inductor_config.dynamic_scale_rblock}"


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


@_shim(Upstream("torch.nn.modules.module:Module._call_impl", contains=("self.forward",)))
def set_forward(module: Any, forward: Callable) -> None:
    """Make ``forward`` what ``module``'s ``__call__`` runs (an instance attribute: ``Module._call_impl`` calls
    ``self.forward`` between the module's hooks, FSDP's included), leaving its parameters and names as they are."""
    _rebind(module, "forward", forward)


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
