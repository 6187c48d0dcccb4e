"""What the numerics probe records on a rank and how it reduces it, the same in both trainers:
the built-in trainer's probe (convergence/trainer/probe.py) and the torchtitan launcher's
(convergence/backends/torchtitan/probe.py) hook every module with ``OutputRecorder``, reduce
with ``module_sumsq`` / ``grad_sumsq`` over the ``Meshes`` (meshes.py) and gather the pipeline
stages' rows, so their probe.json files compare module by module.

Why every number is layout independent (so two layouts can be compared module by module):
- A norm is of the FULL tensor, never of a local shard. The squared norm of a module's output
  is summed over every call in the step (microsteps, PP microbatches) and over the dp x cp ranks
  (each holds distinct samples or sequence chunks), so it is the norm of that module's output
  over the whole global batch, whatever the split.
- Under TP a plain-tensor output is either replicated (e.g. after a row-wise all-reduce) or a
  shard (column-wise outputs; sequence-parallel regions). The probe does not guess from the
  plan: it compares the TP ranks' (sum of squares, sum) of each call, and counts a tensor once
  when all ranks hold the same bits, else sums the ranks' squares. DTensor outputs are
  gathered with `full_tensor()`.
- Gradient norms use the placements of each DTensor gradient (sum over the mesh dims it is
  sharded on, as norms.py sharded_norms does); plain gradients (DDP, no DP) are complete.
- Names are module FQNs with wrapper segments removed (`_checkpoint_wrapped_module.`,
  `_orig_mod.`, `_fsdp_wrapped_module.`); PP stages keep their global layer names; records of
  all PP ranks are gathered and put in forward order (stage index, then call order).

"Forward order" is the order in which modules *finish* their forward: `attention.wo` comes
before `attention`, so the first differing module is the innermost one that went wrong.
Calls during backward (activation-checkpoint recomputation) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from convergence.rank.meshes import Meshes
from convergence.rank.norms import shard_groups

# Renamed in torch 2.13 (the old name still works, with a FutureWarning).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


PROBE_VERSION = 1


#: FQN segments added by wrappers (activation checkpointing, torch.compile, FSDP1).
WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}
)


def clean_fqn(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attention`` -> ``layers.0.attention``."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


@dataclass(kw_only=True)
class _ModuleRecord:
    name: str
    stage: int
    order: int
    """Rank-local sequence number of the first completed forward (for forward order)."""
    calls: list[tuple[float, float, bool]] = field(default_factory=list)
    """Per call: (local sum of squares, local sum, whether it is already the full tensor)."""


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


class OutputRecorder:
    """Forward hooks on every submodule of the chunks, recording local output statistics."""

    def __init__(self, chunks: list[tuple[int, nn.Module]]) -> None:
        self.records: dict[str, _ModuleRecord] = {}
        self._next = 0
        self._handles = []
        for stage, chunk in chunks:
            for raw, module in chunk.named_modules():
                name = clean_fqn(raw)
                if not name or name in self.records:
                    continue  # the chunk root, or a wrapper and its inner module (same output)
                self.records[name] = _ModuleRecord(name=name, stage=stage, order=-1)
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # Inside the autograd engine = activation-checkpoint recomputation: not a new call.
            if torch._C._current_graph_task_id() != -1:
                return
            record = self.records[name]
            if record.order < 0:
                record.order, self._next = self._next, self._next + 1
            with torch.no_grad():
                for t in _tensors(output):
                    full = isinstance(t, DTensor)
                    x = (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()
                    record.calls.append((x.pow(2).sum().item(), x.sum().item(), full))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def module_sumsq(
    recorder: OutputRecorder, meshes: Meshes | None, device: torch.device
) -> list[dict[str, Any]]:
    """This stage's modules with the squared norm of their full output over the global batch."""
    records = sorted(
        (r for r in recorder.records.values() if r.calls), key=lambda r: (r.stage, r.order)
    )
    if not records:
        return []
    flat = torch.tensor(
        [[sq, s, float(full)] for r in records for sq, s, full in r.calls],
        dtype=torch.float64,
        device=device,
    )
    if meshes is not None and meshes.tp is not None:
        tp = meshes.tp.size()
        # Gloo wants the output as (tp * rows, cols): gather flat, then split by rank.
        gathered = torch.empty((tp * flat.shape[0], 3), dtype=flat.dtype, device=device)
        all_gather_into(gathered, flat, group=meshes.tp.get_group())
        gathered = gathered.view(tp, *flat.shape)
        # Same bits on every TP rank (or already gathered): one copy; else shards: add them.
        same = (gathered[:, :, :2] == flat[None, :, :2]).all(dim=2).all(dim=0)
        replicated = same | (flat[:, 2] > 0)
        per_call = torch.where(replicated, flat[:, 0], gathered[:, :, 0].sum(dim=0))
    else:
        per_call = flat[:, 0]
    counts = [len(r.calls) for r in records]
    per_module = torch.stack([chunk.sum() for chunk in torch.split(per_call, counts)])
    if meshes is not None and meshes.dp_cp.size() > 1:
        dist.all_reduce(per_module, group=meshes.dp_cp.get_group())
    return [
        {
            "name": r.name,
            "stage": r.stage,
            "order": r.order,
            "sumsq": float(v),
            "calls": len(r.calls),
        }
        for r, v in zip(records, per_module.tolist(), strict=True)
    ]


def grad_sumsq(chunks: list[tuple[int, nn.Module]], device: torch.device) -> list[dict[str, Any]]:
    """This stage's parameters with the squared norm of their full gradient."""
    entries: list[tuple[str, int, int, torch.Tensor, tuple[Any, ...]]] = []
    seen: set[int] = set()
    for stage, chunk in chunks:
        for index, (raw, param) in enumerate(chunk.named_parameters()):
            if id(param) in seen:
                continue
            seen.add(id(param))
            grad = param.grad
            groups: tuple[Any, ...] = ()
            if grad is None:
                square = torch.full((), float("nan"), dtype=torch.float64, device=device)
            else:
                local = grad
                if isinstance(grad, DTensor):
                    groups, local = shard_groups(grad), grad.to_local()
                square = local.detach().double().pow(2).sum()
            entries.append((clean_fqn(raw), stage, index, square, groups))
    # One all-reduce per distinct group set (ranks of a group hold the same parameters).
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, entry in enumerate(entries):
        buckets.setdefault(entry[4], []).append(i)
    values = [e[3] for e in entries]
    for groups, indices in buckets.items():
        if not groups:
            continue
        stacked = torch.stack([values[i] for i in indices])
        for group in groups:
            dist.all_reduce(stacked, group=group)
        for i, v in zip(indices, stacked, strict=True):
            values[i] = v
    return [
        {"name": name, "stage": stage, "order": index, "sumsq": float(v)}
        for (name, stage, index, _, _), v in zip(entries, values, strict=True)
    ]


def gather_over_stages(obj: Any, meshes: Meshes | None) -> list[Any]:
    """Each pipeline stage's rows, gathered over the PP mesh (the one list where there is no PP)."""
    if meshes is None or meshes.pp is None:
        return [obj]
    out: list[Any] = [None] * meshes.pp.size()
    dist.all_gather_object(out, obj, group=meshes.pp.get_group())
    return out


def in_forward_order(rows: list[dict[str, Any]], with_calls: bool) -> list[dict[str, Any]]:
    rows = sorted(rows, key=lambda r: (r["stage"], r["order"]))
    out = []
    for r in rows:
        item = {"name": r["name"], "norm": r["sumsq"] ** 0.5 if r["sumsq"] == r["sumsq"] else None}
        if with_calls:
            item["calls"] = r["calls"]
        out.append(item)
    return out
