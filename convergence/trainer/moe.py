"""Mixture of experts: top-k routing, routed experts as grouped GEMMs, expert parallelism.

A block of an MoE model (model.n_experts > 0, from layer model.n_dense_layers on) has an
:class:`MoE` where a dense block has its FeedForward:

    MoE
      router         Router: gate (Linear dim -> n_experts, no bias), expert_bias buffer
      experts        GroupedExperts: w1, w3 (n_experts, hidden, dim), w2 (n_experts, dim, hidden)
      shared_expert  FeedForward (n_shared_experts * hidden wide), or None

One forward on the T tokens of the local batch (batch and sequence flattened):

  1. scores = softmax or sigmoid of gate(x), in fp32; each token picks the top_k experts of
     scores + expert_bias (the bias only *chooses*; the weights are the scores themselves).
  2. The T*top_k (token, expert) assignments are sorted by expert with a stable sort, so each
     expert's rows are contiguous and in token order.
  3. The dispatcher runs the experts on those rows: locally, one grouped GEMM per weight
     (no EP); or, under EP, an all-to-all sends each expert's rows to the rank that holds it,
     the rank runs its experts, and a second all-to-all sends the results back.
  4. Combine: the rows back in assignment order (the inverse permutation), times their
     routing weights, summed over each token's top_k in a fixed order.

Dropless: every assignment is computed (no capacity factor), so whatever the load, no token is
dropped. That is what makes the math independent of how tokens are spread over ranks: an EP
layout computes the same function as a non-EP one, and a pair can compare them at the fp32
noise floor.

The load-balancing loss is DeepSeek-V3's *sequence-wise* one, averaged over the sequences of
the global batch. Why per sequence: a sequence never straddles data-parallel ranks, so every
rank computes its sequences' terms from its own tokens and the data-parallel gradient average
gives the loss of the whole batch -- the same in every layout, with no extra communication. A
batch-wise loss (load of the whole batch times its mean score) is not a sum over ranks: each
rank would need the global load first. It enters the backward through :class:`_AddAuxLoss`
(a constant gradient on the loss term), so neither the loss function nor the pipeline schedule
need to know it exists; its value is logged separately (``moe_aux_loss``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

#: routing fingerprints are < 2**48: exact as JSON numbers / float64 (like data_fingerprint).
FINGERPRINT_BITS = 48


@dataclass(frozen=True, kw_only=True)
class MoEArgs:
    """Resolved MoE sizes (ModelArgs.moe; None for a dense model)."""

    n_experts: int
    top_k: int
    score_func: str
    route_norm: bool
    hidden_dim: int
    n_shared_experts: int
    n_dense_layers: int
    aux_loss_coeff: float
    bias_update_rate: float


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (an EP-sharded DTensor: its experts), or the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# Grouped GEMM


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands (torch 2.13, measured on CPU): fp32,
    bf16 or fp16 (not fp64), every stride a multiple of 16 bytes, i.e. dim and hidden sizes
    multiples of 4 (fp32) or 8 (bf16). On CUDA only bf16 is taken (the fp32 path is not in
    every build); everything else runs the per-expert loop, the same math."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    align = 16 // x.element_size()
    return all(size % align == 0 for size in (x.shape[-1], w.shape[-1], w.shape[-2]))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x (N, K), sorted by expert with counts[e] rows for expert e, times w[e] (K, M):
    (N, M). One grouped GEMM where torch._grouped_mm runs, else a loop over the experts."""
    if grouped_mm_runs(x, w):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    pieces = torch.split(x, counts.tolist())
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """n_experts SwiGLUs, their weights stacked on dim 0 (what EP shards: whole experts)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        # Set by parallelize.apply_ep to 1/ep: see there why the experts' gradient needs it.
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows sorted by (local) expert, counts[e] of them for this rank's expert e."""
        # Under EP the weights are DTensors sharded on the expert dim: this rank's experts.
        w1, w2, w3 = (
            _ScaleGrad.apply(local(w), self.grad_scale) if self.grad_scale != 1.0 else local(w)
            for w in (self.w1, self.w2, self.w3)
        )
        # Weights outside FSDP's mixed precision (EP with ep = dp_shard*cp) meet inputs in the
        # compute dtype: cast them (a no-op when the dtypes agree).
        w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
        gate = grouped_mm(x, w1.transpose(-2, -1), counts)
        up = grouped_mm(x, w3.transpose(-2, -1), counts)
        return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), counts)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for weight in (self.w2, self.w3):
            nn.init.trunc_normal_(weight, mean=0.0, std=std)


# ----------------------------------------------------------------------------------------------
# Routing


class Router(nn.Module):
    """Scores, the top-k choice and the routing weights of every token."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=False)
        # The auxiliary-loss-free balancing bias (DeepSeek-V3): a buffer, not a parameter --
        # it is moved by the step's load (update_expert_bias), never by a gradient. Persistent,
        # so training checkpoints carry it; every rank holds it whole and updates it alike.
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> scores (T, E) fp32, selected (T, k) expert ids, weights (T, k) fp32."""
        # fp32 scores whatever the compute dtype: the top-k is a comparison, and a bf16 score
        # would make near-ties (that rounding then decides) far more common.
        logits = self.gate(x).float()
        if self.args.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = F.softmax(logits, dim=-1)
        choice = scores + self.expert_bias.float() if self.args.bias_update_rate else scores
        selected = torch.topk(choice.detach(), self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, selected)
        if self.args.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, selected, weights

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=0.02)
        self.expert_bias.zero_()


def sequence_balance_loss(
    scores: torch.Tensor, selected: torch.Tensor, bsz: int, top_k: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, one value per sequence (bsz,):
    sum_e f_e * P_e, f_e = E/(k*L) * (assignments to e in the sequence), P_e = the mean over
    the sequence's L tokens of e's normalised score. 1 at perfect balance."""
    n_experts = scores.shape[-1]
    probs = scores / scores.sum(dim=-1, keepdim=True)
    mean_probs = probs.view(bsz, -1, n_experts).mean(dim=1)
    # The load counted with one_hot + sum (no scatter): deterministic on every device.
    load = F.one_hot(selected.view(bsz, -1), n_experts).sum(dim=1).float()
    seq_len = selected.shape[0] // bsz
    return (load * (n_experts / (top_k * seq_len)) * mean_probs).sum(dim=-1)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on x; in backward, the loss term gets the constant gradient `scale`, so the
    auxiliary loss is part of the objective without flowing through the model's output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


# ----------------------------------------------------------------------------------------------
# Dispatch: the rows of each expert to its rank and back

#: (rows sorted by global expert, tokens per global expert, the experts, the EP group or None)
#: -> the experts' output rows in the same order. Swappable (MoE.dispatch), like attention's
#: sdpa: the planted dispatch bugs of the tests replace it.
DispatchFn = Callable[
    [torch.Tensor, torch.Tensor, GroupedExperts, "ProcessGroup | None"], torch.Tensor
]


def dispatch(
    rows: torch.Tensor,
    counts: torch.Tensor,
    experts: GroupedExperts,
    group: ProcessGroup | None,
    *,
    regroup: bool = True,
) -> torch.Tensor:
    """The experts' output for `rows` (sorted by expert, counts[e] rows for expert e).

    Without EP: the grouped GEMMs on the rows as they are. Under EP (`group` of size ep, this
    rank holding experts [r*E/ep, (r+1)*E/ep)): the per-expert counts are exchanged first
    (all_to_all_single), then the rows of each destination's experts (contiguous, since sorted)
    go out in one all-to-all. What arrives is ordered (source rank, local expert); the grouped
    GEMM needs (local expert, ...), so the rows are regrouped by a stable sort on their local
    expert, the experts run, the results are put back in arrival order and sent home by the
    reverse all-to-all. `regroup=False` is the bug that skips that permutation (tests only).
    """
    if group is None:
        return experts(rows, counts)
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = group.size()
    n_local = counts.numel() // ep
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits = counts.view(ep, n_local).sum(dim=1).tolist()
    recv_splits = received_counts.view(ep, n_local).sum(dim=1).tolist()
    received = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    local_counts = received_counts.view(ep, n_local).sum(dim=0)
    if not regroup:
        return all_to_all_single_autograd(
            experts(received, local_counts), send_splits, recv_splits, group
        )
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received_counts)
    order = torch.argsort(expert_of_row, stable=True)
    out = experts(received[order], local_counts)
    return all_to_all_single_autograd(out[inverse(order)], send_splits, recv_splits, group)


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation (gathers only: deterministic on every device)."""
    return torch.argsort(order)


# ----------------------------------------------------------------------------------------------
# The MoE layer


class SharedExpert(Protocol):
    """What the shared expert is (model.FeedForward; passed in: model.py imports this module)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def init_weights(self, std: float) -> None: ...


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs, shared: SharedExpert | None) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        self.shared_expert = shared
        # Set by parallelize.apply_ep: the EP process group (None: every expert local).
        self.ep_group: ProcessGroup | None = None
        self.dispatch: DispatchFn = dispatch
        # Set by the trainer (set_aux_scale): the gradient of one sequence's balance loss.
        self.aux_scale = 0.0
        # This step's routing statistics, one float64 row [balance loss sum, tokens per
        # expert...] per training forward; collected and cleared by step_routing.
        self.stats: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, _, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, selected, weights = self.router(tokens)
        counts = torch.bincount(selected.flatten(), minlength=self.args.n_experts)
        balance = sequence_balance_loss(scores, selected, bsz, self.args.top_k).sum()
        # Not when recomputed for activation checkpointing (that runs inside backward), nor in
        # evaluation: one row per microstep of training.
        if self.training and torch._C._current_graph_task_id() == -1:
            self.stats.append(torch.cat([balance.detach().double().view(1), counts.double()]))
        # The assignments sorted by expert (stable: each expert's rows in token order).
        order = torch.argsort(selected.flatten(), stable=True)
        rows = tokens[order // self.args.top_k]
        out = self.dispatch(rows, counts, self.experts, self.ep_group)
        # Combine in fp32, each token's top_k summed in a fixed order.
        per_choice = out[inverse(order)].view(-1, self.args.top_k, dim).float()
        routed = (per_choice * weights.unsqueeze(-1)).sum(dim=1).type_as(x)
        if self.args.aux_loss_coeff and torch.is_grad_enabled():
            routed = _AddAuxLoss.apply(routed, balance, self.aux_scale)
        if self.shared_expert is not None:
            routed = routed + self.shared_expert(tokens)
        return routed.view_as(x)

    def init_weights(self, std: float) -> None:
        self.router.reset_parameters()
        self.experts.init_weights(std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std)


# ----------------------------------------------------------------------------------------------
# The step's routing statistics (trainer side)


def moe_layers(chunks: Iterable[nn.Module]) -> dict[int, MoE]:
    """The MoE layers this rank holds, by global layer id."""
    out: dict[int, MoE] = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, MoE):
                parts = [p for p in name.split(".") if p.isdigit()]
                out[int(parts[0])] = module
    return out


def set_aux_scale(chunks: Iterable[nn.Module], coeff: float, num_ranks: int, samples: int) -> None:
    """Each sequence's balance-loss gradient: coeff * D / S (S samples per step, D the ranks
    gradients are averaged over): the average over ranks then gives coeff * mean over S."""
    for layer in moe_layers(chunks).values():
        layer.aux_scale = coeff * num_ranks / samples


@dataclass(frozen=True, kw_only=True)
class StepRouting:
    """The routing of one optimizer step over the whole global batch."""

    layers: tuple[int, ...]
    """The MoE layer ids, in order."""
    tokens: torch.Tensor
    """(layers, n_experts) int64: assignments per expert per layer (the routing fingerprint)."""
    balance: torch.Tensor
    """(layers,) float64: the sequence-wise balance loss, mean over the step's sequences."""

    def fingerprint(self) -> int:
        digest = hashlib.sha256(self.tokens.cpu().numpy().tobytes()).digest()
        return int.from_bytes(digest[:8], "little") % 2**FINGERPRINT_BITS

    def metrics(self, *, with_balance: bool = True) -> dict[str, float | int]:
        """The metrics line's MoE entries (`with_balance` False: no moe_aux_loss, which CP
        cannot compute: its ranks hold pieces of each sequence)."""
        load = self.tokens.double()
        mean = load.mean(dim=1).clamp(min=1.0)
        out: dict[str, float | int] = {
            # Most loaded expert / mean, worst layer: 1 = perfectly balanced.
            "moe_load_max": float((load.max(dim=1).values / mean).max()),
            "routing_fingerprint": self.fingerprint(),
        }
        if with_balance:
            out["moe_aux_loss"] = float(self.balance.mean())
        for row, layer in enumerate(self.layers):
            for expert, num in enumerate(self.tokens[row].tolist()):
                out[f"moe_tokens/{layer}.{expert}"] = int(num)
        return out


def step_routing(
    chunks: Iterable[nn.Module],
    layer_ids: tuple[int, ...],
    n_experts: int,
    samples: int,
    groups: Iterable[ProcessGroup],
    device: torch.device,
    forwards: int,
) -> StepRouting:
    """Sum this step's statistics over its `forwards` training forwards (microsteps x PP
    microbatches), the data-parallel ranks (different tokens) and the PP stages (different
    layers; `groups`), then clear them. Every rank of the world calls it (collectives);
    ranks holding the same tokens (TP) are not summed.

    Only the last `forwards` rows count: on its first step a pipeline schedule runs each
    stage once more, first, on uninitialised tensors of the right shapes (torch 2.13's
    metadata inference), whose routing is noise."""
    held = moe_layers(chunks)
    table = torch.zeros(len(layer_ids), n_experts + 1, dtype=torch.float64, device=device)
    for row, layer_id in enumerate(layer_ids):
        layer = held.get(layer_id)
        if layer is not None and layer.stats:
            table[row] = torch.stack(layer.stats[-forwards:]).sum(dim=0)
            layer.stats.clear()
    for group in groups:
        dist.all_reduce(table, group=group)
    return StepRouting(
        layers=layer_ids,
        tokens=table[:, 1:].round().long(),
        balance=table[:, 0] / samples,
    )


@torch.no_grad()
def update_expert_bias(chunks: Iterable[nn.Module], routing: StepRouting, rate: float) -> None:
    """Auxiliary-loss-free balancing: bias += rate * sign(mean load - load) per expert, from
    the global load of the step, so every rank moves its copy of the bias the same way."""
    held = moe_layers(chunks)
    for row, layer_id in enumerate(routing.layers):
        layer = held.get(layer_id)
        if layer is None:
            continue
        load = routing.tokens[row].double()
        step = torch.sign(load.mean() - load) * rate
        bias = layer.router.expert_bias
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))
