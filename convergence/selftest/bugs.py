"""The planted bugs ``convergence selftest`` puts on a user's layout: parallelism hooks
(convergence/rank/hooks.py) that are wrong on purpose, each the smallest form of a bug
class that public reports show a loss curve can hide.

They run on the trainer's ranks (imported there by the hook path
``convergence.selftest.bugs:<name>``), on the built-in trainer and -- the ones that touch only
the logits' backward and the data-parallel mesh -- on torchtitan, through the same hook
mechanism. A bug that needs the built-in model's internals says so and stops the job (the
power table then shows it as not planted, never as "missed").
"""

from __future__ import annotations

from typing import Any

from torch import nn

from convergence.rank.hooks import HookContext
from convergence.trainer.config_checks import pp_microbatches


def _scale_logits_grad(model: nn.Module, factor: float) -> None:
    """Every gradient upstream of the logits (all of them; through PP's send/recv the other
    stages' too) times ``factor``, the loss value untouched. A tensor hook, not an autograd
    Function: the pipeline schedules run backward through torch.autograd.grad."""
    # The built-in model's output projection is ``output``, torchtitan 0.3's ``lm_head``.
    output = getattr(model, "output", None) or getattr(model, "lm_head", None)
    if output is None:
        return

    def scaled(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if getattr(out, "requires_grad", False):
            out.register_hook(lambda grad: grad * factor)

    output.register_forward_hook(scaled)


def gradient_doubled(model: nn.Module, ctx: HookContext) -> None:
    """A gradient reduced with the wrong degree: every gradient 2x (a SUM where a mean was
    meant; EP gradients 2x with identical loss curves, pytorch/pytorch#160285). Adam hides it
    in the loss; the grad norm shows it at step 1."""
    _scale_logits_grad(model, 2.0)


def dp_rank_dropped(model: nn.Module, ctx: HookContext) -> None:
    """A reduction that misses a rank: data-parallel rank 1's gradient never arrives (a
    collective on the wrong sub-group). The average is g0/2 instead of (g0 + g1)/2."""
    mesh = ctx.dp_mesh
    if mesh is None:
        return
    if mesh.ndim == 1:
        rank = mesh.get_local_rank()
    else:  # HSDP: (replicate, shard) -> one index
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        rank = coordinate[0] * mesh.size(1) + coordinate[1]
    if rank == 1:
        _scale_logits_grad(model, 0.0)


def cp_rope_without_offset(model: nn.Module, ctx: HookContext) -> None:
    """Context parallelism's rotary positions restart at 0 on every sequence shard (the
    shard's offset dropped): a wrong attention pattern, visible in the loss."""
    if ctx.config.parallelism.cp == 1:
        return
    if not hasattr(model, "position_offset"):
        raise RuntimeError(
            "selftest bug cp_rope_without_offset plants only on the built-in trainer's model "
            "(it has no position_offset here)"
        )

    def before_forward(module: nn.Module, args: Any) -> None:
        module.position_offset = 0  # type: ignore[assignment]  # BUG: r*L offset dropped

    model.register_forward_pre_hook(before_forward)


def pp_microbatch_loss_summed(model: nn.Module, ctx: HookContext) -> None:
    """A pipeline's microbatch losses summed instead of averaged: gradients x microbatches
    (the logged mean loss stays right)."""
    _scale_logits_grad(model, float(pp_microbatches(ctx.config)))
