"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

The structure mirrors torchtitan's llama so its parallel plans read the same here:

    Transformer
      tok_embeddings   nn.Embedding            (None on PP stages that do not own it)
      layers           nn.ModuleDict "0".."n_layers-1" of TransformerBlock
        attention_norm RMSNorm
        attention      Attention: wq, wk, wv, wo (Linear, no bias) and a swappable `sdpa`
        ffn_norm       RMSNorm
        feed_forward   FeedForward: w1, w2, w3 (SwiGLU)     (None in an MoE block)
        moe            MoE: router, experts, shared_expert  (MoE blocks only: moe.py)
      norm             RMSNorm                 (None on PP stages that do not own it)
      output           nn.Linear               (None on PP stages that do not own it)

Pipeline parallelism splits the model by deleting entries of `layers` and setting
tok_embeddings / norm / output to None; `forward` copes with every such chunk.

Block kinds (`model.block_pattern`, for the reduced-communication study). The math of each kind
is fixed by the config, never by the TP degree, so tp=1 and tp=2 compute the same function;
what TP communicates per block (see parallelize.tp_plan) is in the comments:

    standard     h = x + attn(norm1(x)); out = h + mlp(norm2(h))        2 all-reduces forward
    single_sync  n = norm(x); out = x + attn(n) + mlp(n)  (GPT-J)       1 all-reduce forward
                 -- both row-parallel outputs stay partial, summed, then reduced once
    parallel     `standard` on each of `parallel_groups` slices of the hidden state, with
                 block-diagonal weights (no mixing across slices)        0 (block-local)
                 -- under TP the residual stream stays sharded on the hidden dim through a run
                 of parallel blocks; only entering a non-parallel block (or the final norm)
                 all-gathers it. Their MLP is widened so a block keeps about the parameter
                 count of a standard one (ModelArgs.parallel_ffn_hidden_dim).

Build it on the meta device, shard it, then `to_empty(device=...)` and `init_weights()`: no
rank ever holds the full unsharded weights of a large model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from convergence.trainer.blocks import parse_block_pattern
from convergence.trainer.config import ModelConfig
from convergence.trainer.moe import MoE, MoEArgs

#: Attention kernel on (batch, heads, seq, head_dim) tensors with causal semantics.
SdpaFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default attention: torch's fused causal SDPA (context parallel swaps this out)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Resolved model sizes (the config's 0 = default values filled in)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    norm_eps: float
    rope_theta: float
    init_std: float
    max_seq_len: int
    tie_embeddings: bool
    block_kinds: tuple[str, ...]
    parallel_groups: int = 1
    """Slices of the hidden state a "parallel" block computes independently."""
    parallel_ffn_hidden_dim: int = 0
    """SwiGLU hidden size of each slice of a "parallel" block."""
    moe: MoEArgs | None = None
    """The mixture of experts (model.n_experts > 0), None for a dense model."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, model: ModelConfig, *, seq_len: int) -> ModelArgs:
        hidden = model.ffn_hidden_dim
        if hidden == 0:
            # Llama's rule: 2/3 of 4*dim (so SwiGLU's 3 matrices cost what a 4x MLP costs),
            # rounded up to a multiple that keeps the matmuls friendly.
            hidden = int(2 * (4 * model.dim) / 3)
            hidden = model.multiple_of * math.ceil(hidden / model.multiple_of)
        kinds = parse_block_pattern(model.block_pattern, model.n_layers)
        groups = max(model.parallel_groups, 1)
        head_dim = model.dim // model.n_heads
        # A parallel block's attention has 1/groups of the dense parameters (block-diagonal);
        # widen each slice's MLP by what was lost so the block keeps a standard block's size.
        attn = model.dim * head_dim * 2 * (model.n_heads + model.n_kv_heads)
        lost = attn * (groups - 1) // groups
        wide = hidden + lost // (3 * model.dim)
        wide = model.multiple_of * round(wide / model.multiple_of)
        return cls(
            vocab_size=model.vocab_size,
            dim=model.dim,
            n_layers=model.n_layers,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            ffn_hidden_dim=hidden,
            norm_eps=model.norm_eps,
            rope_theta=model.rope_theta,
            init_std=model.init_std,
            max_seq_len=seq_len,
            tie_embeddings=model.tie_embeddings,
            block_kinds=kinds,
            parallel_groups=groups,
            parallel_ffn_hidden_dim=max(wide, 1),
            moe=moe_args(model, hidden),
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.moe.n_dense_layers


def moe_args(model: ModelConfig, ffn_hidden_dim: int) -> MoEArgs | None:
    """The MoE sizes; an expert's default width splits the dense FFN's over the top_k experts
    a token uses, so an MoE block costs per token about what the dense block costs."""
    if model.n_experts == 0:
        return None
    hidden = model.expert_hidden_dim or max(ffn_hidden_dim // max(model.top_k, 1), 1)
    return MoEArgs(
        n_experts=model.n_experts,
        top_k=model.top_k,
        score_func=model.score_func,
        route_norm=model.route_norm,
        hidden_dim=hidden,
        n_shared_experts=model.n_shared_experts,
        n_dense_layers=model.n_dense_layers,
        aux_loss_coeff=model.aux_loss_coeff,
        bias_update_rate=model.bias_update_rate,
    )


def rope_angles(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Rotary angles, shape (max_seq_len, head_dim/2), real (cos/sin are taken in forward).

    Real angles instead of a complex tensor: complex buffers do not mix well with DTensor.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    return torch.outer(positions, inv_freq)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, seq, heads, head_dim) by angles (seq, head_dim/2)."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    cos = angles.cos()[None, :, None, :]
    sin = angles.sin()[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a TP-sharded DTensor, or a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, or (groups > 1) over each of `groups` equal slices of it."""

    def __init__(self, dim: int, eps: float, groups: int = 1) -> None:
        super().__init__()
        self.eps = eps
        self.group_dim = dim // groups
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups == 1:
            return self._norm(x.float()).type_as(x) * self.weight
        # Grouped: x holds whole slices (all of them, or this TP rank's); each is normalised on
        # its own, so a rank never needs another rank's slice.
        normed = self._norm(x.float().unflatten(-1, (-1, self.group_dim))).flatten(-2)
        return normed.type_as(x) * local(self.weight)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GroupedLinear(nn.Module):
    """`groups` independent Linears, i.e. one Linear with a block-diagonal weight.

    The weight is stored as (groups * out_features, in_features), group after group along
    dim 0: TP shards dim 0 into whole groups (Shard(0)) and FSDP shards dim 0 as it does for
    any Linear. Input (..., g * in_features) -> output (..., g * out_features), where g is the
    number of groups present locally (all of them, or this TP rank's).
    """

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight).unflatten(0, (-1, self.out_features))
        x = x.unflatten(-1, (-1, self.in_features))
        return torch.einsum("...gi,goi->...go", x, weight).flatten(-2)


def make_linear(in_features: int, out_features: int, groups: int) -> nn.Module:
    """A Linear from `in_features*groups` to `out_features*groups` (block-diagonal if groups>1)."""
    if groups == 1:
        return nn.Linear(in_features, out_features, bias=False)
    return GroupedLinear(in_features, out_features, groups)


class Attention(nn.Module):
    """Grouped-query attention; with groups > 1 each slice of the hidden state has its own
    n_heads/groups heads (the heads of all slices just run side by side)."""

    def __init__(self, args: ModelArgs, groups: int = 1) -> None:
        super().__init__()
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        dim, hd = args.dim // groups, args.head_dim
        q_heads, kv_heads = args.n_heads // groups, args.n_kv_heads // groups
        self.wq = make_linear(dim, q_heads * hd, groups)
        self.wk = make_linear(dim, kv_heads * hd, groups)
        self.wv = make_linear(dim, kv_heads * hd, groups)
        self.wo = make_linear(q_heads * hd, dim, groups)
        # Swappable kernel: context parallel replaces it with one that gathers K/V.
        self.sdpa: SdpaFn = causal_sdpa

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # -1 heads, not n_heads: under TP each rank holds n_heads/tp of them.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        # Grouped-query attention: each K/V head serves n_rep query heads.
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU; with groups > 1, one per slice of the hidden state (`hidden_dim` each)."""

    def __init__(self, dim: int, hidden_dim: int, groups: int = 1) -> None:
        super().__init__()
        self.w1 = make_linear(dim // groups, hidden_dim, groups)
        self.w2 = make_linear(hidden_dim, dim // groups, groups)
        self.w3 = make_linear(dim // groups, hidden_dim, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)


class SyncPoint(nn.Module):
    """The identity in the model's math; the TP plan turns it into the one communication point
    of a single_sync block (parallelize.tp_plan), so the model itself stays TP-agnostic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kind = args.block_kinds[layer_id]
        groups = args.parallel_groups if self.kind == "parallel" else 1
        hidden = args.parallel_ffn_hidden_dim if self.kind == "parallel" else args.ffn_hidden_dim
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, groups)
        self.attention = Attention(args, groups)
        # single_sync: one norm feeds attention and MLP (GPT-J), so under TP one replicated
        # input serves both and its gradient is all-reduced once.
        self.ffn_norm: RMSNorm | None = (
            None if self.kind == "single_sync" else RMSNorm(args.dim, args.norm_eps, groups)
        )
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.moe is not None and args.is_moe_layer(layer_id):
            shared = None
            if args.moe.n_shared_experts:
                shared = FeedForward(args.dim, args.moe.n_shared_experts * args.moe.hidden_dim)
            self.moe = MoE(args.dim, args.moe, shared)
        else:
            self.feed_forward = FeedForward(args.dim, hidden, groups)
        if self.kind == "single_sync":
            self.sync_in = SyncPoint()
            self.sync_out = SyncPoint()
        # Depth-scaled init of the output projections (as torchtitan does).
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        # Set by parallelize.apply_activation_checkpointing. Checkpointing happens *inside*
        # forward so FSDP's hooks on this module stay outside the recomputed region, and the
        # parameter names do not change (no wrapper module).
        self.activation_checkpoint = False

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpoint and torch.is_grad_enabled():
            out: torch.Tensor = torch.utils.checkpoint.checkpoint(
                self._forward, x, angles, use_reentrant=False
            )
            return out
        return self._forward(x, angles)

    def _forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        if self.kind == "single_sync":
            # Attention and MLP side by side from the same normed input (GPT-J); under TP both
            # row-parallel outputs stay partial sums, added, then reduced once in sync_out.
            normed = self.sync_in(self.attention_norm(x))
            mixed = self.attention(normed, angles) + self.mlp(normed)
            return x + self.sync_out(mixed)
        # standard, and parallel (the same code on block-diagonal, grouped modules).
        assert self.ffn_norm is not None
        h = x + self.attention(self.attention_norm(x), angles)
        return h + self.mlp(self.ffn_norm(h))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The block's FFN: the dense SwiGLU, or the mixture of experts."""
        if self.moe is not None:
            return self.moe(x)
        assert self.feed_forward is not None
        return self.feed_forward(x)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        if self.ffn_norm is not None:
            self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std)
        else:
            assert self.feed_forward is not None
            self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Sequence shards of a hidden-state input (tp under sequence parallel, set by
        # parallelize.apply_tp): the rotary table must cover the whole local sequence.
        self.hidden_seq_shards = 1
        # Default rotary offset of forward (set per CP rank for PP stages).
        self.position_offset = 0
        # Not persistent: it is a function of the config, so it stays out of checkpoints and
        # is recomputed by init_buffers() after to_empty().
        self.register_buffer(
            "freqs_cis",
            rope_angles(args.head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )

    def forward(self, tokens: torch.Tensor, position_offset: int | None = None) -> torch.Tensor:
        """tokens (batch, seq) ids -> logits (batch, seq, vocab).

        On a PP stage without tok_embeddings, `tokens` is the previous stage's hidden state
        (batch, seq, dim); without `output` the hidden state is returned. `position_offset`
        is the absolute position of the first token (context parallel rank r of a sequence of
        length L*cp holds positions [r*L, (r+1)*L) and needs those rotary angles); None means
        the attribute `self.position_offset` (how PP stages, which get no kwargs, learn it).
        """
        if position_offset is None:
            position_offset = self.position_offset
        if self.tok_embeddings is not None:
            seq_len = tokens.shape[1]
            h = self.tok_embeddings(tokens)
        else:
            # A PP stage's input hidden state is sequence-sharded under sequence parallel.
            h, seq_len = tokens, tokens.shape[1] * self.hidden_seq_shards
        angles = self.freqs_cis[position_offset : position_offset + seq_len]
        for layer in self.layers.values():
            h = layer(h, angles)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place (works on sharded DTensors too)."""
        self.init_buffers()
        if self.tok_embeddings is not None:
            # Tied weights double as the output projection: scale them so logits start O(1).
            std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            assert isinstance(layer, TransformerBlock)
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            # Scale with 1/sqrt(dim) so initial logits are O(1) and the first loss ~ log(vocab).
            bound = 3 / self.args.dim**0.5
            nn.init.trunc_normal_(
                self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-bound, b=bound
            )

    def retie(self) -> None:
        """Share the output and embedding weights again (to_empty() unties them)."""
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary table on whatever device the model now lives on."""
        device = self.freqs_cis.device
        self.freqs_cis: torch.Tensor = rope_angles(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta
        ).to(device)


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    """The full model, by default on the meta device (no memory, shapes only)."""
    with torch.device(device):
        return Transformer(args)


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters of the full model (sharded params count in full)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total
