"""The norms both trainers log, measured the same way: the full gradient's and the optimizer
update's L2 norm, in total and per part of the model, whatever mixture of meshes (FSDP, TP,
HSDP, PP stages) the parameters live on. The built-in trainer's optimizer step
(convergence/trainer/optim.py) and the torchtitan launcher's step log
(convergence/backends/torchtitan/step_log.py) call these, so a builtin and a torchtitan job
measure with one definition."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


def shard_groups(grad: DTensor) -> tuple[ProcessGroup, ...]:
    """Process groups of the mesh dims along which `grad` is sharded (not replicated)."""
    groups = []
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise RuntimeError(
                f"gradient with a Partial placement on mesh dim {dim}: it has "
                "not been reduced, so its norm would be wrong"
            )
        # Not `is_shard()`: FSDP over a TP-sharded dim uses _StridedShard, which is no Shard.
        if not placement.is_replicate():
            groups.append(grad.device_mesh.get_group(dim))
    return tuple(groups)


def parameter_part(name: str) -> str:
    """The part of the model a parameter belongs to, the same for every layer and layout:
    "layers.3.attention.wq.weight" -> "attention.wq", "_checkpoint_wrapped_module" and
    torch.compile's "_orig_mod" wrappers dropped, "tok_embeddings.weight" -> "tok_embeddings"."""
    kept = [p for p in name.split(".") if p and not p.startswith("_") and not p.isdigit()]
    if kept and kept[0] == "layers":
        kept = kept[1:]
    if len(kept) > 1 and kept[-1] in ("weight", "bias"):
        kept = kept[:-1]
    return ".".join(kept)


@torch.no_grad()
def grad_norms(
    named_params: Iterable[tuple[str, nn.Parameter]],
    parts: tuple[str, ...],
    pp_group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of the FULL gradient, and of each part's (`parts`, per parameter_part), whatever
    mixture of meshes the parameters live on (sharded_norms).

    Why per part: the total is dominated by the largest gradients (embeddings, output), so a
    bug confined to one kind of weight can hide in it. A rotary offset dropped under context
    parallelism moves the query/key gradients by ~3e-3 relative at step 1 but the total by
    less than the paired tolerance (2e-5); per part it is 100x outside.
    """
    local = []
    for name, param in named_params:
        grad = param.grad
        if grad is None:
            continue
        groups = shard_groups(grad) if isinstance(grad, DTensor) else ()
        local.append((name, grad.to_local() if isinstance(grad, DTensor) else grad, groups))
    return sharded_norms(local, parts, pp_group)


Sharded = tuple[str, torch.Tensor, tuple[ProcessGroup, ...]]
"""(parameter name, this rank's local piece of a tensor shaped like it, the groups it is
sharded over: shard_groups)."""


@torch.no_grad()
def sharded_norms(
    pieces: Iterable[Sharded], parts: tuple[str, ...], pp_group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of the FULL tensor whose local pieces these are, and of each part's.

    The squared norm is a sum over every element of the global tensor. A DTensor holds a
    slice: its local sum of squares must be summed over the mesh dims it is *sharded* on, and
    not over the dims it is *replicated* on (that would count it several times). So pieces
    are bucketed by the tuple of groups to sum over -- e.g. (dp,) for a norm weight under
    FSDP+TP, (dp, tp) for a TP-sharded linear -- each bucket is all-reduced over those groups
    in turn (orthogonal mesh dims, so the result is the sum over their product), and the
    buckets are added. Pipeline stages hold disjoint parameters: add over the pp group.
    Plain tensors (single process, DDP) are complete on every rank.
    Accumulated in float64 so the norm is not the noisiest number in the comparison.
    Each bucket carries [total, part 1, ..., part K] in one tensor: one all-reduce per bucket.
    """
    index = {part: i + 1 for i, part in enumerate(parts)}
    buckets: dict[tuple[ProcessGroup, ...], torch.Tensor] = {}
    device = None
    for name, local, groups in pieces:
        device = device or local.device
        square = local.detach().double().pow(2).sum()
        if groups not in buckets:
            buckets[groups] = torch.zeros(len(parts) + 1, dtype=torch.float64, device=local.device)
        bucket = buckets[groups]
        bucket[0] += square
        slot = index.get(parameter_part(name)) if parts else None
        if slot is not None:
            bucket[slot] += square
    total = torch.zeros(len(parts) + 1, dtype=torch.float64, device=device)
    for groups, squares in buckets.items():
        for group in groups:
            dist.all_reduce(squares, group=group)
        total = total + squares
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norms = total.sqrt()
    return norms[0], norms[1:]


def parts_geomean(part_norms: torch.Tensor) -> float:
    """The geometric mean of the parts' norms that are not zero: one number that moves by the
    AVERAGE relative change of the parts (the total moves by the change of the largest), so a
    bug in any one kind of weight shows (module docstring of convergence.stats.paired_band)."""
    values = [float(v) for v in part_norms if float(v) > 0]
    if not values:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def local_pieces(named_params: Iterable[tuple[str, nn.Parameter]]) -> list[Sharded]:
    """Each parameter's local piece (a clone: the state before the step) and its groups."""
    pieces = []
    for name, param in named_params:
        data = param.detach()
        groups = shard_groups(data) if isinstance(data, DTensor) else ()
        local = data.to_local() if isinstance(data, DTensor) else data
        pieces.append((name, local.clone(), groups))
    return pieces


@torch.no_grad()
def update_norms(
    named_params: Iterable[tuple[str, nn.Parameter]],
    before: list[Sharded],
    parts: tuple[str, ...],
    pp_group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms (total, per part) of each parameter's change since `before` (local_pieces).

    Why the update and not only the gradient: the gradient norm is measured before clipping,
    so it cannot see what happens after -- a clipping coefficient computed from a rank's
    LOCAL norm (a PP stage or TP rank without the all-reduce), a wrong learning rate, a
    dropped or doubled optimizer state -- and Adam hides much of it from the loss for many
    steps (it is invariant to a constant gradient scale; only the step-to-step change of a
    wrong clipping coefficient moves its update, from step 2). The change of the parameters is
    what the optimizer actually applied, measured from outside the optimizer: the difference
    of two float32 values is exact in float64, so the norm carries the update's own rounding
    only, like the gradient's.
    """
    diffs = []
    for (name, param), (_, old, groups) in zip(named_params, before, strict=True):
        data = param.detach()
        new = data.to_local() if isinstance(data, DTensor) else data
        diffs.append((name, new.double() - old.double(), groups))
    return sharded_norms(diffs, parts, pp_group)
