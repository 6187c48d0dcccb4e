"""The seed band + TOST: known answers, false-alarm rate and power on simulated ensembles."""

from __future__ import annotations

import numpy as np
import pytest
from simulate import NoiseModel, simulate_case, simulate_run

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats.seed_band import SeedBand, default_margin_factor, seed_band

RULE = ComparisonRule(metric="loss", method="seed")
MODEL = NoiseModel()


def false_alarm_and_power(num_replicates: int, shift: float, cases: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(cases):
        controls, test = simulate_case(rng, MODEL, num_replicates, shift=shift * MODEL.sigma_step)
        fails += not SeedBand().compare(RULE, controls, test).passed
    return fails / cases


def test_equivalent_run_passes_with_p_values() -> None:
    rng = np.random.default_rng(7)
    controls, test = simulate_case(rng, MODEL, 4)
    verdict = SeedBand().compare(RULE, controls, test)
    assert verdict.passed, verdict.message
    assert set(verdict.p_values) == {"tost_lower", "tost_upper"}
    assert max(verdict.p_values.values()) < 0.05
    assert verdict.steps_compared == MODEL.num_steps
    assert verdict.tolerance_at_max is not None and verdict.tolerance_at_max > 0


def test_shifted_run_fails_and_says_where() -> None:
    rng = np.random.default_rng(8)
    controls, test = simulate_case(rng, MODEL, 4, shift=5 * MODEL.sigma_step, shift_from=120)
    verdict = SeedBand().compare(RULE, controls, test)
    assert not verdict.passed
    assert verdict.first_divergent_step is not None and verdict.first_divergent_step >= 115
    assert verdict.max_deviation_step is not None and verdict.max_deviation_step >= 120
    assert "outside the seed band" in verdict.message


def test_doubled_grad_norm_fails_the_band() -> None:
    rng = np.random.default_rng(9)
    controls = [simulate_run(rng, MODEL, metric="grad_norm") for _ in range(3)]
    test = simulate_run(rng, MODEL, metric="grad_norm")
    doubled = Curve("grad_norm", test.steps, 2 * test.values)
    rule = ComparisonRule(metric="grad_norm", method="seed")
    assert SeedBand().compare(rule, controls, test).passed
    assert not SeedBand().compare(rule, controls, doubled).passed


def test_final_window_shift_fails_the_equivalence_test_with_a_set_margin() -> None:
    rng = np.random.default_rng(10)
    controls, test = simulate_case(rng, MODEL, 5, shift=0.05, shift_from=181)
    strict = ComparisonRule(metric="loss", method="seed", margin=0.01, window=20)
    verdict = SeedBand().compare(strict, controls, test)
    assert not verdict.passed
    assert verdict.p_values["tost_upper"] > 0.05
    assert "not shown equivalent" in verdict.message


def test_band_is_never_zero_width() -> None:
    """Identical replicates (same seed) still give a band as wide as one run's batch noise."""
    run = simulate_run(np.random.default_rng(3), MODEL)
    band = seed_band([run, run, run])
    assert float(band.half_width.min()) > 0.5 * MODEL.sigma_fast
    smooth = Curve("lr", run.steps, np.linspace(1e-3, 1e-4, len(run)))
    assert float(seed_band([smooth, smooth]).half_width.min()) > 0


def test_one_replicate_is_a_clear_failure() -> None:
    run = simulate_run(np.random.default_rng(4), MODEL)
    verdict = SeedBand().compare(RULE, [run], run)
    assert not verdict.passed and "at least 2 control replicates" in verdict.message


def test_default_margin_shrinks_with_more_replicates() -> None:
    factors = [default_margin_factor(k, 0.05) for k in (3, 5, 20)]
    assert factors[0] > factors[1] > factors[2] > 3.0


@pytest.mark.parametrize("num_replicates", [3, 5])
def test_false_alarm_rate_is_at_most_alpha(num_replicates: int) -> None:
    rate = false_alarm_and_power(num_replicates, 0.0, cases=400, seed=100 + num_replicates)
    # alpha = 0.05; 0.03 allows for the binomial spread of 400 cases (sd ~0.011).
    assert rate <= 0.05 + 0.03


@pytest.mark.parametrize("num_replicates", [3, 5])
def test_power_on_a_clear_shift_is_high(num_replicates: int) -> None:
    rate = false_alarm_and_power(num_replicates, 4.0, cases=100, seed=200 + num_replicates)
    assert rate >= 0.95
