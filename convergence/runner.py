"""Runs a pair end to end: seed checkpoint, control (cached), test (watched), verdicts.

    PairSpec -> jobs -> cache lookup -> launcher -> metrics -> verdicts -> PairOutcome

Nothing here knows about pytest; the plugin and the CLI both call :func:`run_pair`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from convergence.launch.types import Progress
from convergence.outcome import PairOutcome
from convergence.spec.pair import PairSpec


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Session-wide settings (from pytest options / CLI flags)."""

    work_dir: Path
    """Root for run folders, the device-pool state and (by default) the cache."""
    cache_dir: Path | None = None
    """Run cache root; default ``work_dir / "cache"``."""
    refresh: bool = False
    """Ignore cached runs (they are replaced by fresh ones)."""
    early_stop: bool = True
    launcher: str = "local"
    """``local`` (torchrun) or ``slurm`` (srun + torchrun)."""
    devices: int | None = None
    """Devices (GPUs, or CPU slots) the pool may hand out; None = detect."""
    steps: int | None = None
    """Override every job's steps (quick looks)."""
    alpha: float | None = None
    """Override the level of the seed-band equivalence test."""
    backend: str | None = None
    """Override every job's backend."""
    wall_limit_s: float = 3600.0
    idle_limit_s: float = 300.0
    on_progress: Callable[[Progress], None] | None = field(default=None, compare=False)


def run_pair(pair: PairSpec, settings: RunSettings) -> PairOutcome:
    """Run ``pair`` and judge it. Never raises for a job failure: it becomes status "error"."""
    raise NotImplementedError
