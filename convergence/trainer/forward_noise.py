"""TP2's rounding in the control's own layout, for the twin regime's *forward-noise twin*.

Why: the DP noise twin (another FSDP degree) differs from its control only in the gradient
reduction; its forward pass is bit-identical. A tensor-parallel test also rounds its forward
and backward differently at every step: each rank's partial sums of every split matmul,
rounded to the compute dtype, then added by the all-reduce. That is a larger perturbation per
step, which the run's chaos then grows at the same rate (BENCHMARKS.md, "Twin envelope on other
models"), so an envelope measured on the DP twin alone is too narrow for those layouts.

The forward-noise twin is the control itself computing every split matmul as TP2's two ranks
do, in one process, with no communication:

- a row-wise linear (``RE_ROUNDED``: attention ``wo``, FFN ``w2``): the two halves of the input
  dimension each give a partial output, rounded, then added (TP2's forward all-reduce);
- a column-wise linear (``RE_ROUNDED_BACKWARD``: wq/wk/wv, w1/w3, the vocabulary-sharded
  output): each half of the output dimension reads its own view of the input, so autograd sums
  each rank's partial input gradients over all consumers of that input first (wq, wk and wv
  read one normed input) and adds the two ranks' sums last -- TP2's one all-reduce of the
  replicated input (convergence/trainer/parallelize.py ``_replicated_input``). Each output
  element and each weight gradient is computed whole, as under TP.

History, measured (BENCHMARKS.md "tptwin", "The bf16 TP false alarm"): the twin first
multiplied the row-wise outputs by ``1 + u * xi`` (u the unit roundoff, xi uniform); a correct
FSDP2+TP2 then left the anchored check's one-step tolerance in 58 % of the held-back
pseudo-pairs -- its one-step gaps were heavy-tailed where the two halves cancel, which noise of
a fixed relative size does not produce. Splitting each column-wise input gradient on its own
cut that to 15 %; the split above, rounding in TP2's own association, reproduces a correct
FSDP2+TP2's one step from an anchor bit for bit on this CPU (loss, every grad and update norm),
so its gap is the twin's. Other TP degrees and TP+SP round alike but not identically.

Only plain tensors are split (a DTensor under TP is left as it is: its shards already round in
their own order).
"""

from __future__ import annotations

from typing import Any

#: The row-wise linears, whose outputs TP sums over ranks: attention output ``wo``, FFN down
#: ``w2`` (and context parallelism feeds ``wo`` the attention it accumulated per chunk).
RE_ROUNDED = frozenset({"wo", "w2"})

#: The column-wise linears, whose *input gradient* TP sums over ranks (each rank's share of the
#: output dimension): the blocks' wq/wk/wv, w1/w3 and the output projection, which the built-in
#: TP shards over the vocabulary (convergence/trainer/parallelize.py).
RE_ROUNDED_BACKWARD = frozenset({"wq", "wk", "wv", "w1", "w3", "output"})

#: Unit roundoff (half the spacing of the significand) per compute dtype: the value the built-in
#: backend writes into the twin's ``training.forward_noise`` (non-zero switches the twin on).
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}


def add_tp2_rounding(chunks: list[Any]) -> int:
    """Make the ``RE_ROUNDED`` and ``RE_ROUNDED_BACKWARD`` linears in ``chunks`` round as TP2
    does; returns how many linears. torch is imported here, not at the top: the backend reads
    UNIT_ROUNDOFF at collection, where torch is not loaded."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    linear = torch.nn.functional.linear
    # The last input a column-wise linear read, and its two views (one per TP2 rank): wq, wk
    # and wv are called one after another on the same tensor, so one slot is enough.
    last: list[Any] = [None, None, None]

    def halves_of(x: Any) -> tuple[Any, Any]:
        if last[0] is not x:
            last[:] = [x, x.view_as(x), x.view_as(x)]
        return last[1], last[2]

    def plain(module: Any, x: Any) -> bool:
        return not (
            isinstance(x, DTensor) or isinstance(module.weight, DTensor) or module.bias is not None
        )

    def column_split(module: Any) -> Any:
        def forward(x: Any) -> Any:
            if not plain(module, x):
                return linear(x, module.weight, module.bias)
            first, second = halves_of(x)
            half = module.weight.shape[0] // 2
            return torch.cat(
                [linear(first, module.weight[:half]), linear(second, module.weight[half:])],
                dim=-1,
            )

        return forward

    def row_split(module: Any) -> Any:
        def forward(x: Any) -> Any:
            if not plain(module, x):
                return linear(x, module.weight, module.bias)
            half = module.weight.shape[1] // 2
            return linear(x[..., :half], module.weight[:, :half]) + linear(
                x[..., half:], module.weight[:, half:]
            )

        return forward

    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf in RE_ROUNDED:
                split = row_split
            elif leaf in RE_ROUNDED_BACKWARD:
                split = column_split
            else:
                continue
            # An instance attribute: nn.Module's call (and FSDP2's hooks around it) finds it.
            module.forward = split(module)  # type: ignore[method-assign]
            count += 1
    return count
