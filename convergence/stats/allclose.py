"""``allclose``: |test - control| <= atol + rtol * |control| at every common step.

Defaults are numpy's (rtol 1e-5, atol 1e-8): meant for a user who knows their tolerance and
sets it; the paired band is the calibrated choice for distributed-vs-reference curves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats._common import align, failed, first_true, incomplete, worst
from convergence.stats.types import MetricVerdict

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8


class AllClose:
    method = "allclose"

    def compare(self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
                ) -> MetricVerdict:
        rtol = DEFAULT_RTOL if rule.rtol is None else rule.rtol
        atol = DEFAULT_ATOL if rule.atol is None else rule.atol
        described = f"atol {atol:g} + rtol {rtol:g}*|control|"
        problem = incomplete(controls, test)
        if problem:
            return failed(rule, self.method, problem, tolerance=described)
        pairs = align(controls[0], test)
        if pairs.steps.size == 0:
            return failed(rule, self.method, "no step logged by both runs", tolerance=described)
        tolerance = atol + rtol * np.abs(pairs.control)
        deviation = np.abs(pairs.test - pairs.control)
        outside = ~(deviation <= tolerance)  # NaN is outside
        max_dev, max_step, index = worst(deviation, pairs.steps)
        first = first_true(outside, pairs.steps)
        passed = first is None
        message = (f"{rule.metric}: within {described} at all {pairs.steps.size} steps "
                   f"(max |diff| {max_dev:.3g})" if passed else
                   f"{rule.metric}: outside {described} at {int(outside.sum())} of "
                   f"{pairs.steps.size} steps, first at step {first} "
                   f"(max |diff| {max_dev:.3g} at step {max_step})")
        return MetricVerdict(metric=rule.metric, method=self.method, passed=passed,
                             gate=rule.gate, steps_compared=int(pairs.steps.size),
                             first_divergent_step=first, max_deviation=max_dev,
                             max_deviation_step=max_step, tolerance=described,
                             tolerance_at_max=None if index is None else float(tolerance[index]),
                             message=message)
