"""Helpers shared by the planted bugs: a gradient scale on the logits, rank coordinates."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from convergence.trainer.hooks import HookContext


def scale_backward_at_logits(model: nn.Module, factor: float) -> None:
    """Every parameter gradient of this rank times ``factor``, the loss value untouched.

    The logits' gradient is scaled: backward is linear, so every gradient upstream of the
    logits (all of them; with PP the other stages receive the scaled gradient through the
    pipeline's send/recv) is scaled by the same factor, as when the backward loss is scaled.
    Only the chunk that owns the output projection gets it (the last PP stage).
    """
    output = getattr(model, "output", None)
    if output is None:
        return

    def scaled(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        # A tensor hook, not a custom autograd.Function: the pipeline schedules run their
        # backward through torch.autograd.grad, which a new graph node here would upset.
        if out.requires_grad:
            out.register_hook(lambda grad: grad * factor)

    output.register_forward_hook(scaled)


def data_parallel_rank_and_size(ctx: HookContext) -> tuple[int, int]:
    """(this rank's index among the dp_replicate x dp_shard ranks, their number)."""
    par = ctx.config.parallelism
    if ctx.mesh is None:
        return 0, 1
    coordinate = ctx.mesh.get_coordinate()
    assert coordinate is not None
    names = list(ctx.mesh.mesh_dim_names or ())
    replicate = coordinate[names.index("dp_replicate")]
    shard = coordinate[names.index("dp_shard")]
    return replicate * par.dp_shard + shard, par.dp_replicate * par.dp_shard
