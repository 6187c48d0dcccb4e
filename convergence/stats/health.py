"""Control health: a control is a reference only if it learns, and learns honestly.

A pair certifies "the test trains like the control". That means nothing when the control itself
does not train (a flat line: a zero learning rate, frozen weights, a broken optimizer -- any test
that is equally broken would pass), or when the control beats what any correct model can reach
on the data (a leak: a broken causal mask lets a token see its own target, and the loss falls
below the data's entropy floor). Either way the pair is an *error*, not a pass or a fail.

Thresholds, and why:
- Judged on the mean of the first and of the last WINDOW logged losses (not single steps: one
  batch's loss moves by ~0.05 nats on the debug config from batch noise alone).
- "Learns": the loss fell by at least a fraction of the gap between the first window and the
  entropy floor (or of the first window's value when the data has no known floor), and by more
  than its batch noise can explain. Both bounds, and why:
  * The fraction scales with the run's length: MIN_DROP_FRACTION (5%) x min(1, steps /
    FULL_FRACTION_STEPS). Early in training the progress a healthy run makes is about
    proportional to the steps it took (slower still in the warmup), so a fixed fraction asks
    a short run for a higher *rate* than a long one: 5% of the gap in 20 steps is 5x the rate
    it asks of 100 steps. Scaled, it asks every run for the same rate, 0.05% of the gap per
    step -- at 30 steps 1.5%, where the debug config closes ~15% (10x) and torchtitan's debug
    model ~7%; at 20 steps 1%, where that model closes ~4% (the 5% of before made a correct
    20-step torchtitan pair an error). From FULL_FRACTION_STEPS on it is the 5% of before.
  * A short run's fraction is small enough for batch noise to reach it (a frozen run's two
    window means differ by batch noise only, <1% of the gap), so the drop must also exceed
    NOISE_Z standard deviations of the difference of two window means, the step-to-step
    scatter measured on the curve itself (successive differences: a trend of a few 1e-3 nats
    per step does not inflate it). A frozen run passes that by chance with probability ~1e-3
    (one-sided normal tail at 3), at any length.
- Only from MIN_STEPS logged steps on: short runs (1-12 steps, mostly warm-up) may not have
  learned yet, and say nothing.
- "Honest": the last window's mean may not go below the floor by more than
  max(FLOOR_MARGIN_NATS, FLOOR_MARGIN_FRACTION * floor). A training loss is a batch mean, so a
  good run at the floor dips below it by batch noise (~0.02 nats on a 10-step window); a leak
  drops far below (to near 0 for a causal-mask bug).
"""

from __future__ import annotations

import math

import numpy as np

from convergence.metrics.curve import Curve

WINDOW = 5
MIN_STEPS = 20
MIN_DROP_FRACTION = 0.05
FULL_FRACTION_STEPS = 100
NOISE_Z = 3.0
FLOOR_MARGIN_NATS = 0.1
FLOOR_MARGIN_FRACTION = 0.05


def control_problem(loss: Curve | None, entropy_floor: float | None) -> str | None:
    """Why this control loss curve is not a trustworthy reference (None when it is)."""
    if loss is None or len(loss) == 0:
        return None  # a missing loss is reported by the loss verdict itself
    values = loss.values[np.isfinite(loss.values)]
    if len(values) < WINDOW:
        return None
    first, last = float(values[:WINDOW].mean()), float(values[-WINDOW:].mean())
    floor = entropy_floor if entropy_floor is not None and math.isfinite(entropy_floor) else None
    if floor is not None:
        margin = max(FLOOR_MARGIN_NATS, FLOOR_MARGIN_FRACTION * floor)
        if last < floor - margin:
            return (
                f"the control's loss ({last:.4g}, mean of its last {WINDOW} steps) is below "
                f"the data's entropy floor {floor:.4g} by more than {margin:.3g}: no correct "
                f"model can do that, so the control leaks (e.g. a broken causal mask) and is "
                f"no reference; fix the control layout or its hook"
            )
    if len(loss) < MIN_STEPS:
        return None
    gap = first - floor if floor is not None else abs(first)
    drop = first - last
    fraction = min_drop_fraction(len(loss))
    noise = NOISE_Z * window_difference_sd(values)
    if gap > 0 and (drop < fraction * gap or drop <= noise):
        target = "the entropy floor" if floor is not None else "zero"
        return (
            f"the control did not learn: its loss went from {first:.4g} to {last:.4g} (means "
            f"of the first and last {WINDOW} steps), less than {fraction:.2%} of the way to "
            f"{target} (the least a {len(loss)}-step run must close) or no more than its batch "
            f"noise ({noise:.3g}); a flat control certifies nothing. Check its learning rate, "
            f"optimizer and steps"
        )
    return None


def min_drop_fraction(num_steps: int) -> float:
    """The fraction of the gap a run of ``num_steps`` logged steps must close (module
    docstring: the same rate of progress asked of every length)."""
    return MIN_DROP_FRACTION * min(1.0, num_steps / FULL_FRACTION_STEPS)


def window_difference_sd(values: np.ndarray) -> float:
    """The standard deviation of (mean of the first WINDOW) - (mean of the last WINDOW) under
    batch noise alone: the per-step scatter from successive differences (var(x[i+1] - x[i])
    = 2 sigma^2 for independent batches; the trend's share is its per-step slope, squared),
    times sqrt(2 / WINDOW)."""
    steps = np.diff(values)
    if steps.size < 2:
        return 0.0
    sigma = float(np.std(steps)) / math.sqrt(2.0)
    return sigma * math.sqrt(2.0 / WINDOW)
