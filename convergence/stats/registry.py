"""Which comparison implements each method (:func:`get_comparison`), and comparing a run's
curves rule by rule (:func:`compare_all`), with a metric missing on one side named and given
a fix. The rules themselves are data: each regime's defaults live in its module
(convergence/regimes/), the rules every regime shares in convergence.spec.rules."""

from __future__ import annotations

from collections.abc import Sequence

from convergence.metrics.curve import Curve, RunMetrics
from convergence.spec.pair import METHODS, ComparisonRule
from convergence.stats._common import uncompared
from convergence.stats.allclose import AllClose
from convergence.stats.exact import Exact
from convergence.stats.fingerprint import METRIC as FINGERPRINT
from convergence.stats.fingerprint import compare_fingerprints, not_logged
from convergence.stats.noninferiority import NonInferiority
from convergence.stats.paired_band import PairedBand
from convergence.stats.regression import Regression
from convergence.stats.seed_band import SeedBand
from convergence.stats.twin_envelope import TwinEnvelope
from convergence.stats.types import Comparison, MetricVerdict

_COMPARISONS: dict[str, Comparison] = {
    c.method: c
    for c in (
        Exact(),
        AllClose(),
        PairedBand(),
        TwinEnvelope(),
        SeedBand(),
        Regression(),
        NonInferiority(),
    )
}


def get_comparison(method: str) -> Comparison:
    try:
        return _COMPARISONS[method]
    except KeyError:
        raise ValueError(
            f"unknown comparison method {method!r}; use one of {', '.join(METHODS)}"
        ) from None


#: Metrics that some backends do not log: when neither side has one, it is reported as not
#: logged (passed, not gating) instead of missing. The built-in trainer logs them all.
OPTIONAL_METRICS: frozenset[str] = frozenset({FINGERPRINT, "grad_norm_parts", "update_norm_parts"})


def compare_all(
    rules: Sequence[ComparisonRule], control_runs: Sequence[RunMetrics], test: RunMetrics
) -> tuple[MetricVerdict, ...]:
    """One verdict per rule. Paired methods use the first control run; ``seed`` uses all."""
    return tuple(compare_one(rule, control_runs, test) for rule in rules)


def compare_one(
    rule: ComparisonRule, control_runs: Sequence[RunMetrics], test: RunMetrics
) -> MetricVerdict:
    controls: list[Curve] = [run[rule.metric] for run in control_runs if rule.metric in run]
    curve = test.get(rule.metric)
    if not rule.explicit:  # named in `compare`: a missing curve is an error (_missing)
        if rule.metric == FINGERPRINT and (curve is None or not controls):
            return not_logged(rule)  # a backend without fingerprints: shown, not held against it
        if rule.metric in OPTIONAL_METRICS and curve is None and not controls:
            return not_logged(rule)
    if curve is None or not controls:
        return _missing(rule, control_runs, test, in_test=curve is not None)
    comparison = get_comparison(rule.method)
    if not comparison.all_controls:
        controls = controls[:1]  # seed: the K replicates; twin: the control and its twin
    if rule.metric == FINGERPRINT and rule.method == "exact":
        return compare_fingerprints(rule, controls, curve)
    return comparison.compare(rule, controls, curve)


def missing_fix(metric: str) -> str:
    """How to get a metric compared that a run did not log."""
    if metric == "loss":
        return 'check the backend\'s key/tag map (keys.loss = "...")'
    return (
        f"log it as {metric!r} (a command trainer names its own key with backend_options "
        f'keys.{metric} = "..."), or set compare.{metric} = "off" to say it is not '
        f"compared"
    )


def _missing(
    rule: ComparisonRule, control_runs: Sequence[RunMetrics], test: RunMetrics, *, in_test: bool
) -> MetricVerdict:
    """The loss must be there (a run without a loss proves nothing). Another gating metric
    asked for by name in ``compare`` (``rule.explicit``) is an error of the pair; a default
    one is "not compared" -- visible in every report, with the fix, but not a failure."""
    side = "control" if in_test else "test"
    run = (control_runs[0] if control_runs else {}) if in_test else test
    found = ", ".join(sorted(run)) or "nothing"
    fix = missing_fix(rule.metric)
    if rule.metric == "loss":
        return uncompared(
            rule,
            f"loss: missing in the {side} run (found: {found}); cannot compare: {fix}",
            passed=False,
            gate=rule.gate,
            not_compared=False,
        )
    if rule.explicit and rule.gate:
        return uncompared(
            rule,
            f"{rule.metric}: asked for in compare.{rule.metric} but missing in the {side} run "
            f"(found: {found}): {fix}",
            passed=False,
            gate=True,
            not_compared=True,
        )
    return uncompared(
        rule,
        f"{rule.metric}: missing in the {side} run (found: {found}); not compared: {fix}",
        passed=False,
        gate=False,
        not_compared=rule.gate,
    )
