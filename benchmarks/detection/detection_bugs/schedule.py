"""Optimizer-schedule bugs."""

from __future__ import annotations

from typing import Any

from torch import nn

from convergence.trainer import train as trainer_train
from convergence.trainer.hooks import HookContext

_ORIGINAL_LR_AT = trainer_train.lr_at


def lr_stepped_per_microbatch(model: nn.Module, ctx: HookContext) -> None:
    """The learning-rate scheduler stepped once per microbatch instead of once per optimizer
    step (with gradient accumulation).

    Real bug: ``scheduler.step()`` inside the accumulation loop. With A microsteps the
    schedule runs A times too fast: warmup ends after warmup/A optimizer steps and the decay
    reaches its floor early. The first step is right (the scheduler has not stepped yet); from
    step 2 the learning rate -- and then the loss -- differ.
    Planted: the trainer's ``lr_at(step)`` answers for scheduler position (step-1)*A + 1.
    """
    accum = ctx.config.training.grad_accum_steps

    def lr_at(step: int, cfg: Any) -> float:
        return _ORIGINAL_LR_AT((step - 1) * accum + 1, cfg)

    trainer_train.lr_at = lr_at
