"""Rounding-level noise in the forward pass, for the twin regime's *forward-noise twin*.

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

Only plain tensors are perturbed (a DTensor output under TP is left as it is: its shards
already round in their own order).
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

#: Unit roundoff (half the spacing of the significand) per compute dtype: the amplitude the
#: built-in backend gives its forward-noise twin.
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}


def add_forward_noise(chunks: list[Any], amplitude: float, seed: int) -> int:
    """Register the perturbation on the ``RE_ROUNDED`` linears of ``chunks``; returns how
    many. torch is imported here, not at the top: the backend reads UNIT_ROUNDOFF at
    collection, where torch is not loaded."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)

    def perturb(module: Any, inputs: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return None
        xi = torch.rand(output.shape, generator=generator, dtype=torch.float32)
        factor = (1.0 + amplitude * (2.0 * xi - 1.0)).to(device=output.device)
        return (output.float() * factor).to(output.dtype)

    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in RE_ROUNDED:
                module.register_forward_hook(perturb)
                count += 1
    return count
