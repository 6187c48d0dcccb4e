"""Clipping bugs: a rank computes the clipping coefficient from its LOCAL gradient norm.

Gradient clipping scales every gradient by min(1, max_norm / ||g||) with the norm of the FULL
gradient: every shard and every pipeline stage. A rank that leaves out the all-reduce of the
squared norm over its pipeline stages (or its tensor-parallel peers) sees a smaller norm, so
it clips less than the others, and by a coefficient of its own. Real bug: torchtitan's
``clip_grad_norm_`` with PP once summed the norm over the stage's own parameters only
(pytorch/torchtitan#800 is the family: "AdamW hides it").

Why the usual witnesses miss it: the logged gradient norm is measured before clipping (here:
the trainer's own float64 norm, which stays right), the loss of step s is computed before step
s's update, and Adam is invariant to a constant gradient scale -- a stage scaled by a steady
wrong coefficient gets nearly the same update. What moves is the update from step 2 on: the
wrong coefficient changes from step to step by a ratio the correct one does not, and Adam's
moments mix those steps. The planted bugs only bite when clipping is active (the gradient norm
above ``training.max_norm``): the cases run with a small max_norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from convergence.trainer import optim
from convergence.trainer.hooks import HookContext

_ORIGINAL_CLIP = optim.clip_grads_


def _install(local_norm: object) -> None:
    """Replace the trainer's clipping by one that ignores the global norm it is handed and
    clips with ``local_norm(params)`` instead (once per process: the hook runs per chunk)."""

    def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
        params = list(params)
        _ORIGINAL_CLIP(params, max_norm, local_norm(params))  # type: ignore[operator]

    optim.clip_grads_ = clip_grads_


def pp_stage_clips_with_local_norm(model: nn.Module, ctx: HookContext) -> None:
    """Each pipeline stage clips with the norm of its own parameters' gradients: the squared
    norm summed over the FSDP/TP shards but not over the pipeline stages."""
    if ctx.pp_size > 1:
        _install(lambda params: optim.global_grad_norm(params, None))


def tp_rank_clips_with_local_norm(model: nn.Module, ctx: HookContext) -> None:
    """Each tensor-parallel rank clips with the norm of its own TP shard: the squared norm of
    a TP-sharded gradient summed over every other mesh dim but not over the TP ranks (the
    replicated parameters, such as the norm weights, are counted once, as they should)."""
    if ctx.tp_mesh is None:
        return
    tp_ranks = sorted(dist.get_process_group_ranks(ctx.tp_mesh.get_group()))

    def without_tp(params: list[nn.Parameter]) -> torch.Tensor:
        pieces: list[optim.Sharded] = []
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            groups = optim.shard_groups(grad) if isinstance(grad, DTensor) else ()
            kept = tuple(g for g in groups if sorted(dist.get_process_group_ranks(g)) != tp_ranks)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            pieces.append(("", local, kept))
        total, _ = optim.sharded_norms(pieces, (), None)
        return total

    _install(without_tp)


def torchtitan_pp_stage_clips_with_local_norm(model: nn.Module, ctx: HookContext) -> None:
    """The same bug in torchtitan: its ``clip_grad_norm_`` called without ``pp_mesh``, so each
    pipeline stage's norm is its own stage's (the squared norm not all-reduced over PP) and the
    stage clips with it. The launcher's own float64 gradient norm (taken before, from every
    stage) stays right; torchtitan's returned norm and its update are the stage's."""
    if ctx.pp_size <= 1:
        return
    import torchtitan.distributed.utils as dist_utils

    current = dist_utils.clip_grad_norm_
    if getattr(current, "planted_local_pp", False):
        return  # once per process (the hook runs per model chunk)

    def clip_grad_norm_(parameters: object, *args: object, **kwargs: object) -> torch.Tensor:
        kwargs["pp_mesh"] = None  # BUG: the stage's own norm
        return current(parameters, *args, **kwargs)  # type: ignore[no-any-return]

    clip_grad_norm_.planted_local_pp = True  # type: ignore[attr-defined]
    dist_utils.clip_grad_norm_ = clip_grad_norm_
