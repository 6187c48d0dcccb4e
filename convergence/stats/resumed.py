"""After a resume: the steps past the checkpoint judged against twins resumed from it.

A resuming test (convergence/spec/resume.py) trains K steps, checkpoints and goes on from K+1,
often on another layout. Its step K+1 starts from the test's own state at K -- the control's
exact state when the steps before ran on the control's layout -- but the twin envelope at K+1
is the one the twins reached after K steps of chaos, 5-7x its width at step 1 (BENCHMARKS "Twin
envelope, long horizon"): a layout broken from K+1 on meets the tolerance of step K, not of step
1, and a bug of the CP-rope bug's size passes.

The twin regime therefore runs its twins again from the test's checkpoint (Regime's
``resumed_controls``, convergence/run/resume.py). Their gap to the control after K is the
noise from that state: it restarts near zero (plus whatever drift the test brought to K, which
the twins start from too) and grows again with the steps, as from step 1. Each rule whose
method sizes its envelope from twins (``Comparison.anchored_twins``) is judged on the steps
after K by its own method against the control and those resumed twins -- the same envelope,
k and floor as the pair's verdict, only measured from the checkpoint on.

One verdict, ``resumed``, beside the rules' own (which still judge the whole curve against the
twins from step 1, so it can only add a failure): it fails at the first step after K where some
metric leaves that envelope and says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from convergence.metrics.curve import RunMetrics
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats.registry import get_comparison
from convergence.stats.types import MetricVerdict

#: The verdict's metric name (reports list it beside the per-metric verdicts).
RESUMED = "resumed"


def _worst_ratio(verdict: MetricVerdict, test_values: dict[int, float]) -> float:
    """Largest |test - band centre| / band half-width over the compared steps (0 without a
    band): how much of its envelope the test used."""
    band = verdict.band
    if band is None:
        return 0.0
    worst = 0.0
    for step, lower, upper in zip(band.steps, band.lower, band.upper, strict=True):
        value = test_values.get(step)
        if value is None:
            continue
        half = (upper - lower) / 2
        gap = abs(value - (upper + lower) / 2)
        ratio = float("inf") if np.isnan(value) else (gap / half if half > 0 else float(gap > 0))
        worst = max(worst, ratio)
    return min(worst, 1e300)  # JSON has no inf


def resumed_verdict(
    rules: Sequence[ComparisonRule],
    control_runs: Sequence[RunMetrics],
    test: RunMetrics,
    *,
    at_step: int,
    resumed_twins: Sequence[RunMetrics],
) -> MetricVerdict | None:
    """The test's steps after ``at_step`` against the control (``control_runs[0]``) and the
    regime's twins resumed from the test's checkpoint; None when no gating rule sizes its
    envelope from twins, or no twin resumed."""
    if not resumed_twins or not control_runs:
        return None
    judged: list[tuple[MetricVerdict, float]] = []
    values: dict[str, dict[int, float]] = {}
    for rule in (r for r in rules if r.gate):
        comparison = get_comparison(rule.method)
        if not comparison.anchored_twins or rule.metric not in control_runs[0]:
            continue
        twins = [run[rule.metric].after(at_step) for run in resumed_twins if rule.metric in run]
        after = test.get(rule.metric)
        if not twins or after is None:
            continue
        after = after.after(at_step)
        verdict = comparison.compare(
            rule, [control_runs[0][rule.metric].after(at_step), *twins], after
        )
        values[rule.metric] = dict(zip(after.steps.tolist(), after.values.tolist(), strict=True))
        judged.append((verdict, _worst_ratio(verdict, values[rule.metric])))
    if not judged:
        return None
    method: Method = judged[0][0].method
    ratios = {v.metric: r for v, r in judged}
    details: dict[str, object] = {
        "at_step": at_step,
        "resumed_twins": len(resumed_twins),
        "max_ratio_by_metric": ratios,
        "tolerances": [f"{v.metric}: {v.tolerance}" for v, _ in judged],
    }
    tolerance = f"the twin envelope of the twins resumed from the test's checkpoint at {at_step}"
    steps = max(v.steps_compared for v, _ in judged)
    failing = [v for v, _ in judged if not v.passed]
    if not failing:
        worst = max(ratios.values(), default=0.0)
        return MetricVerdict(
            metric=RESUMED,
            method=method,
            passed=True,
            gate=True,
            steps_compared=steps,
            tolerance=tolerance,
            message=f"resumed: after step {at_step} the test stays inside the envelope of the "
            f"twins resumed from its checkpoint ({worst:.2g}x of it at worst)",
            details={**details, "max_ratio": worst},
        )
    dated = [v for v in failing if v.first_divergent_step is not None]
    first = min(dated, key=lambda v: v.first_divergent_step or 0) if dated else failing[0]
    step = first.first_divergent_step
    at_first = [
        _at_step(v, step, values[v.metric]) for v in failing if v.first_divergent_step == step
    ]
    said = "; ".join(at_first) if step is not None else failing[0].message
    return MetricVerdict(
        metric=RESUMED,
        method=method,
        passed=False,
        gate=True,
        steps_compared=steps,
        first_divergent_step=step,
        max_deviation=first.max_deviation,
        max_deviation_step=first.max_deviation_step,
        tolerance=tolerance,
        tolerance_at_max=first.tolerance_at_max,
        message=f"resumed: after the checkpoint at step {at_step} the test leaves the envelope "
        f"of the twins resumed from that checkpoint at step {step} "
        f"({(step or at_step) - at_step} after the resume): {said}",
        details={**details, "first_step": step, "max_ratio": max(ratios.values())},
    )


def _at_step(verdict: MetricVerdict, step: int | None, test: dict[int, float]) -> str:
    """``metric |diff| D > tol T`` at ``step``, read from the verdict's band."""
    band = verdict.band
    if band is None or step not in band.steps or step not in test:
        return verdict.metric
    i = band.steps.index(step)
    lower, upper = band.lower[i], band.upper[i]
    return (
        f"{verdict.metric} |diff| {abs(test[step] - (upper + lower) / 2):.3g} > tol "
        f"{(upper - lower) / 2:.3g}"
    )
