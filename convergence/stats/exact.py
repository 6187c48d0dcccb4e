"""``exact``: the test equals the control bit for bit at every common step.

For fully deterministic setups (same layout, same kernels, a refactor that must not change the
math). Bitwise, so -0.0 != 0.0 and a NaN only equals the very same NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import (
    ComparisonDefaults,
    align,
    failed,
    first_true,
    incomplete,
    worst,
)
from convergence.stats.types import Check, Floats, Ints, MetricVerdict, Tolerance


@dataclass(frozen=True)
class ExactTolerance:
    """Exact equality (the data fingerprint): no tolerance at all."""

    atol: float = 0.0
    growth: float = 0.0
    rtol: float = 0.0

    def at(self, steps: Ints, control: Floats) -> Floats:
        return np.zeros(steps.shape, dtype=np.float64)

    def describe(self) -> str:
        return "equal"


class Exact(ComparisonDefaults):
    method: Method = "exact"

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        return ExactTolerance()

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        reference = dict(zip(controls[0].steps.tolist(), controls[0].values.tolist(), strict=True))

        def check(step: int, value: float) -> tuple[float, float] | None:
            ref = reference.get(step)
            if ref is None:
                return None
            # Bitwise: any difference counts, however small (at least one ulp of the control).
            same = np.float64(value).tobytes() == np.float64(ref).tobytes()
            return (0.0 if same else max(abs(value - ref), math.ulp(ref))), 0.0

        return check

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        problem = incomplete(controls, test)
        if problem:
            return failed(rule, self.method, problem, tolerance="bitwise equal")
        pairs = align(controls[0], test)
        if pairs.steps.size == 0:
            return failed(
                rule, self.method, "no step logged by both runs", tolerance="bitwise equal"
            )
        differs = pairs.test.view(np.int64) != pairs.control.view(np.int64)
        deviation = np.abs(pairs.test - pairs.control)
        max_dev, max_step, _ = worst(np.where(differs, deviation, 0.0), pairs.steps)
        first = first_true(differs, pairs.steps)
        passed = first is None
        message = (
            f"{rule.metric}: bitwise equal at all {pairs.steps.size} steps"
            if passed
            else f"{rule.metric}: differs at {int(differs.sum())} of {pairs.steps.size} steps, "
            f"first at step {first} (max |diff| {max_dev:.3g} at step {max_step})"
        )
        return MetricVerdict(
            metric=rule.metric,
            method=self.method,
            passed=passed,
            gate=rule.gate,
            steps_compared=int(pairs.steps.size),
            first_divergent_step=first,
            max_deviation=max_dev,
            max_deviation_step=max_step if not passed else None,
            tolerance="bitwise equal",
            tolerance_at_max=0.0,
            message=message,
        )
