"""Launching jobs: local (warm or torchrun), Slurm (srun+torchrun), device pool, watchdog."""

from __future__ import annotations

from convergence.launch.pool import DevicePool, DeviceSet, Lease, PoolTooSmall, detect_devices
from convergence.launch.process_tree import terminate_tree
from convergence.launch.torchrun import LocalLauncher, build_torchrun_argv
from convergence.launch.types import FailureInfo, JobResult, Launcher, LaunchRequest, Progress

__all__ = [
    "DevicePool",
    "DeviceSet",
    "FailureInfo",
    "JobResult",
    "Launcher",
    "LaunchRequest",
    "Lease",
    "LocalLauncher",
    "PoolTooSmall",
    "Progress",
    "build_torchrun_argv",
    "detect_devices",
    "terminate_tree",
]
