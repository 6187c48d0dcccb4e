"""Gradients reduced wrongly: a rank's part dropped, summed instead of averaged, divided by the
wrong degree, not divided by the accumulation or microbatch count.

All of them leave the *logged* loss value correct at the first step (the forward is right) and
change the gradient. Adam's update is invariant to a uniform gradient scale (up to eps), and
clipping rescales every gradient by the same factor, so the pure scale bugs move the loss curve
by almost nothing: the grad norm is their witness.
"""

from __future__ import annotations

from torch import nn

from convergence.trainer.config_checks import pp_microbatches
from convergence.trainer.hooks import HookContext
from detection_bugs._common import data_parallel_rank_and_size, scale_backward_at_logits


def drop_one_dp_rank(model: nn.Module, ctx: HookContext) -> None:
    """A reduction that misses a rank: data-parallel rank 1's gradient never arrives.

    Real bug: a gradient all-reduce / reduce-scatter issued on a sub-group that does not
    contain every data-parallel rank (a wrong mesh dim, a stale process group after a
    re-shard), or a bucket that one rank skips, while the division still uses the full dp
    degree. Planted: rank 1 contributes a zero gradient, so the average is g0 / 2 instead of
    (g0 + g1) / 2 -- wrong direction and scale; the loss moves from step 2, the grad norm at
    step 1.
    """
    dp_rank, _ = data_parallel_rank_and_size(ctx)
    if dp_rank == 1:
        scale_backward_at_logits(model, 0.0)


def sum_instead_of_average(model: nn.Module, ctx: HookContext) -> None:
    """A reduction doubled: data-parallel gradients summed instead of averaged (x dp).

    Real bug: ``all_reduce(grad)`` (SUM, the default op) without the ``/ world_size``, or an
    extra all-reduce on gradients that DDP already averaged. Planted: every rank's gradient
    times the dp degree before the (averaging) reduction. Adam hides it: the loss curve is
    nearly unchanged; the grad norm is dp times too large.
    """
    _, dp = data_parallel_rank_and_size(ctx)
    scale_backward_at_logits(model, float(dp))


def divided_by_world_size(model: nn.Module, ctx: HookContext) -> None:
    """Gradient scaled by the wrong degree: divided by the world size instead of the dp degree.

    Real bug: ``loss / dist.get_world_size()`` or an average over the world group where only
    the data-parallel ranks hold different samples (the TP ranks of a group hold the same
    ones). Under dp x tp the gradient is 1/tp of what it should be. Adam hides it; the grad
    norm is tp times too small.
    """
    _, dp = data_parallel_rank_and_size(ctx)
    world = ctx.mesh.size() if ctx.mesh is not None else 1
    scale_backward_at_logits(model, dp / world)


def accumulation_not_divided(model: nn.Module, ctx: HookContext) -> None:
    """Gradient accumulation that forgets to divide: gradients summed over the microsteps.

    Real bug: ``loss.backward()`` per microstep on the micro-batch mean without the
    ``/ grad_accum_steps``, while the logged loss is averaged separately (so it looks right).
    Gradients are grad_accum_steps times too large: Adam hides it, the grad norm does not.
    """
    scale_backward_at_logits(model, float(ctx.config.training.grad_accum_steps))


def pp_microbatch_loss_summed(model: nn.Module, ctx: HookContext) -> None:
    """A pipeline's microbatch losses summed instead of averaged (gradients x microbatches).

    Real bug: ``PipelineSchedule(..., scale_grads=False)`` with a loss_fn that is not divided
    by n_microbatches (or the reverse: both scalings on). The last stage's loss backward is
    microbatches times too large, and through the pipeline every stage's gradients are too.
    The logged loss (a mean over microbatches) stays right; Adam hides the scale, the grad
    norm shows it.
    """
    scale_backward_at_logits(model, float(pp_microbatches(ctx.config)))
