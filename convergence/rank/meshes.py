"""The meshes a rank-side helper reads (``Meshes``): the world mesh and each parallelism's
sub-mesh, the same value in both trainers. The built-in trainer builds it
(convergence/trainer/parallelize.py build_meshes: the axis names and flattened views are
documented there); the torchtitan launcher fills it from torchtitan's ``ParallelDims``
(convergence/backends/torchtitan/probe.py meshes_of), so the probe's reductions
(probe_norms.py) run unchanged on either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, kw_only=True)
class Meshes:
    """The world mesh and the sub-meshes each parallelism uses (None when of degree 1)."""

    world: DeviceMesh
    tp: DeviceMesh | None
    cp: DeviceMesh | None
    pp: DeviceMesh | None
    dp: DeviceMesh | None
    """Mesh FSDP/DDP reduce gradients over: 1D, or 2D (dp_replicate, dp_shard_cp) for HSDP."""
    dp_kind: str
    """"none", "ddp", "fsdp" or "hsdp"."""
    dp_cp: DeviceMesh
    """Flattened dp_replicate x dp_shard x cp: the loss average."""
    data: DeviceMesh
    """Flattened dp_replicate x dp_shard: its local rank picks the samples."""
    ep: DeviceMesh | None = None
    """The EP group's mesh (the routed experts are sharded over it); None without EP."""
    efsdp: DeviceMesh | None = None
    """The experts' FSDP mesh under EP: the dp_shard*cp/ep ranks holding the same experts."""
