"""``seed``: runs that cannot be paired (other seeds, a technique that changes the math, a
backend without a noise twin). K control replicates with different seeds form a per-step band;
the test must stay inside it and pass an equivalence test (TOST) on the final window
(convergence/stats/seed_band.py). No numerics probe: the sides start from other weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from convergence.metrics.curve import RunMetrics
from convergence.regimes.base import (
    ControlCurves,
    ShippedRegime,
    TwinSource,
    check_replicates,
    gating_rules,
)
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import ComparisonRule, Method, PairSpec


@dataclass(frozen=True)
class SeedRegime(ShippedRegime):
    name: str = "seed"
    method: Method = "seed"
    band_of_replicates: bool = True
    probe_on_failure: bool = False

    def default_rules(self) -> tuple[ComparisonRule, ...]:
        # No update norm: it is evidence where both sides start from one state and read the
        # same samples (paired, twin). Across seeds the update is another draw, and its seed
        # band has not been measured (issue 47 checked the paired and twin regimes only).
        return gating_rules(self.method, update=False)

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        return True  # the fallback: asked last among the shipped regimes

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        check_replicates(pair, self.name, what="control replicates", fix="set replicates >= 2")

    # check_method_use: allowed anywhere (ShippedRegime's): with one control curve the seed
    # comparison fails with its own reason.

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        control = pair.control
        return (
            control,
            *(
                dataclasses.replace(control, seed=control.seed + i, name=f"{control.name}-seed{i}")
                for i in range(1, pair.replicates)
            ),
        )

    def check_control_runs(self, count: int) -> None:
        if count < 2:
            raise SpecError(
                "the seed regime needs at least 2 control runs",
                key="--replicate",
                fix="add --replicate RUN for each other seed's control run",
            )

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        # The band's replicates travel with the control for the report.
        return ControlCurves(replicates=tuple(runs) if len(runs) > 1 else ())


SEED = SeedRegime()
