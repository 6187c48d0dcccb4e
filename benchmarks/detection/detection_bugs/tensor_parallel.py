"""Tensor-parallel bugs: a norm weight whose gradient is not synchronised over the TP ranks,
one that is reduced twice, and a row-wise matmul whose partial sums are never all-reduced.

Under sequence parallelism the norms run on each TP rank's shard of the sequence: a norm
weight's gradient on one rank is a *partial* sum (its own tokens only) and must be summed over
the TP ranks. DTensor does that when the weight is used as a Replicate DTensor; a hand-written
norm that computes on ``weight.to_local()`` silently drops it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from convergence.trainer.hooks import HookContext
from convergence.trainer.model import RMSNorm
from convergence.trainer.parallelize import tp_plan


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _local_norm_forward(grad_placements: Any) -> Any:
    """A norm forward that computes on the local sequence shard and the local weight.

    ``grad_placements`` is what ``weight.to_local`` declares its local gradient to be: None
    means "like the weight" (Replicate: the gradient is taken as complete -- the bug);
    ``[Partial()]`` says it is a partial sum, so DTensor all-reduces it (correct).
    """

    def forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(x, DTensor) or not isinstance(weight, DTensor):
            return RMSNorm.forward(self, x)
        local = x.to_local()  # activations: Shard(1) both ways, correct
        w = weight.to_local(grad_placements=grad_placements)
        out = _rms(local, self.eps).type_as(local) * w
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

    return forward


def _sp_norms(model: nn.Module, ctx: HookContext) -> list[RMSNorm]:
    if ctx.tp_mesh is None or not ctx.config.parallelism.sequence_parallel:
        return []  # without SP a norm sees the whole sequence on every TP rank: no partial sums
    return [m for m in model.modules() if isinstance(m, RMSNorm)]


def norm_grad_not_synced(model: nn.Module, ctx: HookContext) -> None:
    """TP + sequence parallel: the norm weights' gradients stay local partial sums.

    Real bug (the classic one): a fused/hand-written RMSNorm under SP that takes
    ``weight.to_local()`` without ``grad_placements=[Partial()]``. Each TP rank's norm weight
    gradient covers only its own tokens and is treated as the full (Replicate) gradient: it is
    never summed over TP. The TP ranks then apply different updates to a weight that should be
    identical, so they drift apart; the grad norm counts only one rank's partial gradient.
    """
    for norm in _sp_norms(model, ctx):
        norm.forward = types.MethodType(_local_norm_forward(None), norm)  # type: ignore[method-assign]


def norm_grad_reduced_twice(model: nn.Module, ctx: HookContext) -> None:
    """TP + sequence parallel: the norm weights' gradients all-reduced (summed) twice: x tp.

    Real bug: a manual ``all_reduce(norm.weight.grad, group=tp)`` added on top of the one
    DTensor already does (e.g. code ported from Megatron, where sequence-parallel norm grads
    are all-reduced by hand, onto DTensor where they are already complete). Only the norm
    weights are wrong, by a factor tp: under Adam the loss barely moves (a per-element scale
    is normalised away), and the grad norm moves by little -- a small signature.

    Planted in the forward (the gradient of a sharded FSDP parameter is written by the
    reduce-scatter, so a tensor hook on it would not run): the output gains
    ``(tp-1) * (extra - extra.detach())`` with ``extra`` the norm of the *detached* input, zero
    in value, whose backward adds tp-1 more copies of d(loss)/d(weight) and nothing to the input.
    """
    assert ctx.tp_mesh is not None or not _sp_norms(model, ctx)
    for norm in _sp_norms(model, ctx):
        copies = ctx.tp_mesh.size() - 1  # type: ignore[union-attr]

        def again(
            module: nn.Module, args: tuple[Any, ...], output: Any, copies: int = copies
        ) -> Any:
            x = args[0]
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and ctx.tp_mesh:
                x = DTensor.from_local(x, ctx.tp_mesh, output.placements, run_check=False)
            extra = RMSNorm.forward(module, x.detach())  # type: ignore[arg-type]
            return output + copies * (extra - extra.detach())

        norm.register_forward_hook(again)


class _RowwiseWithoutReduce(RowwiseParallel):
    """Row-wise linear whose Partial output is used as a local tensor, never reduced."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any
    ) -> Any:
        return outputs.to_local()


def rowwise_output_not_reduced(model: nn.Module, ctx: HookContext) -> None:
    """hook_mode = "replace_tp": the built-in plan, except that layer 1's attention output
    projection forgets the all-reduce of its row-wise matmul.

    Real bug: a row-parallel linear whose output is taken as a plain tensor (``to_local()`` on
    the Partial result, or a custom kernel) without the all-reduce: each TP rank continues with
    its own partial sum. Nothing crashes; from layer 1 on the numbers are wrong.
    """
    parallelize_with_layer1_wo(model, ctx, _RowwiseWithoutReduce())


def parallelize_with_layer1_wo(model: nn.Module, ctx: HookContext, wo_style: Any) -> None:
    """The built-in TP plan (hook_mode = "replace_tp"), with ``wo_style`` as layer 1's attention
    output projection (without sequence parallelism; with it the built-in plan stays)."""
    if ctx.tp_mesh is None:
        return
    sp = ctx.config.parallelism.sequence_parallel
    root, block_plan = tp_plan(model, sp)  # type: ignore[arg-type]
    model.hidden_seq_shards = ctx.tp_mesh.size() if sp else 1  # type: ignore[assignment]
    if root:
        parallelize_module(model, ctx.tp_mesh, root)  # type: ignore[arg-type]
    for name, block in model.layers.items():  # type: ignore[union-attr, operator]
        plan = dict(block_plan)
        if name == "1" and not sp:
            plan["attention.wo"] = wo_style
        parallelize_module(block, ctx.tp_mesh, plan)  # type: ignore[arg-type]
