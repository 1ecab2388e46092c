"""Held-out evaluation: torchtitan 0.2.2's ``Validator`` (its loop, loss and all-reduce) on kubetitan's held-out data.

torchtitan's ``Validator.__init__`` builds its data with ``build_text_validation_dataloader`` (its fixed dataset
registry); :class:`KubetitanValidator` sets the same attributes with :func:`kubetitan_trainer.data.loaders.build_eval_loader`
instead (``compat.init_validator``) and inherits ``validate`` and ``should_validate`` (step 1 and every
``[validation] freq`` steps). The loader is finite and equal on every rank, so ``[validation] steps = -1`` (the
whole held-out set) cannot hang. The loss reaches ``MetricsProcessor.log_validation``, which kubetitan's processor
exports as ``kubetitan_trainer_eval_loss`` and ``kubetitan_trainer_eval_perplexity``.
"""

from __future__ import annotations

import time

from torchtitan.components.validate import Validator

from kubetitan_trainer import compat
from kubetitan_trainer.data.loaders import build_eval_loader


class KubetitanValidator(Validator):
    """torchtitan's Validator over :func:`~kubetitan_trainer.data.loaders.build_eval_loader`'s held-out samples."""

    def __init__(self, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None, pp_has_first_stage=None,
                 pp_has_last_stage=None) -> None:
        compat.init_validator(
            self, job_config=job_config, tokenizer=tokenizer, parallel_dims=parallel_dims, loss_fn=loss_fn,
            validation_dataloader=build_eval_loader(job_config, dp_world_size, dp_rank),
            validation_context=validation_context, maybe_enable_amp=maybe_enable_amp,
            metrics_processor=metrics_processor, pp_schedule=pp_schedule, pp_has_first_stage=pp_has_first_stage,
            pp_has_last_stage=pp_has_last_stage)

    def validate(self, model_parts, step: int) -> None:
        # torchtitan's loop adds the held-out tokens to the training throughput's counter and its time falls in the
        # training log interval: both are taken out again, so tokens/s and MFU stay training's own.
        mp = self.metrics_processor
        tokens, begin = mp.ntokens_since_last_log, time.perf_counter()
        super().validate(model_parts, step)
        mp.ntokens_since_last_log = tokens
        mp.time_last_log += time.perf_counter() - begin


def build_validator(job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                    validation_context, maybe_enable_amp, metrics_processor=None, pp_schedule=None,
                    pp_has_first_stage=None, pp_has_last_stage=None) -> KubetitanValidator:
    """TrainSpec ``build_validator_fn``."""
    return KubetitanValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                              maybe_enable_amp, metrics_processor, pp_schedule, pp_has_first_stage, pp_has_last_stage)
