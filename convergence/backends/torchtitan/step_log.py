"""The launcher's per-step records: the data fingerprint and per-part gradient norms, from the
batches and gradients torchtitan itself uses (one JSON line per step, rank 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from convergence.trainer.data import FINGERPRINT_BITS, sample_hash


class StepLog:
    """Collects what a step read and its gradients; rank 0 appends one JSON line per step with
    the built-in trainer's names and definitions (``data_fingerprint``: the sum of
    ``convergence.trainer.data.sample_hash`` over every sample of the global batch, mod 2**48;
    ``grad_norm_parts``: the geometric mean of the per-part gradient norms)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.digest = 0
        self.step = 0

    def on_batch(self, input_dict: dict[str, Any], labels: Any) -> None:
        self.digest += sample_hash(input_dict["input"], labels)

    def on_grads(self, parameters: list[Any], parallel_dims: Any) -> None:
        import torch
        import torch.distributed as dist

        self.step += 1
        digest = torch.tensor([self.digest % 2**FINGERPRINT_BITS], dtype=torch.int64)
        self.digest = 0
        # Summed over the ranks that read different samples only (TP/PP ranks hold copies).
        mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims.dp_enabled else None
        if mesh is not None:
            dist.all_reduce(digest, group=mesh.get_group())
        parts = part_grad_norms(parameters, parallel_dims.get_optional_mesh("pp"))
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        norms = [v for v in parts.values() if v > 0]
        geomean = math.exp(sum(math.log(v) for v in norms) / len(norms)) if norms else 0.0
        record = {
            "step": self.step,
            "data_fingerprint": int(digest.item()) % 2**FINGERPRINT_BITS,
            "grad_norm_parts": geomean,
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def part_of(name: str) -> str:
    """The kind of weight a parameter is (queries, keys, MLP, norms, embeddings ...): its name
    without layer indices and wrapper prefixes."""
    words = [w for w in name.split(".") if not w.isdigit() and not w.startswith("_")]
    return ".".join(words[-2:]) if len(words) >= 2 else ".".join(words)


def part_grad_norms(parameters: list[Any], pp_mesh: Any) -> dict[str, float]:
    """Per part, the gradient's global 2-norm: DTensor shards reduced over their mesh (FSDP,
    TP), then the pipeline stages' sums of squares added (each stage holds other layers)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    squares: dict[str, float] = {}
    for name, param in parameters:
        grad = param.grad
        if grad is None:
            continue
        sq = grad.detach().double().pow(2).sum()
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        key = part_of(name)
        squares[key] = squares.get(key, 0.0) + float(sq)
    if pp_mesh is not None:
        gathered: list[dict[str, float] | None] = [None] * pp_mesh.size()
        dist.all_gather_object(gathered, squares, group=pp_mesh.get_group())
        squares = {}
        for stage in gathered:
            for key, value in (stage or {}).items():
                squares[key] = squares.get(key, 0.0) + value
    return {k: math.sqrt(v) for k, v in sorted(squares.items())}
