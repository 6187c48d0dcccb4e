"""Control health: a flat control or one below the entropy floor is not a reference."""

from __future__ import annotations

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.stats.health import (
    FULL_FRACTION_STEPS,
    JUMP_FACTOR,
    MIN_DROP_FRACTION,
    MIN_STEPS,
    SPLIT_FACTOR,
    control_problem,
    min_drop_fraction,
    unreliable_from,
    unreliable_reference,
)
from convergence.stats.types import MetricVerdict

FLOOR = 3.09  # the debug config's synthetic data


def curve(values: np.ndarray) -> Curve:
    return Curve("loss", np.arange(1, len(values) + 1, dtype=np.int64), values.astype(float))


def noisy(start: float, end: float, steps: int = 30, seed: int = 0) -> Curve:
    rng = np.random.default_rng(seed)
    return curve(np.linspace(start, end, steps) + rng.normal(0, 0.05, steps))


def test_a_learning_control_is_healthy() -> None:
    # The debug config's own 30-step curve goes 5.99 -> 5.51 (measured).
    assert control_problem(noisy(5.99, 5.51), FLOOR) is None
    assert control_problem(noisy(5.99, 3.10), FLOOR) is None  # at the floor, noise below it


def test_a_flat_control_did_not_learn() -> None:
    # 100 steps: 5% of the gap (0.15 nats) is far above the noise of the drop (3 sd ~ 0.1).
    problem = control_problem(noisy(5.99, 5.98, steps=100), FLOOR)
    assert problem is not None and "did not learn" in problem


def test_a_short_run_is_not_judged_on_learning() -> None:
    assert control_problem(noisy(5.99, 5.98, steps=MIN_STEPS - 1), FLOOR) is None


def test_below_the_floor_is_a_leak() -> None:
    problem = control_problem(noisy(5.99, 1.0), FLOOR)
    assert problem is not None and "entropy floor" in problem and "leak" in problem
    # Even a short run is caught: no correct model can undercut the floor.
    assert control_problem(noisy(5.99, 0.5, steps=8), FLOOR) is not None


def test_without_a_floor_only_learning_is_judged() -> None:
    assert control_problem(noisy(5.99, 1.0), None) is None
    assert control_problem(noisy(5.99, 5.98, steps=100), None) is not None


def test_the_fraction_to_close_scales_with_the_run_length() -> None:
    """The same rate of progress is asked of every length: 0.05% of the gap per step, up to
    the 5% of a 100-step run (stats/health.py's docstring)."""
    assert min_drop_fraction(100) == MIN_DROP_FRACTION == min_drop_fraction(500)
    assert min_drop_fraction(20) == pytest.approx(MIN_DROP_FRACTION * 20 / FULL_FRACTION_STEPS)
    rates = [min_drop_fraction(n) / n for n in range(MIN_STEPS, FULL_FRACTION_STEPS + 1)]
    assert max(rates) == pytest.approx(min(rates))


def _closing(fraction: float, steps: int, sigma: float, seed: int) -> Curve:
    """A run that closes ``fraction`` of its gap to FLOOR linearly, with batch noise ``sigma``."""
    rng = np.random.default_rng(seed)
    start = 5.99
    return curve(
        np.linspace(start, start - fraction * (start - FLOOR), steps) + rng.normal(0, sigma, steps)
    )


def test_a_short_correct_run_is_healthy() -> None:
    """A 20-step run that closes 4% of its gap (a correct torchtitan debug-model pair closes
    ~4.1%: under the fixed 5% of before, an error) is healthy: 4% is above the 1% a 20-step run
    must close, whatever the noise (the check errs only below the fraction)."""
    for sigma in (0.0, 0.02, 0.1):
        for seed in range(5):
            assert control_problem(_closing(0.04, MIN_STEPS, sigma, seed), FLOOR) is None


def test_a_short_flat_run_did_not_learn_where_the_evidence_says_so() -> None:
    """A 20-step flat run errs where its loss shows it (below the fraction by more than the
    noise), or where its parameters never moved; a noisy flat loss alone says nothing."""
    problem = control_problem(_closing(0.0, MIN_STEPS, 0.0, 0), FLOOR)
    assert problem is not None and "did not learn" in problem
    # Batch noise 0.1 nats: 3 sd of the drop (~0.19) dwarfs 1% of the gap (~0.03).
    noisy_flat = _closing(0.0, MIN_STEPS, 0.1, 0)
    assert control_problem(noisy_flat, FLOOR) is None
    frozen = Curve("update_norm", noisy_flat.steps, np.zeros(MIN_STEPS))
    problem = control_problem(noisy_flat, FLOOR, frozen)
    assert problem is not None and "parameters never changed" in problem
    moving = Curve("update_norm", noisy_flat.steps, np.full(MIN_STEPS, 0.1))
    assert control_problem(_closing(0.04, MIN_STEPS, 0.1, 0), FLOOR, moving) is None
    # Closing more than the fraction at the shortest judged length: healthy.
    assert (
        control_problem(_closing(2 * min_drop_fraction(MIN_STEPS), MIN_STEPS, 0.0, 0), FLOOR)
        is None
    )


# -- a reference that stops being one (stats.health.unreliable_from) ---------------------------

STEPS = 60


def _grad_norm(spike_at: int | None = None, factor: float = 1.0) -> Curve:
    values = np.full(STEPS, 0.5) + 0.01 * np.sin(np.arange(STEPS))
    if spike_at is not None:
        values[spike_at - 1] *= factor
    return Curve("grad_norm", np.arange(1, STEPS + 1, dtype=np.int64), values)


def _failing(metric: str, step: int | None) -> MetricVerdict:
    return MetricVerdict(
        metric=metric,
        method="twin",
        passed=False,
        gate=True,
        steps_compared=STEPS,
        first_divergent_step=step,
        message=f"{metric}: outside",
    )


def test_twins_that_split_make_the_reference_unreliable_from_that_step() -> None:
    # A twin's grad norm just above SPLIT_FACTOR x the control's at step 30 (a spike the
    # control did not draw); rounding-level twins elsewhere.
    twin = _grad_norm(30, SPLIT_FACTOR * 1.01)
    found = unreliable_from(_grad_norm(), [_grad_norm(), twin])
    assert found is not None and found[0] == 30 and "twin 2" in found[1]
    assert unreliable_from(_grad_norm(), [_grad_norm(30, SPLIT_FACTOR * 0.99)]) is None


def test_a_spike_of_the_control_itself_makes_it_unreliable() -> None:
    found = unreliable_from(_grad_norm(40, JUMP_FACTOR * 1.1))
    assert found is not None and found[0] == 40 and "spikes" in found[1]
    assert unreliable_from(_grad_norm(40, JUMP_FACTOR * 0.9)) is None
    assert unreliable_from(_grad_norm()) is None


def test_a_failure_past_the_unreliable_step_is_the_references() -> None:
    unreliable = (30, "twin 1's grad norm is 2.5x the control's at step 30")
    error = unreliable_reference([_failing("loss", 41)], unreliable)
    assert error is not None and error.startswith("reference unreliable after step 29")
    assert "step 41 (loss)" in error
    # From the unreliable step itself on, too (the comparison at that step is the spike's).
    assert unreliable_reference([_failing("grad_norm", 30)], unreliable) is not None


def test_a_failure_before_it_or_not_on_a_trajectory_still_fails() -> None:
    unreliable = (30, "why")
    assert (
        unreliable_reference([_failing("loss", 41), _failing("grad_norm", 12)], unreliable) is None
    )
    # One step from the control's state (anchored) and the data are no trajectory.
    assert (
        unreliable_reference([_failing("loss", 41), _failing("anchored", 50)], unreliable) is None
    )
    assert unreliable_reference([_failing("data_fingerprint", 45)], unreliable) is None
    assert unreliable_reference([_failing("loss", 41)], None) is None
