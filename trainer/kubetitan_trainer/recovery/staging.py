"""A checkpoint-staging shim: a DCP stager that can stage more than once (torch 2.11.0).

torch 2.11.0's ``DefaultStager._stage`` closes its ``StateDictStager`` after every stage (pytorch
issue 183413, a regression from the leak fix in PR 170431; fixed upstream by PR 183424, after 2.11.0).
``close`` empties the stager's deepcopy dispatch table, so the *second* stage fails in the background
with ``KeyError: <class 'type'>``. torchtitan 0.2.2 creates one ``DefaultStager`` for
``async_mode = "async_with_pinned_mem"`` and keeps it for the run, so every pinned save after the first
fails and the run dies at the save after that (torchtitan issue 3476). Seen on the H200
(bench/device/launch_overhead_1b_and_pinned_stall.sh, recipe_pinned_checkpoint_stall.sh), and gone with this module
(reusable_stager_pinned_saves.sh; docs/benchmarks.md, "Checkpoint stall").

:class:`ReusableStager` is a ``DefaultStager`` whose ``StateDictStager`` ignores that per-stage
``close`` and is released by the stager's own ``close`` (torchtitan calls it when the checkpointer
closes), which is what the upstream fix does. It also keeps the pinned host buffers across saves, as
the DCP staging design intends: they are allocated and registered once, at the first save.
With the restore tier's folder (in-place restarts), the staged copy lives in the staging arena
(:mod:`kubetitan_trainer.recovery.arena`): files that outlive the worker, so that a worker's
death frees none of those pages and the next generation's first save finds them there; the restore tier then
points into it. Remove the per-stage ``close`` workaround when the pinned torch has the fix (the canary test in
``tests/trainer/test_units.py`` fails then). The torch internals it touches are in :mod:`kubetitan_trainer.compat`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torchtitan.components.checkpoint import AsyncMode

from kubetitan_trainer import compat
from kubetitan_trainer.recovery import arena as arena_mod
from kubetitan_trainer.recovery import restore_tier

log = logging.getLogger("kubetitan.staging")

# torchtitan 0.2.2's options for async_with_pinned_mem: pinned, shared, async staging, non-blocking copy.
PINNED_STAGING = StagingOptions(True, True, True, True)


@compat.overrides(*compat.STATE_DICT_STAGER_OVERRIDES)
class _KeepOpenStateDictStager(compat.state_dict_stager_class()):
    arena: arena_mod.Arena | None = None
    """Where new staged storages go (kubetitan_trainer.recovery.arena); None: torch's one shared, pinned storage each."""

    def close(self) -> None:
        """Called by torch 2.11's ``DefaultStager._stage`` after every stage: keep the dispatch and cache."""

    def release(self) -> None:
        super().close()

    def _stage_untyped_storage(self, storage: torch.UntypedStorage, non_blocking: bool = False):
        """torch's, except that a storage staged for the first time gets its copy from the arena (a file of the
        tier's folder, registered with CUDA when torch would pin), cached as torch caches its own. In the arena's
        ``pwrite`` mode every stage writes the file (:meth:`kubetitan_trainer.recovery.arena.Arena.write`), never the
        mapping."""
        cache = compat.staged_storage_cache(self)
        new = None
        if self.arena is not None and storage not in cache:
            new = self.arena.storage(storage.nbytes())
        if new is None:  # cached already, no arena, or the arena is full
            if self.arena is not None and self.arena.mode == "pwrite" and storage in cache \
                    and cache[storage].data_ptr() in self.arena.names:
                self.arena.write(cache[storage], storage)  # a later stage: into the file, not its mapping
                return cache[storage]
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        if self.arena.mode == "pwrite":
            self.arena.write(new, storage)
        else:
            new.copy_(storage, non_blocking=non_blocking)
        cache[storage] = new
        return new


class ReusableStager(DefaultStager):
    """A ``DefaultStager`` that stages any number of times; ``close`` releases its buffers."""

    def __init__(self, config: StagingOptions = PINNED_STAGING, arena_folder: str = "", rank: int = 0) -> None:
        super().__init__(config)
        compat.replace_state_dict_stager(self, _KeepOpenStateDictStager(
            pin_memory=config.use_pinned_memory, share_memory=config.use_shared_memory
        ))
        self.arena_folder, self.rank = arena_folder, rank
        """The restore tier's folder ("": no staging arena) and this rank (the arena file's name)."""
        self.arena: arena_mod.Arena | None = None
        self.last_staged: Any = None
        """The last stage's result (a Future of the staged copy, or the copy): the restore tier writes it."""
        self.before_stage: Any = None
        """Called before each stage: the restore tier's background write of the previous copy must end first,
        since the buffers are reused."""

    def stage(self, state_dict, **kwargs):
        if self.before_stage is not None:
            self.before_stage()
        if self.arena_folder:
            # The tier may point into the arena: without its JSON it is never used, so a stage cut off midway
            # leaves no torn tier behind.
            restore_tier.invalidate(self.arena_folder, self.rank)
            self._open_arena(state_dict)
        self.last_staged = super().stage(state_dict, **kwargs)
        return self.last_staged

    def _open_arena(self, state_dict) -> None:
        inner = compat.inner_state_dict_stager(self)
        if self.arena is not None:
            return
        self.arena = arena_mod.open_arena(self.arena_folder, self.rank, state_dict, pin=inner.pin_memory,
                                          pin_min_bytes=inner.pin_memory_min_bytes)
        if self.arena is None:
            self.arena_folder = ""  # no room: torch's staging from now on
            return
        log.info("Staging arena %s: %d storages, %.2f GiB", self.arena.folder, self.arena.count,
                 arena_mod.staged_bytes(state_dict) / 2**30)
        inner.arena = self.arena

    def close(self) -> None:
        super().close()
        compat.inner_state_dict_stager(self).release()
        if self.arena is not None:  # the file stays (the tier may point into it); the registration ends
            self.arena.close()


def ensure_reusable_stager(checkpointer: Any, config: StagingOptions = PINNED_STAGING, arena_folder: str = "",
                           rank: int = 0) -> None:
    """Give torchtitan's ``CheckpointManager`` a :class:`ReusableStager` before its first pinned save.

    torchtitan creates its stager lazily (``if self.stager is None``) in ``save``; setting it first
    makes torchtitan use this one. Call it on the main thread, right before a save (the stager creates
    its staging stream there, after the default stream is in use, as torch asks). ``arena_folder``: the restore
    tier's folder, where the staged copy goes (kubetitan_trainer.recovery.arena); "" stages as torch does."""
    if (compat.checkpoint_async_mode(checkpointer) == AsyncMode.ASYNC_WITH_PINNED_MEM
            and compat.checkpoint_stager(checkpointer) is None):
        compat.set_checkpoint_stager(checkpointer, ReusableStager(config, arena_folder, rank))
