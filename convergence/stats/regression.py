"""``regression``: one-sided check of a performance metric (throughput, memory).

Fails only when the test is *worse* than the control by more than ``max_regression``
(relative, default 10%) on the median over steps. The median, because per-step throughput has
outliers (a GC pause, a checkpoint, a slow first step); the first WARMUP_STEPS logged steps are
skipped because they include compilation, allocator growth and cache warm-up. Being faster or
smaller never fails. The verdict's band is that limit on the median, drawn at every steady
step (one-sided: the other side is infinite). These rules default to ``gate = False``: a CPU CI box is too noisy for
throughput to decide correctness unless a user asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import ComparisonDefaults, failed
from convergence.stats.types import Band, Check, MetricVerdict

DEFAULT_MAX_REGRESSION = 0.1
WARMUP_STEPS = 3
#: Metrics where a larger value is better; every other metric is better when smaller.
HIGHER_IS_BETTER: frozenset[str] = frozenset({"tokens_per_s"})


def steady_median(curve: Curve) -> tuple[float, int]:
    """(median after the warm-up steps, points used); all points if there are too few."""
    values = curve.values[WARMUP_STEPS:] if len(curve) > WARMUP_STEPS else curve.values
    values = values[np.isfinite(values)]
    return (float(np.median(values)) if values.size else float("nan")), int(values.size)


class Regression(ComparisonDefaults):
    method: Method = "regression"

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        return None  # judged on a median over the whole run: never stops a job

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        limit = DEFAULT_MAX_REGRESSION if rule.max_regression is None else rule.max_regression
        higher = rule.metric in HIGHER_IS_BETTER
        word = "slower" if higher else "larger"
        described = (
            f"at most {limit:.0%} {word} than the control (median after step {WARMUP_STEPS})"
        )
        control_medians = [steady_median(c)[0] for c in controls if len(c)]
        control = float(np.median(control_medians)) if control_medians else float("nan")
        value, used = steady_median(test)
        if not (np.isfinite(control) and np.isfinite(value)):
            return failed(rule, self.method, "no finite values to compare", tolerance=described)
        if control == 0.0:
            # e.g. peak memory that the device cannot report: nothing to regress against.
            return MetricVerdict(
                metric=rule.metric,
                method=self.method,
                passed=True,
                gate=rule.gate,
                steps_compared=used,
                tolerance=described,
                message=f"{rule.metric}: control median is 0, not compared",
            )
        change = (value - control) / abs(control)
        # The median is what is checked; every steady step gets the median's limit.
        steady = test.steps[WARMUP_STEPS:] if len(test) > WARMUP_STEPS else test.steps
        bound = np.full(steady.shape, control + (-limit if higher else limit) * abs(control))
        unbounded = np.full(steady.shape, np.inf if higher else -np.inf)
        band = Band.of(steady, bound if higher else unbounded, unbounded if higher else bound)
        worse_by = -change if higher else change
        passed = worse_by <= limit
        verb = "regressed" if not passed else "within limits"
        message = (
            f"{rule.metric}: {verb}: median {value:.4g} vs control {control:.4g} "
            f"({change:+.1%}; allowed {limit:.0%} {word})"
        )
        return MetricVerdict(
            metric=rule.metric,
            method=self.method,
            passed=passed,
            gate=rule.gate,
            steps_compared=used,
            max_deviation=abs(value - control),
            tolerance=described,
            tolerance_at_max=limit * abs(control),
            message=message,
            band=band,
            details={"control_median": control, "test_median": value, "relative_change": change},
        )
