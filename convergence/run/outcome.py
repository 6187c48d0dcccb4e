"""What running a pair produced: per-side runs, per-metric verdicts, the pair's status.

Reports (terminal matrix, JSON/MD/HTML, JUnit properties) are built from these alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from convergence.launch.types import JobResult
from convergence.metrics.curve import RunMetrics
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.stats.types import MetricVerdict

#: Pair statuses: passed/failed/inconclusive are verdicts (inconclusive: the evidence cannot
#: exclude a difference the margin cares about -- never a pass, in any report or exit status);
#: error means a job broke before a verdict, or a metric the experiment names in ``compare``
#: was not logged (nothing to judge it by).
PairStatus = Literal["passed", "failed", "error", "skipped", "inconclusive"]
PAIR_STATUSES: tuple[PairStatus, ...] = get_args(PairStatus)


@dataclass(frozen=True, kw_only=True)
class SideOutcome:
    """One side (control or test) of a pair after it ran (or was taken from the cache)."""

    job: JobSpec
    metrics: RunMetrics
    """Curves by metric name. For the seed regime's control: the first replicate."""
    result: JobResult | None = None
    """The launch result; ``None`` when the run came from the cache."""
    cached: bool = False
    run_dir: Path | None = None
    """Folder holding the run's metrics, logs and metadata."""
    wall_s: float = 0.0
    replicates: tuple[RunMetrics, ...] = ()
    """Seed regime: all K control replicates (including the first)."""
    twins: tuple[RunMetrics, ...] = ()
    """Twin regime: every twin's curves (the noise twin first, then the forward-noise twin and
    the twin with the test's numerics where they ran), in the regime's ``control_jobs`` order
    (convergence/stats/twin_envelope.py)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Trainer metadata (seed checkpoint hash, entropy floor, world size, versions)."""


@dataclass(frozen=True, kw_only=True)
class PairOutcome:
    pair: PairSpec
    status: PairStatus
    control: SideOutcome | None
    test: SideOutcome | None
    verdicts: tuple[MetricVerdict, ...] = ()
    error: str | None = None
    """Why the pair errored (which job, rank, traceback head)."""
    stopped_early_at: int | None = None
    """Step at which the test job was stopped because the verdict was already decided."""
    localisation: dict[str, Any] | None = None
    """Numerics probe result: first differing module / parameter (paired failures)."""
    plots: tuple[Path, ...] = ()
    wall_s: float = 0.0
    extra_sides: tuple[SideOutcome, ...] = ()
    """The jobs the pair's checks ran beside the control group and the test (the anchored
    test job, the resumed twins, ...: convergence/checks/), as they ran."""
    attribution: dict[str, Any] | None = None
    """Which axis a failing N-D pair's failure belongs to (run/attribution.py): the isolating
    pairs' results and the blame; None where it did not run."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def earliest_failure(self) -> tuple[int | None, str | None]:
        """(first divergent step, metric) of the gating verdict that failed first; a failure
        without a step (a missing curve) after those with one; (None, None) when none failed.
        What a failure says in one line: attribution's isolating pairs, selftest's catches."""
        failing = [v for v in self.verdicts if v.gate and not v.passed]
        if not failing:
            return None, None
        first = min(
            failing,
            key=lambda v: (v.first_divergent_step is None, v.first_divergent_step or 0),
        )
        return first.first_divergent_step, first.metric

    def verdict(self, metric: str) -> MetricVerdict | None:
        for v in self.verdicts:
            if v.metric == metric:
                return v
        return None
