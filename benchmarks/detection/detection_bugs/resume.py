"""Resume bugs: a training checkpoint that loses one piece of state at the resume.

Each hook replaces one restore function of convergence/trainer/resume.py on every rank (the
hook is imported and called before the checkpoint is loaded; the job up to the checkpoint
never calls them), so the checkpoint itself is right and the *loader* is wrong -- where such
bugs live in real trainers. Use them on a test side with ``resume = { at_step = K, ... }``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from convergence.trainer import resume
from convergence.trainer.hooks import HookContext


def optimizer_state_dropped(model: nn.Module, ctx: HookContext) -> None:
    """The optimizer is rebuilt empty at the resume (its state dict never loaded).

    Real bug: a resume that loads only the model's state dict, or an optimizer state dict
    keyed by parameter ids of the old layout and silently matched to nothing. Step K+1 is
    Adam's first step again (bias correction of step 1: an update of lr in the sign of each
    gradient) instead of a step with K steps of moments; its loss is still right (computed
    before the update), the next one is not: first divergent step K+2.
    """

    def restore_optimizer(
        named_params: Sequence[tuple[str, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        loaded: dict[str, Any],
    ) -> None:
        return None

    resume.restore_optimizer = restore_optimizer


def scheduler_restarted(model: nn.Module, ctx: HookContext) -> None:
    """The LR scheduler starts again at step 0 at the resume (its state not restored).

    Real bug: a fresh LambdaLR whose last_epoch is not loaded: warmup again from lr ~ 0. The
    loss of step K+1 is right, its update is far too small: first divergent step K+2 (the lr
    itself differs from K+1).
    """

    def restore_lr_step(state: resume.TrainState) -> int:
        return 0

    resume.restore_lr_step = restore_lr_step


def data_restarted(model: nn.Module, ctx: HookContext) -> None:
    """The data loader starts again at sample 0 at the resume (its position not restored).

    Real bug: a stateless sampler rebuilt at the resume, so the run sees its first samples
    twice. Step K+1 reads step 1's samples: the data fingerprint differs exactly there.
    """

    def restore_data_position(state: resume.TrainState) -> int:
        return 0

    resume.restore_data_position = restore_data_position


def rng_reset(model: nn.Module, ctx: HookContext) -> None:
    """The generators are reseeded at the resume instead of restored.

    Real bug: ``torch.manual_seed(seed)`` at start-up and no RNG state in the checkpoint. In
    the built-in trainer nothing draws from the generators after the initialisation (no
    dropout; samples are addressed by index, data.py), so this one changes no number: it is
    in the catalogue to say so, not to be caught.
    """
    seed = ctx.config.training.seed

    def restore_rng(loaded: dict[str, torch.Tensor], device: torch.device) -> None:
        torch.manual_seed(seed)

    resume.restore_rng = restore_rng
