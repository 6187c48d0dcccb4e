"""Control health: a control is a reference only if it learns, and learns honestly.

A pair certifies "the test trains like the control". That means nothing when the control itself
does not train (a flat line: a zero learning rate, frozen weights, a broken optimizer -- any test
that is equally broken would pass), or when the control beats what any correct model can reach
on the data (a leak: a broken causal mask lets a token see its own target, and the loss falls
below the data's entropy floor). Either way the pair is an *error*, not a pass or a fail.

Thresholds, and why:
- Judged on the mean of the first and of the last WINDOW logged losses (not single steps: one
  batch's loss moves by ~0.05 nats on the debug config from batch noise alone).
- "Learns": the loss fell by at least MIN_DROP_FRACTION of the gap between the first window and
  the entropy floor (or of the first window's value when the data has no known floor). 5% is far
  below what a healthy run does (the debug config closes ~15% of its gap in 30 steps) and far
  above what a frozen run shows (batch noise only, <1%).
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
    if gap > 0 and drop < MIN_DROP_FRACTION * gap:
        target = "the entropy floor" if floor is not None else "zero"
        return (
            f"the control did not learn: its loss went from {first:.4g} to {last:.4g} (means "
            f"of the first and last {WINDOW} steps), less than {MIN_DROP_FRACTION:.0%} of the "
            f"way to {target}; a flat control certifies nothing. Check its learning rate, "
            f"optimizer and steps"
        )
    return None
