"""Synthetic loss curves with a known truth, to calibrate and test the seed band.

A run's loss is ``mean(step) + slow(step) + fast(step)``: a decaying mean curve (steep at
first, as real losses are), a slow seed-dependent wander (AR(1), correlation ``phi`` per step:
where a seed's trajectory sits relative to the others drifts slowly) and fast per-step batch
noise. Replicates and the test are independent draws; a ``shift`` is added to the test from
``shift_from`` on. Used by the unit tests and by ``benchmarks/stats_false_alarm.py``; not by
the verdicts themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convergence.metrics.curve import Curve


@dataclass(frozen=True, kw_only=True)
class NoiseModel:
    num_steps: int = 200
    start: float = 10.0
    end: float = 2.0
    decay_steps: float = 30.0
    sigma_slow: float = 0.02
    """Stationary std of the slow seed wander."""
    phi: float = 0.95
    sigma_fast: float = 0.03
    """Std of the per-step batch noise."""

    @property
    def sigma_step(self) -> float:
        """Per-step std of one run around the mean curve (the unit of a shift)."""
        return float(np.hypot(self.sigma_slow, self.sigma_fast))


def simulate_run(
    rng: np.random.Generator,
    model: NoiseModel,
    *,
    metric: str = "loss",
    shift: float = 0.0,
    shift_from: int = 1,
) -> Curve:
    steps = np.arange(1, model.num_steps + 1, dtype=np.int64)
    mean = model.end + (model.start - model.end) * np.exp(-steps / model.decay_steps)
    innovations = rng.normal(0.0, model.sigma_slow * np.sqrt(1 - model.phi**2), steps.size)
    slow = np.empty(steps.size)
    slow[0] = rng.normal(0.0, model.sigma_slow)
    for i in range(1, steps.size):
        slow[i] = model.phi * slow[i - 1] + innovations[i]
    fast = rng.normal(0.0, model.sigma_fast, steps.size)
    values = mean + slow + fast + np.where(steps >= shift_from, shift, 0.0)
    return Curve(metric, steps, values.astype(np.float64))


def simulate_case(
    rng: np.random.Generator,
    model: NoiseModel,
    num_replicates: int,
    *,
    shift: float = 0.0,
    shift_from: int = 1,
) -> tuple[list[Curve], Curve]:
    """K control replicates and one test run (shifted by ``shift`` from ``shift_from``)."""
    controls = [simulate_run(rng, model) for _ in range(num_replicates)]
    return controls, simulate_run(rng, model, shift=shift, shift_from=shift_from)
