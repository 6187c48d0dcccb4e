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
over the sharded output dimension, computed per rank, rounded to the compute dtype and summed by
the all-reduce. The twin computes the input gradient of every such linear
(``RE_ROUNDED_BACKWARD``) the way TP2's two ranks do: the two halves' partial products, each
rounded, then added (``SplitInputGradient``; forward and weight gradient unchanged, bit for
bit). Why this and not ``1 + a * xi`` on the input gradient: that noise, at the unit roundoff,
left the twin's one-step gradient gaps where they were (config B: TP's per-part gaps stayed
1.5-3x the twin's, 9 of 10 pseudo-pairs failing), where the split moved them to TP's (0.8-1.1x;
2 of 10; BENCHMARKS.md, "tptwin"). Per element the split's gaps are heavy-tailed where the
two halves cancel; why that matters this much more than the noise was not measured.

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
#: dimension) in the backward -- the blocks' wq/wk/wv, w1/w3 and the output projection, which
#: the built-in TP shards over the vocabulary (convergence/trainer/parallelize.py).
RE_ROUNDED_BACKWARD = frozenset({"wq", "wk", "wv", "w1", "w3", "output"})

#: Unit roundoff (half the spacing of the significand) per compute dtype: the amplitude the
#: built-in backend gives its forward-noise twin.
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}


def add_forward_noise(chunks: list[Any], amplitude: float, seed: int) -> int:
    """Perturb the ``RE_ROUNDED`` linears' outputs and split the ``RE_ROUNDED_BACKWARD``
    linears' input gradients in ``chunks``; returns how many linears.
    torch is imported here, not at the top: the backend reads UNIT_ROUNDOFF at collection,
    where torch is not loaded."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)

    def noisy(tensor: Any, gen: Any) -> Any:
        xi = torch.rand(tensor.shape, generator=gen, dtype=torch.float32)
        factor = (1.0 + amplitude * (2.0 * xi - 1.0)).to(device=tensor.device)
        return (tensor.float() * factor).to(tensor.dtype)

    class SplitInputGradient(torch.autograd.Function):
        """``x @ w.T`` whose input gradient is summed as two ranks of TP2 sum it: the two
        halves of the output dimension each give a partial product, rounded to the compute
        dtype, then added (the all-reduce) and rounded again."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any) -> Any:
            ctx.save_for_backward(x, weight)
            return torch.nn.functional.linear(x, weight)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, weight = ctx.saved_tensors
            half = weight.shape[0] // 2
            grad_x = grad[..., :half] @ weight[:half] + grad[..., half:] @ weight[half:]
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            return grad_x, grad_w

    def perturb(module: Any, inputs: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return None
        return noisy(output, generator)

    def split_forward(module: Any) -> Any:
        def forward(x: Any) -> Any:
            if (
                isinstance(x, DTensor)
                or isinstance(module.weight, DTensor)
                or module.bias is not None
            ):
                return torch.nn.functional.linear(x, module.weight, module.bias)
            return SplitInputGradient.apply(x, module.weight)

        return forward

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
                # An instance attribute: nn.Module's call (and FSDP2's hooks around it) finds it.
                module.forward = split_forward(module)  # type: ignore[method-assign]
                count += 1
    return count
