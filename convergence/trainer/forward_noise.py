"""TP's rounding in the control's own layout, for the twin regime's *forward-noise twin*.

Why: the DP noise twin (another FSDP degree) differs from its control only in the gradient
reduction; its forward pass is bit-identical. A tensor-parallel test also rounds its forward
and backward differently at every step: each rank's partial sums of every split matmul,
rounded to the compute dtype, then added by the all-reduce. That is a larger perturbation per
step, which the run's chaos then grows at the same rate (BENCHMARKS.md, "Twin envelope on other
models"), so an envelope measured on the DP twin alone is too narrow for those layouts.

The forward-noise twin is the control itself computing every split matmul as a TP layout's
``parts`` ranks do (TP2 by default; the test's TP degree where it is larger), in one process,
with no communication:

- a row-wise linear (``RE_ROUNDED``: attention ``wo``, FFN ``w2``): each of the ``parts``
  slices of the input dimension gives a partial output, rounded, then they are added (TP's
  forward all-reduce);
- a column-wise linear (``RE_ROUNDED_BACKWARD``: wq/wk/wv, w1/w3, the vocabulary-sharded
  output): each slice of the output dimension reads its own view of the input, so autograd sums
  each rank's partial input gradients over all consumers of that input first (wq, wk and wv
  read one normed input) and adds the ranks' sums last -- TP's one all-reduce of the
  replicated input (convergence/trainer/parallelize.py ``_replicated_input``). Each output
  element and each weight gradient is computed whole, as under TP.

History, measured (BENCHMARKS.md "tptwin", "The bf16 TP false alarm"): the twin first
multiplied the row-wise outputs by ``1 + u * xi`` (u the unit roundoff, xi uniform); a correct
FSDP2+TP2 then left the anchored check's one-step tolerance in 58 % of the held-back
pseudo-pairs -- its one-step gaps were heavy-tailed where the two halves cancel, which noise of
a fixed relative size does not produce. Splitting each column-wise input gradient on its own
cut that to 15 %; the split above, rounding in TP2's own association, reproduces a correct
FSDP2+TP2's one step from an anchor bit for bit on this CPU (loss, every grad and update norm),
so its gap is the twin's. TP+SP rounds alike but not identically (its norms' weight gradients).

A TP4 test (BENCHMARKS.md "TP4"): its four partial sums are added by gloo or NCCL in their own
order, so no twin reproduces it bit for bit, and against the TP2 twin alone its one-step gaps
left the anchored tolerance in 5 of 10 pseudo-pairs of config D at one seed. The regime then
adds a twin with ``parts = 4`` (four rounded quarters, summed in this process's order) beside
the TP2 one, their noises added up (convergence/regimes/twin.py ``forward_twin_degrees``).

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


def add_tp_rounding(chunks: list[Any], parts: int = 2) -> int:
    """Make the ``RE_ROUNDED`` and ``RE_ROUNDED_BACKWARD`` linears in ``chunks`` round as a TP
    layout of ``parts`` ranks does; returns how many linears. torch is imported here, not at
    the top: the backend reads UNIT_ROUNDOFF at collection, where torch is not loaded."""
    if parts < 2:
        raise ValueError(f"a TP rounding needs at least 2 parts, got {parts}")
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    linear = torch.nn.functional.linear
    # The last input a column-wise linear read, and its views (one per TP rank): wq, wk and wv
    # are called one after another on the same tensor, so one slot is enough.
    last: list[Any] = [None, ()]

    def views_of(x: Any) -> tuple[Any, ...]:
        if last[0] is not x:
            last[:] = [x, tuple(x.view_as(x) for _ in range(parts))]
        return last[1]

    def bounds(size: int) -> list[tuple[int, int]]:
        # Rank r's slice of a split dimension (TP2: the two halves, as before).
        cuts = [r * size // parts for r in range(parts + 1)]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def plain(module: Any, x: Any) -> bool:
        return not (
            isinstance(x, DTensor) or isinstance(module.weight, DTensor) or module.bias is not None
        )

    # The slices are fixed once per linear: a weight's (global) shape does not change, sharded
    # by FSDP2 between steps or not.
    def column_split(module: Any) -> Any:
        slices = bounds(module.weight.shape[0])

        def forward(x: Any) -> Any:
            if not plain(module, x):
                return linear(x, module.weight, module.bias)
            w = module.weight
            outs = [
                linear(view, w[lo:hi]) for view, (lo, hi) in zip(views_of(x), slices, strict=True)
            ]
            return torch.cat(outs, dim=-1)

        return forward

    def row_split(module: Any) -> Any:
        slices = bounds(module.weight.shape[1])

        def forward(x: Any) -> Any:
            if not plain(module, x):
                return linear(x, module.weight, module.bias)
            w = module.weight
            partials = [linear(x[..., lo:hi], w[:, lo:hi]) for lo, hi in slices]
            total = partials[0]
            for partial in partials[1:]:  # each rank's partial output rounded, then added
                total = total + partial
            return total

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
