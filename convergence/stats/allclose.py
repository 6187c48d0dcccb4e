"""``allclose``: |test - control| <= atol + rtol * |control| at every common step.

Defaults are numpy's (rtol 1e-5, atol 1e-8): meant for a user who knows their tolerance and
sets it; the paired band is the calibrated choice for distributed-vs-reference curves.
"""

from __future__ import annotations

from collections.abc import Sequence

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import ComparisonDefaults, point_check
from convergence.stats.paired_band import PairedTolerance, envelope_verdict
from convergence.stats.types import Check, MetricVerdict, Tolerance

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8


class AllClose(ComparisonDefaults):
    method: Method = "allclose"

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        return self.tolerance(rule)

    def tolerance(self, rule: ComparisonRule) -> PairedTolerance:
        return PairedTolerance(
            atol=DEFAULT_ATOL if rule.atol is None else rule.atol,
            growth=0.0,
            rtol=DEFAULT_RTOL if rule.rtol is None else rule.rtol,
        )

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        atol = DEFAULT_ATOL if rule.atol is None else rule.atol
        rtol = DEFAULT_RTOL if rule.rtol is None else rule.rtol
        return point_check(controls[0], lambda step, ref: atol + rtol * abs(ref))

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        tol = self.tolerance(rule)
        return envelope_verdict(rule, self.method, controls, test, tol, band=tol.describe())
