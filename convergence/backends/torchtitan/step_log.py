"""The launcher's per-step records, from the batches and gradients torchtitan itself uses, with
the built-in trainer's names and definitions (one JSON line per step, rank 0):

- ``data_fingerprint``: the sum of ``convergence.rank.sample_hash.sample_hash`` over every
  sample of the global batch, mod 2**48;
- ``grad_norm``: the total gradient norm, summed in float64 from each rank's local shards
  (``convergence.rank.norms.grad_norms``, the built-in trainer's function too), just before
  torchtitan clips. torchtitan's own norm (``torch.nn.utils.get_total_norm``: a float32
  foreach norm whose summation order follows the shards) moves by ~2e-5 relative between a
  layout and its TP variant on the debug model, the size of a real bug's signal; the float64
  sum moves by the gradients' own rounding only. torchtitan's value is kept as
  ``torchtitan_grad_norm`` (and in its TensorBoard and console lines, unchanged);
- ``grad_norm/<part>`` per part of the model (``attention.wq``, ``feed_forward.w2``,
  ``attention_norm``, ``tok_embeddings``, ...: ``convergence.rank.norms.parameter_part``),
  and ``grad_norm_parts``, their geometric mean;
- ``update_norm``, ``update_norm/<part>`` and ``update_norm_parts``: the norms of the
  parameters' change in the optimizer step (``convergence.rank.norms.update_norms``: a copy
  of each rank's shards taken once the step's gradients are complete -- clipping changes
  gradients only -- against the shards after its optimizers stepped) -- what the optimizer
  applied, after torchtitan's own clipping: a clipping bug (a PP stage clipping with its local
  norm) leaves ``grad_norm`` right and shows here.

The same norms go into torchtitan's TensorBoard folder as ``convergence/grad_norm``,
``convergence/grad_norm_parts`` and ``convergence/update_norm_parts`` (``TB_TAGS``), so a job
followed live is judged on them too. The step's line is written at the end of its step.

Who calls what, when: convergence/backends/torchtitan/trainer_class.py (``ConvergenceTrainer``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convergence.backends.torchtitan.argv import TB_TAGS
from convergence.rank.norms import (
    Sharded,
    grad_norms,
    local_pieces,
    parameter_part,
    parts_geomean,
    update_norms,
)
from convergence.rank.sample_hash import FINGERPRINT_BITS, sample_hash


class StepLog:
    """Collects what a step read and its gradients (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.digest = 0
        self.parts: tuple[str, ...] | None = None
        #: This step's record (every rank computes the same norms; rank 0 writes it): its
        #: gradients' and torchtitan's norm, then its update's.
        self.record: dict[str, float | int] = {}
        self.updates: dict[str, float] = {}
        #: This rank's parameter shards before the optimizers step.
        self.before: list[Sharded] | None = None
        #: The optimizers stepped since the record was made (its line is due).
        self.stepped = False
        self.pp_group: Any = None

    def on_batch(self, input_dict: dict[str, Any], labels: Any) -> None:
        self.digest += sample_hash(input_dict["input"], labels)

    def on_grads(self, named: list[tuple[str, Any]], parallel_dims: Any, *, step: int) -> None:
        """Optimizer step ``step``'s gradients are complete (its last backward ran; torchtitan
        clips next): its fingerprint and gradient norms, and one copy of this rank's parameter
        shards as they are before the optimizers step (clipping changes gradients only)."""
        import torch
        import torch.distributed as dist

        digest = torch.tensor([self.digest % 2**FINGERPRINT_BITS], dtype=torch.int64)
        self.digest = 0
        # Summed over the ranks that read different samples only (TP/PP ranks hold copies).
        mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims.dp_enabled else None
        if mesh is not None:
            dist.all_reduce(digest, group=mesh.get_group())
        pp_mesh = parallel_dims.get_optional_mesh("pp")
        pp_group = pp_mesh.get_group() if pp_mesh is not None else None
        self.pp_group = pp_group
        if self.parts is None:
            self.parts = model_parts(named, pp_group)
        total, part_norms = grad_norms(named, self.parts, pp_group)
        self.record = {
            "step": step,
            "data_fingerprint": int(digest.item()) % 2**FINGERPRINT_BITS,
            "grad_norm": float(total),
            "grad_norm_parts": parts_geomean(part_norms),
            **{
                f"grad_norm/{part}": float(norm)
                for part, norm in zip(self.parts, part_norms.tolist(), strict=True)
            },
        }
        self.updates = {}
        self.stepped = False
        self.before = local_pieces(named)

    def on_stepped(self, named: list[tuple[str, Any]]) -> None:
        """After torchtitan's optimizers stepped: the update's norms. Every rank calls it (the
        norms are collectives)."""
        if self.before is None or self.parts is None:
            return  # a step without our gradient record (none in torchtitan 0.3's loop)
        total, part_norms = update_norms(named, self.before, self.parts, self.pp_group)
        self.before = None
        self.stepped = True
        self.updates = {
            "update_norm": float(total),
            "update_norm_parts": parts_geomean(part_norms),
            **{
                f"update_norm/{part}": float(norm)
                for part, norm in zip(self.parts, part_norms.tolist(), strict=True)
            },
        }

    def on_metrics(self, step: int, torchtitan_norm: float) -> bool:
        """torchtitan's metrics line of ``step`` (its ``grad_norm``: the norm it clipped with);
        whether it is this record's step."""
        if self.record.get("step") != step:
            return False
        self.record["torchtitan_grad_norm"] = torchtitan_norm
        return True

    def write(self) -> None:
        """The step's line (rank 0), once its optimizers stepped; at the end of each step.
        A step whose metrics line never came (torchtitan raises on a non-finite loss before
        it logs) is written without ``torchtitan_grad_norm``."""
        import torch.distributed as dist

        if not self.stepped:
            return
        self.stepped = False
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        with self.path.open("a") as fh:
            # The gradients' keys, torchtitan's norm, then the update's (the line's order).
            fh.write(json.dumps({**self.record, **self.updates}) + "\n")

    def tensorboard_extras(self) -> dict[str, float]:
        """This step's norms under ``TB_TAGS``' names."""
        record = {**self.record, **self.updates}
        return {tag: float(record[name]) for tag, name in TB_TAGS.items() if name in record}


def model_parts(named: list[tuple[str, Any]], pp_group: Any) -> tuple[str, ...]:
    """Every part of the whole model, the same ordered tuple on every rank (with PP each stage
    holds some layers: the stages' parts are gathered once)."""
    import torch.distributed as dist

    local = {parameter_part(name) for name, _ in named}
    if pp_group is None:
        return tuple(sorted(local))
    gathered: list[set[str] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, local, group=pp_group)
    return tuple(sorted(set().union(*(stage or set() for stage in gathered))))
