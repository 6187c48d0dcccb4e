"""AdamW, the lr schedule, and clipping by the global gradient norm across every mesh (the
norms themselves, which the torchtitan launcher measures too: convergence/rank/norms.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

# Sharded, shard_groups and sharded_norms are re-exported: benchmarks/detection's planted
# clipping bug reads them as ``optim.X``, from before the norms moved to rank/norms.py.
from convergence.rank.norms import Sharded as Sharded
from convergence.rank.norms import grad_norms, local_pieces, parameter_part, update_norms
from convergence.rank.norms import shard_groups as shard_groups
from convergence.rank.norms import sharded_norms as sharded_norms
from convergence.trainer.config import TrainConfig


def build_optimizer(params: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    opt = cfg.optimizer
    # Weight decay on every parameter (as torchtitan does); AdamW is elementwise, so sharding
    # a parameter does not change its update -- one reason layouts can agree to fp32 noise.
    return torch.optim.AdamW(
        list(params),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup, then decay to min."""
    peak, sched = cfg.optimizer.lr, cfg.lr_scheduler
    warmup, total = sched.warmup_steps, cfg.training.steps
    if step <= warmup:
        return peak * step / warmup
    if sched.decay_type == "none" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / (total - warmup))
    if sched.decay_type == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (sched.min_lr_factor + (1.0 - sched.min_lr_factor) * factor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def model_parts(model: nn.Module) -> tuple[str, ...]:
    """Every part of the whole model (build it on the meta device): the same, ordered list on
    every rank, so the per-part norms reduce element by element whatever a rank holds."""
    return tuple(sorted({parameter_part(n) for n, _ in model.named_parameters()}))


@torch.no_grad()
def global_grad_norm(params: Iterable[nn.Parameter], pp_group: ProcessGroup | None) -> torch.Tensor:
    """L2 norm of the FULL gradient (see rank/norms.py grad_norms)."""
    total, _ = grad_norms([("", p) for p in params], (), pp_group)
    return total


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every (local shard of every) gradient by min(1, max_norm / (norm + 1e-6)).

    The same coefficient on every rank (the norm is global), as torch.nn.utils.clip_grad_norm_
    would compute on the unsharded model.
    """
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for param in params:
        if param.grad is None:
            continue
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        local.mul_(coef.to(device=local.device, dtype=local.dtype))


class StepNorms(NamedTuple):
    """What one optimizer step logs of its gradients and of the update it applied."""

    grad: torch.Tensor
    """The total norm of the accumulated gradient, before clipping."""
    grad_parts: torch.Tensor
    """The norm of each part's gradient (model_parts order), before clipping."""
    update: torch.Tensor
    """The total norm of the parameters' change in the step (what the optimizer applied)."""
    update_parts: torch.Tensor
    """The norm of each part's parameter change in the step."""


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    named_params: list[tuple[str, nn.Parameter]],
    parts: tuple[str, ...],
    pp_group: dist.ProcessGroup | None,
    max_norm: float,
) -> StepNorms:
    """Norms of the accumulated gradient, clip, step, zero; the norms of the step's update."""
    # Norm of the full gradient (all shards, all stages) and of each part of the model
    # (grad_norms: a bug in one kind of weight hides in the total), then clip.
    grad_norm, part_norms = grad_norms(named_params, parts, pp_group)
    if max_norm > 0:
        clip_grads_([p for _, p in named_params], max_norm, grad_norm)
    # The parameters before the step (one copy of this rank's shards), to measure the update.
    before = local_pieces(named_params)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update, update_parts = update_norms(named_params, before, parts, pp_group)
    return StepNorms(grad_norm, part_norms, update, update_parts)
