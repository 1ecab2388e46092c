"""Held-out evaluation: torchtitan 0.2.2's ``Validator`` (its loop, loss and all-reduce) on kubetitan's held-out data.

torchtitan's ``Validator.__init__`` builds its data with ``build_text_validation_dataloader`` (its fixed dataset
registry); :class:`KubetitanValidator` sets the same attributes with :func:`kubetitan_trainer.data.loaders.build_eval_loader`
instead (``compat.init_validator``) and inherits ``validate`` and ``should_validate`` (step 1 and every
``[validation] freq`` steps). The loader is finite and equal on every rank, so ``[validation] steps = -1`` (the
whole held-out set) cannot hang. The loss reaches ``MetricsProcessor.log_validation``, which kubetitan's processor
exports as ``kubetitan_trainer_eval_loss`` and ``kubetitan_trainer_eval_perplexity``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

from torchtitan.components.validate import Validator

from torchtitan.tools import utils

from kubetitan_trainer import compat, source_loss
from kubetitan_trainer.data.loaders import SOURCE_KEY, build_eval_loader


class KubetitanValidator(Validator):
    """torchtitan's Validator over :func:`~kubetitan_trainer.data.loaders.build_eval_loader`'s held-out samples."""

    untimed: Callable[[], contextlib.AbstractContextManager] = staticmethod(contextlib.nullcontext)
    """The phase an evaluation runs in: the trainer's in-process restarter's ``untimed`` when it has one (an
    evaluation makes no step progress, and may take longer than the progress timeout)."""

    def __init__(self, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None, pp_has_first_stage=None,
                 pp_has_last_stage=None) -> None:
        compat.init_validator(
            self, job_config=job_config, tokenizer=tokenizer, parallel_dims=parallel_dims, loss_fn=loss_fn,
            validation_dataloader=build_eval_loader(job_config, dp_world_size, dp_rank),
            validation_context=validation_context, maybe_enable_amp=maybe_enable_amp,
            metrics_processor=metrics_processor, pp_schedule=pp_schedule, pp_has_first_stage=pp_has_first_stage,
            pp_has_last_stage=pp_has_last_stage)
        names = source_loss.source_names(self.validation_dataloader, parallel_dims)
        self.source_stats = source_loss.SourceStats(names) if names else None
        if self.source_stats is not None and hasattr(metrics_processor, "report_sources"):
            stats, group = self.source_stats, source_loss.loss_group(parallel_dims)
            metrics_processor.report_sources(held_out=functools.partial(stats.losses, group, utils.device_type))

    def post_dataloading_process(self, input_dict, labels, model_parts):
        """The loader's source tags go to the loss (per-source eval losses; the model never sees them)."""
        sources = input_dict.pop(SOURCE_KEY, None)
        if self.source_stats is not None and isinstance(self.loss_fn, source_loss.SourceLoss):
            self.loss_fn.tag(sources, self.source_stats if sources is not None else None)
        return super().post_dataloading_process(input_dict, labels, model_parts)

    def validate(self, model_parts, step: int) -> None:
        # torchtitan's loop adds the held-out tokens to the training throughput's counter and its time falls in the
        # training log interval: both are taken out again, so tokens/s and MFU stay training's own.
        mp = self.metrics_processor
        tokens, last, begin = mp.ntokens_since_last_log, mp.time_last_log, time.perf_counter()
        if self.source_stats is not None:
            self.source_stats.reset()
        with self.untimed():
            super().validate(model_parts, step)
        # torchtitan's log_validation restarted both counters: the interval goes on from where it was, without the
        # evaluation's time (adding that time to the restarted clock put it in the future: the next logged step's
        # tokens/s came out negative)
        mp.ntokens_since_last_log = tokens
        mp.time_last_log = last + (time.perf_counter() - begin)


def build_validator(job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                    validation_context, maybe_enable_amp, metrics_processor=None, pp_schedule=None,
                    pp_has_first_stage=None, pp_has_last_stage=None) -> KubetitanValidator:
    """TrainSpec ``build_validator_fn``."""
    return KubetitanValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                              maybe_enable_amp, metrics_processor, pp_schedule, pp_has_first_stage, pp_has_last_stage)
