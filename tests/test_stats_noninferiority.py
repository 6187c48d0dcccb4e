"""The margin comparison (convergence/stats/noninferiority.py) on synthetic replicate pairs:
as good, worse, inconclusive with the number to run, the power formula, the pair status.

The synthetic pairs follow the design's model: each seed has its own offset and slow wander,
shared by its control and its test (same seed checkpoint and samples); the test adds the
technique's effect and its own per-step noise. Every assertion is a property the rule implies
for that model, with effects and margins many standard errors away from the decision edges.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.run.settle import status_of
from convergence.spec.pair import ComparisonRule
from convergence.stats.noninferiority import (
    MARGIN_SEEDS,
    NUM_WINDOWS,
    POWER,
    NonInferiority,
    decide,
    pairs_needed,
)
from convergence.stats.registry import get_comparison
from convergence.stats.types import MetricVerdict

STEPS = 200


def replicate_pairs(
    num: int,
    effect: float | np.ndarray,
    *,
    seed: int = 0,
    seed_sd: float = 0.05,
    pair_sd: float = 0.002,
    fast: float = 0.01,
    metric: str = "loss",
) -> tuple[list[Curve], list[Curve]]:
    rng = np.random.default_rng(seed)
    steps = np.arange(1, STEPS + 1)
    base = 5.0 * np.exp(-steps / 60.0) + 1.0
    controls, tests = [], []
    for _ in range(num):
        shared = base + rng.normal(0, seed_sd) + np.cumsum(rng.normal(0, fast / 5, STEPS))
        control = shared + rng.normal(0, fast, STEPS)
        test = shared + effect + rng.normal(0, pair_sd) + rng.normal(0, fast, STEPS)
        controls.append(Curve(metric, steps, control))
        tests.append(Curve(metric, steps, test))
    return controls, tests


def comparison_input(controls: list[Curve], tests: list[Curve]) -> tuple[list[Curve], Curve]:
    """As the margin regime hands them over: K controls, then the K - 1 other tests."""
    return [*controls, *tests[1:]], tests[0]


def test_the_registry_has_it_with_alpha() -> None:
    comparison = get_comparison("margin")
    assert isinstance(comparison, NonInferiority)
    assert comparison.all_controls and comparison.takes_alpha


@pytest.mark.parametrize("seed", range(5))
def test_a_technique_as_good_as_the_control_passes(seed: int) -> None:
    # No effect and tight pairs: the bound sits far below 2 seed std's in every window.
    decision, _, _ = decide(*replicate_pairs(3, 0.0, seed=seed), metric="loss")
    assert decision.passed and not decision.failed and not decision.inconclusive
    assert len(decision.windows) == NUM_WINDOWS
    for w in decision.windows:
        assert w.upper < w.margin and w.powered


@pytest.mark.parametrize("seed", range(5))
def test_a_technique_worse_by_many_margins_fails(seed: int) -> None:
    decision, _, _ = decide(*replicate_pairs(3, 0.5, seed=seed), metric="loss")
    assert decision.failed and not decision.passed and not decision.inconclusive
    assert all(w.lower > w.margin for w in decision.windows if w.worse)


def test_a_worse_middle_is_caught_though_the_end_is_as_good() -> None:
    # Worse only in steps 51-100 (a loss bump the run recovers from): the final window alone
    # would pass it; the second window fails it.
    effect = np.where((np.arange(1, STEPS + 1) > 50) & (np.arange(1, STEPS + 1) <= 100), 0.5, 0)
    decision, _, _ = decide(*replicate_pairs(3, effect), metric="loss")
    assert decision.failed
    assert [w.worse for w in decision.windows] == [False, True, False, False]
    assert decision.windows[-1].as_good


def test_a_better_loss_is_never_worse_but_a_lower_grad_norm_is_off() -> None:
    # One-sided for the loss (lower is better); two-sided for the grad norm.
    controls, tests = replicate_pairs(3, -0.5)
    assert decide(controls, tests, metric="loss")[0].passed
    gn_controls, gn_tests = replicate_pairs(3, -0.5, metric="grad_norm")
    assert decide(gn_controls, gn_tests, metric="grad_norm")[0].failed


def test_too_few_pairs_for_a_tight_margin_is_inconclusive_with_the_number_to_run() -> None:
    # Noisy pairs, a margin of 0.01 nats: the excludable difference is above it.
    controls, tests = replicate_pairs(3, 0.0, pair_sd=0.01)
    decision, _, _ = decide(controls, tests, metric="loss", margin=0.01)
    assert decision.inconclusive and not decision.passed and not decision.failed
    assert any(not w.powered for w in decision.windows)
    needed = decision.more_pairs()
    assert needed is not None and needed > 3
    # The count named is enough by the same formula for the widest window...
    for w in decision.windows:
        t = (
            (_student(needed - 1, 0.95) + _student(needed - 1, POWER))
            * w.spread
            / math.sqrt(needed)
        )
        assert t <= w.margin
    # ...and the verdict says it, as the report and the terminal show it.
    ctrl, test = comparison_input(controls, tests)
    verdict = NonInferiority().compare(
        ComparisonRule(metric="loss", method="margin", margin=0.01), ctrl, test
    )
    assert verdict.inconclusive and not verdict.passed
    assert f"run {needed - 3} more replicates (replicates = {needed})" in verdict.message
    assert verdict.details["replicates_needed"] == needed


def test_an_underpowered_lucky_draw_is_not_a_pass() -> None:
    # The test's curve is far *better* (U < m everywhere) but the pairs are too noisy for
    # the margin: the power rule keeps it inconclusive.
    controls, tests = replicate_pairs(3, -0.05, pair_sd=0.05)
    decision, _, _ = decide(controls, tests, metric="loss", margin=0.01)
    assert all(w.as_good for w in decision.windows)
    assert not decision.powered
    assert decision.inconclusive and not decision.passed


def _student(dof: int, q: float) -> float:
    from scipy import special

    return float(special.stdtrit(dof, q))


def test_the_power_formula() -> None:
    # E = (t[1-a, K-1] + t[power, K-1]) * s / sqrt(K), and pairs_needed is its inverse.
    controls, tests = replicate_pairs(4, 0.0, pair_sd=0.01)
    decision, _, _ = decide(controls, tests, metric="loss", alpha=0.05)
    for w in decision.windows:
        expected = (_student(3, 0.95) + _student(3, POWER)) * w.spread / math.sqrt(4)
        assert w.excludable == pytest.approx(expected)
        assert w.standard_error == pytest.approx(w.spread / 2)
    spread, margin = 0.01, 0.004
    k = pairs_needed(spread, margin, 0.05, 2)
    assert k is not None
    at = (_student(k - 1, 0.95) + _student(k - 1, POWER)) * spread / math.sqrt(k)
    before = (_student(k - 2, 0.95) + _student(k - 2, POWER)) * spread / math.sqrt(k - 1)
    assert at <= margin < before


def test_the_default_margin_is_the_controls_seed_spread() -> None:
    controls, tests = replicate_pairs(3, 0.0)
    decision, steps, _ = decide(controls, tests, metric="loss")
    for w in decision.windows:
        cols = (steps >= w.first_step) & (steps <= w.last_step)
        means = [c.values[cols].mean() for c in controls]
        assert w.margin == pytest.approx(MARGIN_SEEDS * float(np.std(means, ddof=1)))


def test_the_pair_status_has_four_outcomes() -> None:
    def verdict(passed: bool, inconclusive: bool = False, gate: bool = True) -> MetricVerdict:
        return MetricVerdict(
            metric="loss",
            method="margin",
            passed=passed,
            inconclusive=inconclusive,
            gate=gate,
            steps_compared=1,
        )

    assert status_of([verdict(True), verdict(True)]) == "passed"
    assert status_of([verdict(True), verdict(False, inconclusive=True)]) == "inconclusive"
    # A failure outweighs an inconclusive metric; a non-gating one decides nothing.
    assert status_of([verdict(False), verdict(False, inconclusive=True)]) == "failed"
    assert status_of([verdict(True), verdict(False, gate=False)]) == "passed"


def test_more_steps_shrink_only_the_per_step_part_of_the_spread() -> None:
    from convergence.stats.noninferiority import Window, steps_needed

    def window(spread: float, fast: float) -> Window:
        return Window(
            first_step=1,
            last_step=50,
            delta=0.0,
            standard_error=spread / math.sqrt(3),
            lower=-1.0,
            upper=1.0,
            margin=0.01,
            excludable=1.0,
            spread=spread,
            fast_noise=fast,
            num_steps=50,
            worse=False,
            as_good=True,
            p_value=0.5,
        )

    # All of the spread is per-step noise: n' = sigma_fast^2 / target^2, the window that
    # makes 3 pairs powered at this margin.
    target = 0.01 * math.sqrt(3) / (_student(2, 0.95) + _student(2, POWER))
    needed = steps_needed(window(0.02, 0.02), 3, 0.05)
    assert needed == math.ceil(0.02**2 * 50 / target**2)
    # A slow part (the pairs' own offsets) at least the target: no number of steps decides.
    assert steps_needed(window(math.hypot(target, 0.001), 0.001), 3, 0.05) is None
