"""A checkpoint-staging shim: a DCP stager that can stage more than once (torch 2.11.0).

torch 2.11.0's ``DefaultStager._stage`` closes its ``StateDictStager`` after every stage (pytorch
issue 183413, a regression from the leak fix in PR 170431; fixed upstream by PR 183424, after 2.11.0).
``close`` empties the stager's deepcopy dispatch table, so the *second* stage fails in the background
with ``KeyError: <class 'type'>``. torchtitan 0.2.2 creates one ``DefaultStager`` for
``async_mode = "async_with_pinned_mem"`` and keeps it for the run, so every pinned save after the first
fails and the run dies at the save after that (torchtitan issue 3476). Seen on the H200 in device
calls 7 and 8, and gone with this module in call 9 (docs/benchmarks.md, "Checkpoint stall").

:class:`ReusableStager` is a ``DefaultStager`` whose ``StateDictStager`` ignores that per-stage
``close`` and is released by the stager's own ``close`` (torchtitan calls it when the checkpointer
closes), which is what the upstream fix does. It also keeps the pinned host buffers across saves, as
the DCP staging design intends: they are allocated and registered once, at the first save.
Remove this module when the pinned torch has the fix (the canary test in
``tests/trainer/test_units.py`` fails then). The torch internals it touches are in :mod:`kubetitan_trainer.compat`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torchtitan.components.checkpoint import AsyncMode

from kubetitan_trainer import compat

# torchtitan 0.2.2's options for async_with_pinned_mem: pinned, shared, async staging, non-blocking copy.
PINNED_STAGING = StagingOptions(True, True, True, True)


class _KeepOpenStateDictStager(compat.state_dict_stager_class()):
    def close(self) -> None:
        """Called by torch 2.11's ``DefaultStager._stage`` after every stage: keep the dispatch and cache."""

    def release(self) -> None:
        super().close()


class ReusableStager(DefaultStager):
    """A ``DefaultStager`` that stages any number of times; ``close`` releases its buffers."""

    def __init__(self, config: StagingOptions = PINNED_STAGING) -> None:
        super().__init__(config)
        compat.replace_state_dict_stager(self, _KeepOpenStateDictStager(
            pin_memory=config.use_pinned_memory, share_memory=config.use_shared_memory
        ))
        self.last_staged: Any = None
        """The last stage's result (a Future of the staged copy, or the copy): the restore tier writes it."""
        self.before_stage: Any = None
        """Called before each stage: the restore tier's background write of the previous copy must end first,
        since the buffers are reused."""

    def stage(self, state_dict, **kwargs):
        if self.before_stage is not None:
            self.before_stage()
        self.last_staged = super().stage(state_dict, **kwargs)
        return self.last_staged

    def close(self) -> None:
        super().close()
        compat.inner_state_dict_stager(self).release()


def ensure_reusable_stager(checkpointer: Any, config: StagingOptions = PINNED_STAGING) -> None:
    """Give torchtitan's ``CheckpointManager`` a :class:`ReusableStager` before its first pinned save.

    torchtitan creates its stager lazily (``if self.stager is None``) in ``save``; setting it first
    makes torchtitan use this one. Call it on the main thread, right before a save (the stager creates
    its staging stream there, after the default stream is in use, as torch asks)."""
    if (compat.checkpoint_async_mode(checkpointer) == AsyncMode.ASYNC_WITH_PINNED_MEM
            and compat.checkpoint_stager(checkpointer) is None):
        compat.set_checkpoint_stager(checkpointer, ReusableStager(config))
