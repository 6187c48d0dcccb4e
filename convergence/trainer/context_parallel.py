"""Context parallelism (CP) that is correct on every backend, CPU/gloo included.

Each CP rank r of `cp` holds the contiguous chunk r of every sample's sequence:
tokens [r*L, (r+1)*L) with L = seq_len / cp. Everything in a transformer is per token except
attention, so only attention has to see the other chunks: each rank all-gathers K and V along the
sequence (autograd-aware, so the backward sends every rank the gradient of its own K/V chunk) and
attends its local queries to the full keys with a causal mask shifted by its chunk offset.

Why not `torch.distributed.tensor.experimental.context_parallel`: it swaps SDPA for a ring
attention that has no CPU sharding rule, so it cannot run under gloo, where CI runs. The all-gather
form below costs O(seq) memory for K/V per rank instead of O(seq/cp), which is fine for a reference
trainer whose job is to be right; on CUDA it still works (SDPA with an explicit mask picks the
memory-efficient or math kernel instead of flash).

How the trainer uses it (per microbatch; tokens/targets are (batch, seq)):

    tokens = shard_sequence(tokens, cp_mesh)           # (batch, seq/cp), chunk r
    targets = shard_sequence(targets, cp_mesh)
    for block in model.layers.values():                 # once, after building the model
        block.attention.sdpa = make_cp_sdpa(cp_mesh)
    logits = model(tokens, position_offset=cp_position_offset(seq_len, cp_mesh))
    # (or set model.position_offset once: PP stages get no forward kwargs from the schedule)
    loss = cross_entropy(logits, targets)               # mean over the LOCAL tokens

Gradients: rank r's backward yields d(sum_s loss_s)/d(params) through rank r's own tokens (the
all-gather backward sums every rank's K/V gradients onto the owner). Summing over the CP group
gives d(sum_s loss_s)/d(params), so *averaging* over CP gives the gradient of the full-sequence
mean loss (chunks hold equal token counts). The trainer gets that for free by reducing gradients
(FSDP reduce-scatter / DDP all-reduce, both averaging) over the flattened dp x cp mesh, as
torchtitan does; the logged loss is likewise the mean over dp x cp of the local losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

SdpaFn = Callable[[Tensor, Tensor, Tensor], Tensor]
CpGroup = DeviceMesh | ProcessGroup | None
"""A 1-D DeviceMesh of the CP axis, its ProcessGroup, or None (= the default group)."""


def _group(cp_mesh: CpGroup) -> ProcessGroup:
    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(
                f"context parallel needs a 1-D mesh of the cp axis, got {cp_mesh}; "
                "pass world_mesh['cp']"
            )
        return cp_mesh.get_group()
    group = cp_mesh if cp_mesh is not None else dist.group.WORLD
    assert group is not None, "init_process_group() must run before context parallel"
    return group


def cp_rank_and_size(cp_mesh: CpGroup) -> tuple[int, int]:
    """(rank in the CP group, CP degree)."""
    group = _group(cp_mesh)
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(t: Tensor, cp_mesh: CpGroup, dim: int = 1) -> Tensor:
    """The contiguous chunk r of `t` along `dim` (r = this rank's CP index)."""
    rank, size = cp_rank_and_size(cp_mesh)
    if t.shape[dim] % size:
        raise ValueError(
            f"sequence length {t.shape[dim]} is not divisible by cp={size}: "
            "set data.seq_len to a multiple of parallelism.cp"
        )
    return t.chunk(size, dim=dim)[rank].contiguous()


def cp_position_offset(seq_len: int, cp_mesh: CpGroup) -> int:
    """Global position of this rank's first token: r * seq_len/cp (for the rotary angles)."""
    rank, size = cp_rank_and_size(cp_mesh)
    if seq_len % size:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by cp={size}: "
            "set data.seq_len to a multiple of parallelism.cp"
        )
    return rank * (seq_len // size)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 in the forward; in the backward each rank gets the sum over ranks
    of the gradient of its own chunk (a reduce-scatter), i.e. d(sum of all ranks' losses)/d(chunk).

    Plain, synchronous c10d collectives on tensors this function owns until they complete.
    Why not torch's functional collectives (``all_gather_tensor_autograd`` /
    ``all_gather_single_autograd``): on gloo they crashed natively (SIGSEGV inside the c10d
    functional op, forward or backward) in about 1 of 12 PP+CP runs of the unit-test worker
    here on torch 2.13 -- asynchronous ops whose buffers gloo still uses. Why not
    ``torch.distributed.nn.functional.all_gather`` (deprecated): on gloo its backward emulates
    reduce-scatter with all-to-all into ``empty_like`` buffers, which keep the permuted strides of
    SDPA's K/V gradient while gloo writes them as contiguous, scrambling dK/dV (measured here:
    max |dK error| ~3.9 for cp=2, while the forward was exact).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, chunk: Tensor, group: ProcessGroup
    ) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        chunk = chunk.contiguous()
        out = chunk.new_empty((size * chunk.shape[0], *chunk.shape[1:]))
        dist.all_gather_into_tensor(out, chunk, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        group: ProcessGroup = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        grad = grad.clone(memory_format=torch.contiguous_format)  # ours to reduce in place
        if dist.get_backend(group) == "gloo":
            # gloo has no native reduce-scatter: sum everything, keep our chunk (the extra
            # traffic is irrelevant at the sizes a CPU reference run uses).
            dist.all_reduce(grad, group=group)
            return grad.chunk(size, dim=0)[rank].contiguous(), None
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def _gather_seq(t: Tensor, group: ProcessGroup) -> Tensor:
    """All-gather (batch, heads, L, d) chunks into (batch, heads, cp*L, d), autograd-correct.

    The gather runs on dim 0, so the sequence dim is moved there first (see _GatherSequence
    for the backward and for why not torch's own autograd collectives).
    """
    gathered: Tensor = _GatherSequence.apply(t.movedim(2, 0), group)
    return gathered.movedim(0, 2)


def causal_mask_with_offset(
    local_len: int, total_len: int, q_offset: int, device: torch.device
) -> Tensor:
    """Boolean (local_len, total_len) mask, True where query i may attend to key j.

    Query i is the token at GLOBAL position q_offset + i, while the gathered keys are in global
    order 0..total_len-1. A plain causal mask (`is_causal=True`, i.e. j <= i) would compare a
    local query index with a global key index: rank r > 0 would then see only the first keys of
    the sequence and miss its own chunk. Shifting the query positions by the offset restores
    "attend to every key at or before my own global position".
    """
    q_pos = torch.arange(local_len, device=device) + q_offset
    k_pos = torch.arange(total_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def make_cp_sdpa(cp_mesh: CpGroup) -> SdpaFn:
    """A drop-in causal `sdpa(q, k, v)` for (batch, heads, local_seq, head_dim) CP chunks.

    k and v may have fewer heads than q (grouped-query attention, not yet expanded): they are
    gathered as they are (cheaper) and expanded afterwards.
    """
    group = _group(cp_mesh)

    def cp_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        local_len = q.shape[2]
        k_all = _gather_seq(k, group)
        v_all = _gather_seq(v, group)
        if k_all.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k_all.shape[1]
            k_all = k_all.repeat_interleave(repeats, dim=1)
            v_all = v_all.repeat_interleave(repeats, dim=1)
        mask = causal_mask_with_offset(local_len, size * local_len, rank * local_len, q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

    return cp_sdpa
