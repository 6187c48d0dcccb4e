"""Rounding-level noise in the forward and backward pass, for the twin regime's
*forward-noise twin*.

Why: the DP noise twin (another FSDP degree) differs from its control only in the gradient
reduction; its forward pass is bit-identical. A tensor- or context-parallel test also rounds
its forward differently at every step (bf16 partial sums of every split matmul, attention
accumulated per sequence chunk). That is a larger perturbation per step, which the run's chaos
then grows at the same rate (BENCHMARKS.md, "Twin envelope on other models"), so an
envelope measured on the DP twin alone is too narrow for those layouts. The forward-noise twin
is the control itself, with the output of every linear layer that another layout re-rounds
(``RE_ROUNDED``) multiplied by ``1 + a * xi``,
``xi`` uniform in [-1, 1], fresh at each call from a seeded generator: a rounding-level change
of the forward at every step, the size of one re-rounding at the compute precision
(``a`` = the dtype's unit roundoff, chosen by the backend).

Tensor parallelism re-rounds the *backward* too: a column-wise linear's input gradient is a sum
over the sharded output dimension, computed per rank and all-reduced in bf16. The twin perturbs
the gradient flowing into the input of every such linear (``RE_ROUNDED_BACKWARD``) the same way,
through an identity autograd Function its forward pre-hook puts in front of the layer (a module
full-backward hook is not reliable under FSDP2's own hooks). Without it, a correct bf16 FSDP2+TP2
pair's one-step gradient gaps were 1-2.8x the twin's and it failed the anchored check in 3 of 6
pairs (BENCHMARKS.md, "tptwin").

Only plain tensors are perturbed (a DTensor under TP is left as it is: its shards already round
in their own order).
"""

from __future__ import annotations

from typing import Any

#: The linear layers whose outputs another layout re-rounds: the row-wise ones (attention
#: output ``wo``, FFN down ``w2``), where tensor parallelism sums bf16 partial products over
#: ranks and context parallelism feeds the attention it accumulated per sequence chunk. The
#: column-wise ones (wq/wk/wv, w1/w3) compute every output element whole in any layout; a
#: twin perturbing them too was 1.1-5x noisier than the layouts at the first steps and cost
#: power (BENCHMARKS.md, "Twin envelope on other models").
RE_ROUNDED = frozenset({"wo", "w2"})

#: The linear layers whose *input gradient* another layout re-rounds: the column-wise ones,
#: whose input gradient tensor parallelism sums over ranks (each rank's share of the output
#: dimension) in the backward.
RE_ROUNDED_BACKWARD = frozenset({"wq", "wk", "wv", "w1", "w3"})

#: Unit roundoff (half the spacing of the significand) per compute dtype: the amplitude the
#: built-in backend gives its forward-noise twin.
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}


def add_forward_noise(chunks: list[Any], amplitude: float, seed: int) -> int:
    """Register the perturbations on the ``RE_ROUNDED`` linears' outputs and the
    ``RE_ROUNDED_BACKWARD`` linears' input gradients of ``chunks``; returns how many linears.
    torch is imported here, not at the top: the backend reads UNIT_ROUNDOFF at collection,
    where torch is not loaded."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    # Two streams: the forward's draws stay what they were without the backward noise.
    generator = torch.Generator().manual_seed(seed)
    backward_generator = torch.Generator().manual_seed(seed + 1)

    def noisy(tensor: Any, gen: Any) -> Any:
        xi = torch.rand(tensor.shape, generator=gen, dtype=torch.float32)
        factor = (1.0 + amplitude * (2.0 * xi - 1.0)).to(device=tensor.device)
        return (tensor.float() * factor).to(tensor.dtype)

    class NoisyGradient(torch.autograd.Function):
        """Identity forward; the backward re-rounds the gradient by ``1 + a * xi``."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return noisy(grad, backward_generator)

    def perturb(module: Any, inputs: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return None
        return noisy(output, generator)

    def perturb_input_grad(module: Any, inputs: tuple[Any, ...]) -> Any:
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or not x.requires_grad:
            return None
        return (NoisyGradient.apply(x), *inputs[1:])

    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf in RE_ROUNDED:
                module.register_forward_hook(perturb)
                count += 1
            elif leaf in RE_ROUNDED_BACKWARD:
                module.register_forward_pre_hook(perturb_input_grad)
                count += 1
    return count
