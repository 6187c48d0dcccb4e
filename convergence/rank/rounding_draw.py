"""Another machine's rounding, on this machine: ``CONVERGENCE_ROUNDING_DRAW=N``.

Why: bf16 (and any reduction order) rounds differently on each CPU and GPU. A test whose
outcome depends on rounding -- a step window, a bf16 verdict, a tolerance share -- passes or
fails by that machine's draw, so a test tuned on one machine fails on the next (issue 46: a
first divergent step of 13 on an Intel Xeon where an AMD EPYC gave 9-12). To find such a test
*here*, the suite runs its rounding-sensitive tests again under other draws.

What a draw is: with ``N > 0`` the output of every linear layer of every job is multiplied by
``1 + u * a``, ``a`` the unit roundoff of the output's dtype, and rounded back to it. ``u`` in
[-1, 1) is a hash of the output value's own bits and of ``N`` -- not a random stream -- so a
draw is a *deterministic function of the numbers*, as another machine's kernels are: two jobs
that computed bitwise-equal values before still do (a cached control stays valid, a bitwise
assertion between layouts with the same forward still holds), while every value that rounds
on the edge lands on another side of it, differently for each ``N``. Unlike the forward-noise
twin (trainer/forward_noise.py: one job that rounds as TP2 does, on purpose) every job of the
session gets the same function, so control, twins and test alike are "another machine".

Under tensor parallelism an output may be a DTensor (a shard or a partial sum): its local
part is perturbed, as another machine rounds each rank's partial products.

``N = 0`` or unset is the machine's own rounding (nothing registered). The run cache keys the
variable (cache/stack.py NUMERICS_ENV): a control from another draw is never reused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

#: The environment variable that selects a draw (an integer >= 0; 0 or unset: none).
ROUNDING_DRAW_ENV = "CONVERGENCE_ROUNDING_DRAW"

#: The dtypes a draw perturbs, each by its unit roundoff (half its machine epsilon: 2**-24 for
#: float32, 2**-8 for bfloat16, 2**-11 for float16, 2**-53 for float64, the values of the
#: forward-noise twin's table, trainer/forward_noise.py, which this package sits below). Any
#: other dtype (float8, integers) is left as is.
_PERTURBED = frozenset({"float16", "bfloat16", "float32", "float64"})

# Two odd 32-bit constants (Knuth's multiplicative hash and a second large odd number): the
# product of a value's bits with the first, offset by the draw times the second, scatters
# neighbouring values over the whole range; bits 8..23 of it are the uniform draw.
_MIX = 2654435761 - 2**32  # as a signed int32
_DRAW_OFFSET = 40503 * 65537


class RoundingDrawError(ValueError):
    """The variable holds something other than a non-negative integer."""


def rounding_draw(environ: Mapping[str, str] | None = None) -> int:
    """The draw the environment selects (0: the machine's own)."""
    env = os.environ if environ is None else environ
    text = env.get(ROUNDING_DRAW_ENV, "").strip()
    if not text:
        return 0
    try:
        draw = int(text)
    except ValueError:
        draw = -1
    if draw < 0:
        raise RoundingDrawError(
            f"{ROUNDING_DRAW_ENV}={text!r} is not a draw: set it to a non-negative integer "
            f"(0 or unset: this machine's own rounding; 1, 2, ...: another draw)"
        )
    return draw


def _perturb_values(values: Any, draw: int) -> Any:
    """``values`` (a plain tensor) times ``1 + u * a`` rounded back to its dtype, ``u`` from a
    hash of each value's bits and ``draw``."""
    import torch

    if str(values.dtype).removeprefix("torch.") not in _PERTURBED or values.numel() == 0:
        return values
    unit = torch.finfo(values.dtype).eps / 2  # a power of two: exactly the table's value
    wide = values.detach().float()
    bits = wide.view(torch.int32)
    mixed = bits * _MIX + (draw * _DRAW_OFFSET) % 2**31
    u = ((mixed >> 8) & 0xFFFF).float() / 32768.0 - 1.0
    return (values.float() * (1.0 + unit * u)).to(values.dtype)


def perturb_output(output: Any, draw: int) -> Any:
    """One linear layer's output under ``draw`` (a tensor or a DTensor; anything else as is)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        local = _perturb_values(output.to_local(), draw)
        return DTensor.from_local(
            local,
            output.device_mesh,
            output.placements,
            run_check=False,
            shape=output.shape,
            stride=output.stride(),
        )
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return _perturb_values(output, draw)
    return output


def apply_rounding_draw(modules: Iterable[Any], draw: int) -> int:
    """Register ``draw`` on every ``nn.Linear`` under ``modules``; returns how many (0 when
    ``draw`` is 0). torch is imported here: collection reads the variable without torch."""
    if draw == 0:
        return 0
    from torch import nn

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        return perturb_output(output, draw)

    count = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(hook)
                count += 1
    return count
