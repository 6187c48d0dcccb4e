"""Bugs in what each rank reads: a context-parallel mask or rotary angles without the shard
offset, and data ranks that all read the same shard.

Both monkeypatch the trainer inside the rank process (the hook runs on every rank before the
first step), which is how the real bugs live: in a kernel and in a sampler, not in a layer plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convergence.trainer import data as trainer_data
from convergence.trainer.context_parallel import _gather_seq, causal_mask_with_offset
from convergence.trainer.hooks import HookContext


def cp_mask_without_offset(model: nn.Module, ctx: HookContext) -> None:
    """Context parallel: the causal mask compares local query indices with global key indices.

    Real bug: ring/all-gather attention on sequence chunks that builds its causal mask as if
    every rank held the start of the sequence (``is_causal=True``, or an offset of 0). CP rank
    r > 0 then lets its query i (global position r*L + i) see only keys 0..i: it misses its own
    chunk and most of the past. The loss is wrong from the first step (on those ranks' tokens).
    Planted: each block's CP attention kernel swapped for one with q_offset = 0.
    """
    if ctx.mesh is None or ctx.config.parallelism.cp == 1:
        return
    group = ctx.mesh["cp"].get_group()

    def cp_sdpa_no_offset(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        local_len = q.shape[2]
        size = torch.distributed.get_world_size(group)
        k_all, v_all = _gather_seq(k, group), _gather_seq(v, group)
        if k_all.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k_all.shape[1]
            k_all = k_all.repeat_interleave(repeats, dim=1)
            v_all = v_all.repeat_interleave(repeats, dim=1)
        mask = causal_mask_with_offset(local_len, size * local_len, 0, q.device)  # BUG: 0
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

    for block in model.layers.values():  # type: ignore[union-attr, operator]
        block.attention.sdpa = cp_sdpa_no_offset


def cp_rope_without_offset(model: nn.Module, ctx: HookContext) -> None:
    """Context parallel: every CP rank applies the rotary angles of positions 0..L-1.

    Real bug: a sequence-sharded model that builds its position ids (or slices its rotary
    cache) per local chunk, forgetting the chunk's global offset r*L. The causal mask is right,
    only the relative positions between a rank's queries and the other chunks' keys are wrong,
    so nothing moves until the model relies on where a token is: on data that needs no
    positions (a first-order Markov language) it goes unseen for many steps.
    Planted: the model's rotary offset (Transformer.position_offset, which the trainer sets to
    r*L before the hooks run) put back to 0 on every rank.
    """
    if ctx.config.parallelism.cp == 1:
        return
    model.position_offset = 0  # BUG: the chunk's offset is dropped


_ORIGINAL_INDICES = trainer_data.BatchPlan.indices


def _rank0_indices(self: trainer_data.BatchPlan, step: int, microstep: int) -> np.ndarray:
    return _ORIGINAL_INDICES(dataclasses.replace(self, dp_rank=0), step, microstep)


def every_dp_rank_reads_rank0_shard(model: nn.Module, ctx: HookContext) -> None:
    """Data-parallel ranks all read the same shard (inputs AND labels).

    Real bug: a sampler built without the rank (``DistributedSampler(ds)`` outside the
    process group's view, ``rank=0`` hard-coded, or a seed that makes every rank draw the same
    permutation). Every rank trains on rank 0's samples: the loss is a perfectly plausible,
    smoothly falling curve -- of the wrong data (half the tokens of every step are repeats).
    Planted: the trainer's batch plan computes every rank's indices as rank 0's.
    """
    trainer_data.BatchPlan.indices = _rank0_indices  # type: ignore[method-assign]
