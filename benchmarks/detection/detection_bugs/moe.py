"""Mixture-of-experts and expert-parallel bugs (docs/moe.md), each wrong the way real ones are.

Planted on the test side of an FSDP2 vs FSDP2 + EP2 pair of train_configs/moe_debug.toml (8
experts top-2, a shared expert, the sequence-wise balance loss and the expert bias on):

- the routed experts' gradient reduced over the wrong group: their FSDP group only (``ep``
  times too large, pytorch/pytorch#160285, deepspeedai/DeepSpeed#5259), or averaged over the
  EP group as well (``1/ep``);
- the router's gradient not reduced across the data-parallel ranks that share it: each rank
  steps the router rows it holds with its own tokens' gradient (huggingface/transformers#48687
  is the family: "the loss is correct ... nothing in a training run looks off");
- the balance loss from local tokens only: its load and mean scores pooled over the rank's
  tokens, which is what a batch-wise balance loss computes when its counts are not all-reduced;
- the combine out of step with the dispatch: each expert output row is put back at the
  position of the sort (the dispatch permutation) instead of its inverse;
- the routing weights not applied at the combine (the top-k outputs summed unweighted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from convergence.trainer import moe
from convergence.trainer.hooks import HookContext
from convergence.trainer.moe import MoE, _AddAuxLoss, inverse


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def experts_reduced_over_efsdp_only(model: nn.Module, ctx: HookContext) -> None:
    """The experts' gradient averaged over their FSDP group only (dp_shard*cp/ep ranks), not
    over every data-parallel rank: the 1/ep of parallelize.apply_ep forgotten, ep times too
    large."""
    for layer in _moe_layers(model):
        layer.experts.grad_scale = 1.0


def experts_averaged_over_ep_too(model: nn.Module, ctx: HookContext) -> None:
    """The experts' gradient averaged over the EP group once more, although the all-to-all's
    backward already summed the EP group's tokens into it: 1/ep of the right one."""
    for layer in _moe_layers(model):
        if layer.ep_group is not None:
            layer.experts.grad_scale /= layer.ep_group.size()


def router_grad_not_reduced(model: nn.Module, ctx: HookContext) -> None:
    """The router's gradient not reduced across the data-parallel ranks that share it: each
    rank steps the rows of the router it holds (FSDP's Shard(0)) with its own tokens' gradient
    only. Planted in the forward: the gate's weight enters as ``W.detach() + D * mask_r * (W -
    W.detach())`` -- the value W, the gradient D times this rank's own rows only -- so FSDP's
    average over the D ranks leaves each rank's rows with its own local gradient."""
    if ctx.dp_mesh is None or ctx.dp_mesh.ndim != 1:
        return
    ranks, rank = ctx.dp_mesh.size(), ctx.dp_mesh.get_local_rank()
    for layer in _moe_layers(model):
        gate = layer.router.gate

        def forward(x: torch.Tensor, gate: nn.Linear = gate) -> torch.Tensor:
            weight = moe.local(gate.weight)
            rows = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
            rows[torch.arange(weight.shape[0]).chunk(ranks)[rank]] = ranks
            weight = weight.detach() + rows * (weight - weight.detach())
            return F.linear(x, weight)

        gate.forward = forward  # type: ignore[method-assign]


def _pooled_balance_loss(
    scores: torch.Tensor, selected: torch.Tensor, bsz: int, top_k: int
) -> torch.Tensor:
    # All of the rank's tokens as one sequence, spread over its bsz sequences (the sum the
    # layer takes is bsz times the pooled loss, as the per-sequence sum is ~bsz at balance).
    return moe_sequence_balance_loss(scores, selected, 1, top_k).repeat(bsz)


moe_sequence_balance_loss = moe.sequence_balance_loss


def aux_loss_from_local_tokens(model: nn.Module, ctx: HookContext) -> None:
    """The balance loss's load f_e and mean score P_e pooled over this rank's tokens instead
    of per sequence: a batch-wise balance loss whose counts were never all-reduced over the
    data-parallel ranks (each rank balances its own tokens only)."""
    moe.sequence_balance_loss = _pooled_balance_loss  # type: ignore[assignment]


def _forward(self: MoE, x: torch.Tensor, *, combine_inverse: bool, weighted: bool) -> Any:
    """MoE.forward with the combine's permutation or weights wrong (the rest as shipped)."""
    bsz, _, dim = x.shape
    tokens = x.reshape(-1, dim)
    scores, selected, weights = self.router(tokens)
    counts = torch.bincount(selected.flatten(), minlength=self.args.n_experts)
    balance = moe.sequence_balance_loss(scores, selected, bsz, self.args.top_k).sum()
    if self.training and torch._C._current_graph_task_id() == -1:
        self.stats.append(torch.cat([balance.detach().double().view(1), counts.double()]))
    order = torch.argsort(selected.flatten(), stable=True)
    rows = tokens[order // self.args.top_k]
    out = self.dispatch(rows, counts, self.experts, self.ep_group)
    back = inverse(order) if combine_inverse else order
    per_choice = out[back].view(-1, self.args.top_k, dim).float()
    if weighted:
        routed = (per_choice * weights.unsqueeze(-1)).sum(dim=1).type_as(x)
    else:
        routed = per_choice.sum(dim=1).type_as(x)
    if self.args.aux_loss_coeff and torch.is_grad_enabled():
        routed = _AddAuxLoss.apply(routed, balance, self.aux_scale)
    if self.shared_expert is not None:
        routed = routed + self.shared_expert(tokens)
    return routed.view_as(x)


def combine_with_dispatch_order(model: nn.Module, ctx: HookContext) -> None:
    """The combine indexes the experts' output with the dispatch's sort order instead of its
    inverse: every row lands at another token's (and choice's) position."""
    for layer in _moe_layers(model):
        layer.forward = lambda x, layer=layer: _forward(  # type: ignore[method-assign]
            layer, x, combine_inverse=False, weighted=True
        )


def combine_without_weights(model: nn.Module, ctx: HookContext) -> None:
    """The combine sums each token's top-k expert outputs without its routing weights (and so
    the router gets no gradient from the language-model loss)."""
    for layer in _moe_layers(model):
        layer.forward = lambda x, layer=layer: _forward(  # type: ignore[method-assign]
            layer, x, combine_inverse=True, weighted=False
        )
