"""exact, allclose and the paired band on synthetic curves with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats.allclose import AllClose
from convergence.stats.exact import Exact
from convergence.stats.paired_band import PairedBand, paired_tolerance

STEPS = np.arange(1, 201, dtype=np.int64)


def loss_curve(offset: float = 0.0, metric: str = "loss") -> Curve:
    values = 2.0 + 8.0 * np.exp(-STEPS / 30.0) + offset
    return Curve(metric, STEPS, values.astype(np.float64))


def rule(metric: str = "loss", method: str = "paired", **params: float) -> ComparisonRule:
    return ComparisonRule(metric=metric, method=method, **params)  # type: ignore[arg-type]


def noise_floor(curve: Curve, size: float, seed: int = 0) -> Curve:
    """Reduction-order noise: a random walk of +-size per step (the measured fp32 floor is
    |dloss| <= 5e-7 over 100 steps)."""
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.choice([-1.0, 1.0], size=len(curve))) * size / np.sqrt(len(curve))
    return Curve(curve.metric, curve.steps, curve.values + walk)


def test_exact_identical_passes_and_one_ulp_fails() -> None:
    control = loss_curve()
    assert Exact().compare(rule(method="exact"), [control], loss_curve()).passed
    values = control.values.copy()
    values[41] = np.nextafter(values[41], np.inf)
    verdict = Exact().compare(rule(method="exact"), [control], Curve("loss", STEPS, values))
    assert not verdict.passed
    assert verdict.first_divergent_step == 42
    assert verdict.max_deviation_step == 42 and verdict.max_deviation > 0


def test_allclose_defaults_and_parameters() -> None:
    control = loss_curve()
    close = Curve("loss", STEPS, control.values * (1 + 1e-7))
    assert AllClose().compare(rule(method="allclose"), [control], close).passed
    shifted = loss_curve(1e-3)
    verdict = AllClose().compare(rule(method="allclose"), [control], shifted)
    assert not verdict.passed and verdict.first_divergent_step == 1
    assert AllClose().compare(rule(method="allclose", atol=2e-3), [control], shifted).passed


def test_paired_passes_identical_and_noise_floor() -> None:
    control = loss_curve()
    for test in (loss_curve(), noise_floor(control, 5e-7), noise_floor(control, 5e-6, seed=1)):
        verdict = PairedBand().compare(rule(), [control], test)
        assert verdict.passed, verdict.message
        assert verdict.first_divergent_step is None
        assert verdict.steps_compared == 200


def test_paired_fails_a_small_shift_and_reports_where() -> None:
    control = loss_curve()
    values = control.values.copy()
    values[99:] += 1e-3  # a real bug from step 100 on
    verdict = PairedBand().compare(rule(), [control], Curve("loss", STEPS, values))
    assert not verdict.passed
    assert verdict.first_divergent_step == 100
    assert verdict.max_deviation == pytest.approx(1e-3, rel=1e-6)
    assert verdict.tolerance_at_max is not None and verdict.tolerance_at_max < 1e-4
    assert "sqrt(step)" in verdict.tolerance
    assert "step 100" in verdict.message


def test_paired_catches_doubled_grad_norm_while_loss_barely_moves() -> None:
    """A wrongly scaled gradient under Adam: loss moves by ~1e-2 at most, grad norm doubles."""
    grad_norm = Curve("grad_norm", STEPS, 1.0 + 0.5 * np.exp(-STEPS / 50.0))
    doubled = Curve("grad_norm", STEPS, 2.0 * grad_norm.values)
    verdict = PairedBand().compare(rule("grad_norm"), [grad_norm], doubled)
    assert not verdict.passed and verdict.first_divergent_step == 1
    # Reduction-order noise on the grad norm (relative 1e-5) passes.
    noisy = Curve("grad_norm", STEPS, grad_norm.values * (1 + 1e-5 * np.sin(STEPS)))
    assert PairedBand().compare(rule("grad_norm"), [grad_norm], noisy).passed
    # The loss moved by 1e-2 is still far outside the loss band.
    loss = PairedBand().compare(rule(), [loss_curve()], loss_curve(1e-2))
    assert not loss.passed and loss.max_deviation / (loss.tolerance_at_max or 1) > 100


def test_paired_default_tolerance_has_headroom_and_stays_small() -> None:
    tol = paired_tolerance(rule())
    at = tol.at(np.array([100, 1000], dtype=np.int64), np.array([3.0, 3.0]))
    assert at[0] > 10 * 5e-7  # far above the measured fp32 floor at step 100
    assert at[1] < 1e-2 / 100  # far below a real bug at step 1000
    custom = paired_tolerance(rule(atol=1e-3, growth=0.0, rtol=0.0))
    assert custom.at(np.array([1000], dtype=np.int64), np.array([3.0]))[0] == 1e-3


def test_paired_nan_fails() -> None:
    values = loss_curve().values.copy()
    values[10] = np.nan
    verdict = PairedBand().compare(rule(), [loss_curve()], Curve("loss", STEPS, values))
    assert not verdict.passed and verdict.first_divergent_step == 11
    assert verdict.max_deviation_step == 11


def test_incomplete_test_run_fails_every_method() -> None:
    short = loss_curve().upto(50)
    for comparison, method in (
        (Exact(), "exact"),
        (AllClose(), "allclose"),
        (PairedBand(), "paired"),
    ):
        verdict = comparison.compare(rule(method=method), [loss_curve()], short)
        assert not verdict.passed
        assert "ends at step 50" in verdict.message
