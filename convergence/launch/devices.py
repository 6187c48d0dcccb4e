"""The session's devices: this machine's, or a Slurm allocation's nodes x devices per node.

    local launcher  -> GPUs torch sees here, else CPU slots (convergence.launch.pool)
    slurm launcher  -> every node of the allocation x its devices:
                       GPUs per node from ``SLURM_GPUS_ON_NODE`` (else what torch sees on the
                       batch host: nodes of one allocation are alike), or on a CPU cluster the
                       CPUs Slurm gave each node (``SLURM_JOB_CPUS_PER_NODE``) as CPU slots

``--convergence-devices N`` caps either (taking devices node by node). Devices of a node pool
are named ``host:index``; the pool places jobs on slices or whole nodes (pool.py), the Slurm
launcher runs each job on the hosts of its lease.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from convergence.launch.pool import DeviceSet, detect_devices
from convergence.launch.slurm import Allocation


def session_devices(
    launcher: str, cap: int | None = None, *, environ: Mapping[str, str] | None = None
) -> DeviceSet:
    """What the session's pool holds (see the module docstring); raises SlurmError outside an
    allocation under the slurm launcher."""
    if launcher != "slurm":
        return detect_devices(cap)
    env = dict(os.environ if environ is None else environ)
    allocation = Allocation.from_env(env)
    per_node = allocation.gpus_per_node
    kind = "gpu"
    if per_node is None:
        here = detect_devices(None)
        if here.kind == "gpu":
            per_node = len(here.devices)
        else:
            kind, per_node = "cpu", allocation.cpus_per_node or 1
    devices = tuple(f"{host}:{i}" for host in allocation.hosts for i in range(per_node))
    unit = "GPUs" if kind == "gpu" else "CPU slots"
    where = (
        f"Slurm allocation {allocation.job_id} ({len(allocation.hosts)} nodes x {per_node} {unit}"
    )
    if cap is not None and cap < len(devices):
        devices = devices[:cap]
        where += f", capped at {cap} by --convergence-devices"
    return DeviceSet(kind=kind, devices=devices, per_node=per_node, where=where + ")")
