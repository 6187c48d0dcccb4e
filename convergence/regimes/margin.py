"""``margin``: a test that changes the arithmetic on purpose (float8, MXFP8), judged for "as
good as the control", not "equal" (convergence/stats/noninferiority.py).

The default for a pair whose test (or control) uses a precision technique
(``Techniques.numerics_changed``); a user names it for any other deliberate change
(``regime = "margin"``). It runs K replicate pairs: the control and the test at the pair's
seed, and each again at seeds +1 .. +K-1 (``replicates = K``), control i and test i from one
seed checkpoint on the same samples, so their difference cancels the seed's own offset. All
are control-side jobs (cached by content, run together): the K - 1 extra tests are the test's
replicates, not a reference, and the comparison reads them by position (control_jobs: K
controls, then K - 1 tests). No early stop (the verdict weighs windows of the whole run) and
no numerics probe (a deliberate change differs at step 1 by design).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from convergence.metrics.curve import RunMetrics
from convergence.regimes.base import (
    ControlCurves,
    EarlyStopPolicy,
    ShippedRegime,
    TwinSource,
    check_replicates,
)
from convergence.regimes.paired import check_same_seed
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import Method, PairSpec

#: Never stops a test early: min_step past any run.
NO_EARLY_STOP = EarlyStopPolicy(min_step=10**9, patience=10**9)


def numerics_changed(job: JobSpec) -> bool:
    """The job (or its phase after a resume) uses a technique that changes the math."""
    resumed = job.resume is not None and job.resume.techniques.numerics_changed
    return job.techniques.numerics_changed or resumed


@dataclass(frozen=True)
class MarginRegime(ShippedRegime):
    name: str = "margin"
    method: Method = "margin"
    band_of_replicates: bool = True
    early_stop: EarlyStopPolicy = NO_EARLY_STOP
    probe_on_failure: bool = False
    method_needs: str = "it compares replicate pairs that only that regime runs"

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        # Asked first: a precision technique differs from its control beyond any rounding,
        # so the paired tolerance and the twin envelope would fail a correct recipe.
        return numerics_changed(test) or numerics_changed(control)

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        check_same_seed(pair, key=key)
        check_replicates(
            pair,
            self.name,
            what="replicate pairs (their spread is the evidence)",
            fix="set replicates >= 2 (3 is the default)",
        )
        if pair.golden:
            raise SpecError(
                "the margin regime runs control replicates; a golden curve is one run",
                file=pair.source,
                key=f"{key}.regime",
                fix='drop golden, or use regime = "seed"',
            )

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        control, test = pair.control, pair.test

        def at(job: JobSpec, i: int) -> JobSpec:
            return dataclasses.replace(job, seed=job.seed + i, name=f"{job.name}-seed{i}")

        others = range(1, pair.replicates)
        return (control, *(at(control, i) for i in others), *(at(test, i) for i in others))

    def check_control_runs(self, count: int) -> None:
        if count < 3 or count % 2 == 0:
            raise SpecError(
                "the margin regime needs K control runs and K - 1 test runs at the same "
                "other seeds (2K - 1 runs)",
                key="--replicate",
                fix="add --replicate RUN for each other seed's control, then each test",
            )

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        # The control replicates travel with the control for the report's band.
        return ControlCurves(replicates=tuple(runs[: (len(runs) + 1) // 2]))


MARGIN = MarginRegime()
