"""Per-source losses of a mixture: each data source's training and held-out loss, from the forward pass that computes
the loss itself (docs/data.md, "Per-source losses, tokens and epochs").

The loader tags each sample with its source (``data.SOURCE_KEY``, only when there are two sources or more); the
trainer and the validator take the tag out of the input dict before the model sees it and hand it to
:class:`SourceLoss`, the TrainSpec's loss. With a tag, the loss is torchtitan's cross entropy computed per token
(``reduction="none"``) and summed per sample: the sum of those is the loss torchtitan trains on (to float rounding:
the order of the sum differs), and each sample's sum and valid-token count go to a :class:`SourceStats` by source. At
a logged step (an evaluation) the stats are summed over the data-parallel ranks (one all-reduce of ``2 x sources``
numbers) and each source's loss is its summed loss over its summed tokens. Without a tag (one source; pipeline or
tensor parallelism, where the loss is computed in pieces) it is torchtitan's loss unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger


def per_sample_cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's summed cross entropy (float32) and its number of valid (not ignored) label tokens."""
    per_token = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none",
                                ignore_index=IGNORE_INDEX)
    return per_token.view(labels.shape[0], -1).sum(1), (labels != IGNORE_INDEX).sum(1)


class SourceStats:
    """Loss sums and token counts by source since the last :meth:`reset` (a step, or an evaluation)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._acc: torch.Tensor | None = None

    def reset(self) -> None:
        self._acc = None

    def add(self, sources: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
        if self._acc is None:
            self._acc = torch.zeros(len(self.names), 2, dtype=torch.float64, device=sums.device)
        rows = torch.stack([sums.detach().double(), counts.double()], 1)
        self._acc.index_add_(0, sources.to(sums.device), rows)

    def losses(self, group: Any = None, device: Any = "cpu") -> dict[str, dict[str, float]]:
        """Per source: its mean loss over its tokens (absent when it had none) and its token count, summed over the
        ranks of ``group`` (None: this process only). Every rank of the group must call it."""
        acc = self._acc if self._acc is not None else torch.zeros(len(self.names), 2, dtype=torch.float64, device=device)
        if group is not None:
            acc = acc.clone()
            dist.all_reduce(acc, group=group)
        out: dict[str, dict[str, float]] = {}
        for name, (loss, tokens) in zip(self.names, acc.tolist()):
            out[name] = {"loss_tokens": int(tokens)}
            if tokens > 0 and math.isfinite(loss):
                out[name]["loss"] = loss / tokens
        return out


class SourceLoss:
    """The TrainSpec's loss: torchtitan's cross entropy, per sample when the batch's sources are set (:meth:`tag`)."""

    def __init__(self, job_config: JobConfig, **kwargs: Any) -> None:
        self.plain = build_cross_entropy_loss(job_config, **kwargs)
        self.per_sample = per_sample_cross_entropy
        if job_config.compile.enable and "loss" in job_config.compile.components:
            self.per_sample = torch.compile(per_sample_cross_entropy, backend=job_config.compile.backend)
        self._sources: torch.Tensor | None = None
        self._sink: SourceStats | None = None
        self._head: Any = None

    def bind_head(self, head: Any) -> None:
        """Under ``precision.lossChunks`` (:mod:`kubetitan_trainer.chunked_loss`): ``pred`` is then the final norm's
        output, and ``head`` (a ``ChunkedHead``) projects it and computes the loss in chunks."""
        self._head = head

    def tag(self, sources: torch.Tensor | None, sink: SourceStats | None) -> None:
        """The sources of the next batch's samples and where their losses go (both None: the plain loss)."""
        self._sources, self._sink = sources, sink

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        sources, sink = self._sources, self._sink
        self._sources = None
        if self._head is not None:
            total, per_token = self._head.per_token(pred, labels)
            if sources is not None and sink is not None:
                sink.add(sources, per_token.view(labels.shape[0], -1).sum(1), (labels != IGNORE_INDEX).sum(1))
            return total
        if sources is None or sink is None:
            return self.plain(pred, labels)
        sums, counts = self.per_sample(pred, labels)
        sink.add(sources, sums, counts)
        return sums.sum()


def build_loss(job_config: JobConfig, **kwargs: Any) -> SourceLoss:
    """TrainSpec ``build_loss_fn``."""
    return SourceLoss(job_config, **kwargs)


def source_names(loader: Any, parallel_dims: Any) -> list[str]:
    """The names of the sources the loader tags (empty: no per-source losses: one source, or a loss computed in
    pieces, under pipeline or tensor parallelism)."""
    names = getattr(loader, "source_names", None)
    if names is None:
        stream = getattr(loader, "stream", None)
        names = [s.name for s in stream.sources] if stream is not None and getattr(loader, "tag_sources", False) else []
    if names and (parallel_dims.pp_enabled or parallel_dims.tp_enabled):
        logger.info("Per-source losses are off: the loss is computed in pieces under pipeline or tensor parallelism")
        return []
    return list(names)


def loss_group(parallel_dims: Any) -> Any:
    """The process group the per-source sums are reduced over: torchtitan's loss mesh (data parallel x context
    parallel), None without one."""
    if not parallel_dims.dp_cp_enabled:
        return None
    mesh = parallel_dims.get_optional_mesh("loss")
    return mesh.get_group() if mesh is not None else None
