"""Control health: a flat control or one below the entropy floor is not a reference."""

from __future__ import annotations

import numpy as np

from convergence.metrics.curve import Curve
from convergence.stats.health import MIN_STEPS, control_problem

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
    problem = control_problem(noisy(5.99, 5.98), FLOOR)
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
    assert control_problem(noisy(5.99, 5.98), None) is not None
