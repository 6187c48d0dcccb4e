"""How many nodes a night needs: the largest job of the pairs it will run.

``convergence nightly`` writes ``#SBATCH --nodes`` from this (unless ``--nodes`` is given), so
adding a 16-GPU pair to ``experiments/`` grows the allocation instead of skipping the pair.
Files are read as pytest would collect them (TOML files under the given paths that declare
``[control]``/``[[test]]``/``[[sweep]]``); only the parse is needed (no backend preflight), and
a file that does not parse is left to pytest to report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from convergence.backends import get_backend
from convergence.checks import pair_keys
from convergence.preflight import REGIMES
from convergence.regimes import get_regime
from convergence.spec.errors import SpecError
from convergence.spec.experiment import TIERS, declares_experiment, load_experiment


@dataclass(frozen=True, kw_only=True)
class LargestJob:
    """The job that sizes the allocation."""

    world_size: int
    where: str
    """``file::pair (side layout)``, for the message."""


def _experiment_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        files = sorted(path.rglob("*.toml")) if path.is_dir() else [path]
        for file in files:
            if declares_experiment(file):
                yield file


def largest_job(
    paths: Iterable[Path], *, rootdir: Path, max_tier: str = "nightly"
) -> LargestJob | None:
    """The largest world size among the pairs up to ``max_tier`` (the regime's other control
    jobs -- a twin, seed replicates -- and a resumed test's second job included)."""
    best: LargestJob | None = None
    for file in _experiment_files(paths):
        try:
            experiment = load_experiment(
                file, rootdir=rootdir, regimes=REGIMES, checks_keys=pair_keys()
            )
        except SpecError:
            continue  # pytest reports it at collection
        for pair in experiment.pairs:
            if TIERS.index(pair.tier) > TIERS.index(max_tier):
                continue
            jobs = [("control", pair.control), ("test", pair.test)]
            if not pair.golden:
                try:
                    others = get_regime(pair.regime).control_jobs(
                        pair, get_backend(pair.control.backend)
                    )[1:]
                except SpecError:
                    others = ()  # a backend not installed here: collection says so
                jobs.extend(("control", job) for job in others)
            if pair.test.resume is not None:
                jobs.append(("test", pair.test.after_resume()))
            for side, job in jobs:
                if best is None or job.world_size > best.world_size:
                    best = LargestJob(
                        world_size=job.world_size,
                        where=f"{file}::{pair.name} ({side} {job.layout.short_name()})",
                    )
    return best


def nodes_for(world_size: int, devices_per_node: int) -> int:
    return max(1, math.ceil(world_size / devices_per_node))
