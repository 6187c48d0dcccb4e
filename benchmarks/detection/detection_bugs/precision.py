"""Planted float8 bugs: each is wrong the way a real low-precision bug is (docs/precision.md).

Applied as hooks on a test side that also sets ``techniques = { float8 = ... }``; they patch
torchao inside the trainer's ranks (each job's ranks are fresh processes, so a patch never
leaks into another job).
"""

from __future__ import annotations

import torch
from torch import nn

from convergence.trainer.hooks import HookContext

#: How much smaller than the true amax the planted amax is: the amax of one of 4 shards of a
#: tensor whose largest values sit in another shard.
LOCAL_AMAX_SHRINK = 4.0


def local_amax_scale(model: nn.Module, ctx: HookContext) -> None:
    """The amax of a sharded tensor taken from the local shard only (where the recipe needs
    the global one): every float8 scale is computed from an amax LOCAL_AMAX_SHRINK times too
    small, so the scale is that much too large and every value above amax / LOCAL_AMAX_SHRINK
    saturates at the format's maximum (to_fp8_saturated) -- the largest activations, weights
    and gradients of every converted matmul are clipped, silently."""
    from torchao.float8 import float8_utils

    true_amax_to_scale = float8_utils.amax_to_scale

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def local_only(amax: torch.Tensor, float8_dtype: torch.dtype, **kwargs: object) -> torch.Tensor:
        return true_amax_to_scale(amax / LOCAL_AMAX_SHRINK, float8_dtype, **kwargs)  # type: ignore[arg-type]

    # tensor_to_scale looks the function up in its module at each call.
    float8_utils.amax_to_scale = local_only
