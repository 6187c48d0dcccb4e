"""Correct twins of planted bugs: the same mechanisms, used right (these pairs must pass)."""

from __future__ import annotations

import types

from torch import nn
from torch.distributed.tensor import Partial

from convergence.trainer.hooks import HookContext
from detection_bugs.tensor_parallel import _local_norm_forward, _sp_norms


def norm_on_local_shard(model: nn.Module, ctx: HookContext) -> None:
    """TP + SP norm computed on the local shard with ``weight.to_local(grad_placements=
    [Partial()])``: the local weight gradient is declared a partial sum, so DTensor sums it
    over the TP ranks -- the fix of tensor_parallel.norm_grad_not_synced."""
    for norm in _sp_norms(model, ctx):
        norm.forward = types.MethodType(_local_norm_forward([Partial()]), norm)  # type: ignore[method-assign]


def noop(model: nn.Module, ctx: HookContext) -> None:
    """Changes nothing: the hook machinery itself must not move a verdict."""
    return None
