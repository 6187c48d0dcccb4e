"""``data_fingerprint``: did the test read the very samples the control read, step by step?

The trainer logs, per optimizer step, an order-independent hash of the global batch's token ids
and labels (convergence.trainer.data.read_step). Same seed, same data config and a correct data
path give the same value in every layout, so any difference is a data bug (a sample duplicated,
skipped or read by the wrong rank), not numerics. It is checked exactly and reported first, so
the pair fails as "data differs at step N" instead of as a loss curve that someone then blames
on the parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats._common import align, failed, uncompared
from convergence.stats.types import MetricVerdict

METRIC = "data_fingerprint"


def compare_fingerprints(
    rule: ComparisonRule, controls: Sequence[Curve], test: Curve
) -> MetricVerdict:
    """Exact equality at every step both logged (values are integers < 2**48: exact floats)."""
    if not controls or len(controls[0]) == 0 or len(test) == 0:
        return failed(rule, rule.method, "no fingerprints to compare", tolerance="equal")
    pairs = align(controls[0], test)
    if pairs.steps.size == 0:
        return failed(rule, rule.method, "no step logged by both runs", tolerance="equal")
    differs = pairs.test != pairs.control
    num_differ = int(differs.sum())
    first = int(pairs.steps[np.argmax(differs)]) if num_differ else None
    if first is None:
        message = f"data identical at all {pairs.steps.size} steps"
    else:
        message = (
            f"data differs at step {first} (test read different samples; "
            f"{num_differ} of {pairs.steps.size} steps differ): a data bug, not numerics"
        )
    return MetricVerdict(
        metric=rule.metric,
        method=rule.method,
        passed=first is None,
        gate=rule.gate,
        steps_compared=int(pairs.steps.size),
        first_divergent_step=first,
        tolerance="equal",
        max_deviation=float(num_differ),
        message=message,
    )


def not_logged(rule: ComparisonRule) -> MetricVerdict:
    """A metric a side does not log (a backend without fingerprints or per-part grad norms,
    an old cached run): nothing to hold against the pair."""
    what = "data" if rule.metric == METRIC else "metric"
    how = (
        "a hash of each step's samples, as the built-in trainer does"
        if rule.metric == METRIC
        else "grad_norm/<part> per step, as the built-in trainer does"
    )
    fix = f'log it ({how}), or set compare.{rule.metric} = "off" to say it is not compared'
    return uncompared(
        rule,
        f"{rule.metric}: not logged by both runs; {what} not compared: {fix}",
        passed=True,
        gate=False,
        not_compared=rule.gate,
    )
