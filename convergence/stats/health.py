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
  entropy floor (or of the first window's value when the data has no known floor). The
  fraction scales with the run's length: MIN_DROP_FRACTION (5%) x min(1, steps /
  FULL_FRACTION_STEPS). Early in training the progress a healthy run makes is about
  proportional to the steps it took (slower still in the warmup), so a fixed fraction asks a
  short run for a higher *rate* than a long one: 5% of the gap in 20 steps is 5x the rate it
  asks of 100 steps. Scaled, it asks every run for the same rate, 0.05% of the gap per step
  -- at 30 steps 1.5%, where the debug config closes ~15% (10x) and torchtitan's debug model
  ~7%; at 20 steps 1%, where that model closes ~4% (the fixed 5% of before made a correct
  20-step torchtitan pair an error). From FULL_FRACTION_STEPS on it is the 5% of before.
- The drop is a difference of two window means, each a draw of batch noise: the check errs
  only when the drop is below the fraction by more than NOISE_Z standard deviations of that
  difference (the step-to-step scatter measured on the curve itself, from successive
  differences, which a trend of a few 1e-3 nats per step does not inflate). A correct run
  then errs with probability ~1e-3 (the normal tail at 3), whatever its length and batch.
  What that costs: where the noise is as large as the fraction -- torchtitan's debug model at
  local batch 2 scatters by ~0.09 nats per step, its 20-step windows by ~0.06, against 1% of
  its gap (~0.03) -- the loss cannot tell a flat short run from a learning one, and says
  nothing. The parameters can:
- "Moves": where the run logs its update norm (update_norm: the built-in trainer, the
  torchtitan launcher), a control whose parameters never changed (update norm 0 at every
  logged step: a zero learning rate, frozen weights, an optimizer that never steps) did not
  learn, at any length and noise.
- Only from MIN_STEPS logged steps on: short runs (1-12 steps, mostly warm-up) may not have
  learned yet, and say nothing.
- "Honest": the last window's mean may not go below the floor by more than
  max(FLOOR_MARGIN_NATS, FLOOR_MARGIN_FRACTION * floor). A training loss is a batch mean, so a
  good run at the floor dips below it by batch noise (~0.02 nats on a 10-step window); a leak
  drops far below (to near 0 for a causal-mask bug).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from convergence.metrics.curve import Curve
from convergence.stats.fingerprint import METRIC as FINGERPRINT
from convergence.stats.types import MetricVerdict

WINDOW = 5
MIN_STEPS = 20
MIN_DROP_FRACTION = 0.05
FULL_FRACTION_STEPS = 100
NOISE_Z = 3.0
FLOOR_MARGIN_NATS = 0.1
FLOOR_MARGIN_FRACTION = 0.05


def control_problem(
    loss: Curve | None, entropy_floor: float | None, update: Curve | None = None
) -> str | None:
    """Why this control is not a trustworthy reference (None when it is): from its loss
    curve and, where logged, its update norm (``update_norm``)."""
    if update is not None and len(update) >= WINDOW and not np.any(update.values != 0):
        return (
            f"the control did not learn: its parameters never changed (update norm 0 at all "
            f"{len(update)} logged steps); a frozen control certifies nothing. Check its "
            f"learning rate, optimizer and which parameters require gradients"
        )
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
    if gap > 0 and drop < fraction * gap - noise:
        target = "the entropy floor" if floor is not None else "zero"
        return (
            f"the control did not learn: its loss went from {first:.4g} to {last:.4g} (means "
            f"of the first and last {WINDOW} steps), less than {fraction:.2%} of the way to "
            f"{target} (the least a {len(loss)}-step run must close) by more than its batch "
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


# -- a reference that stops being one ---------------------------------------------------------
#
# The trajectory verdicts (paired band, twin envelope) compare a test's curve with the control's
# step by step. That holds while the control group's runs -- the control and its twins, which
# differ by legitimate rounding only -- stay on one trajectory. A training that hits an
# instability (a grad-norm spike, capped by clipping) stops being one trajectory: whether a run
# spikes at step s is then a rounding draw, and a correct test that draws a spike where the
# control did not (or the reverse) leaves any pointwise band. From such a step on, a test
# leaving the band is not evidence of a bug: the reference itself is unreliable there.
#
# Two signs, each read on the control group alone (never on the test):
# - SPLIT: a twin's grad norm differs from the control's by more than a factor SPLIT_FACTOR at a
#   step. Rounding moves a twin's grad norm by ~1e-4 relative on the calibrated configs (the
#   twin envelope's rtol); a factor 2 between two runs of one training means one of them spiked
#   and the other did not.
# - JUMP: the control's grad norm is more than JUMP_FACTOR x the median of its previous
#   JUMP_WINDOW steps: a spike, in a regime with or without twins.
# Measured on every saved twin-regime pair (benchmarks/detection/envelope/: 120 pairs, 69
# correct and 51 planted bugs, configs A, B, C, 60-500 steps; benchmarks/detection/
# reference_unreliable.py, BENCHMARKS.md "Verdict V"): the signs fire on config C's 500-step
# control group (split at 46, jump at 51; its correct TP pair's false alarm is at step 104)
# and on B's at seed 9 (jump at 57 of 60), nowhere else; no planted bug fails only after them.
# A verdict that does not follow a trajectory -- the anchored check (one step from the
# control's state), the data fingerprint -- is not affected and still fails the pair.
SPLIT_FACTOR = 2.0
JUMP_FACTOR = 3.0
JUMP_WINDOW = 10


def unreliable_from(control: Curve | None, twins: Sequence[Curve] = ()) -> tuple[int, str] | None:
    """(the first step from which the control group is no reference, why), or None.
    ``control``, ``twins``: the grad-norm curves of the control and of its twins."""
    found: list[tuple[int, str]] = []
    if control is None or len(control) == 0:
        return None
    by_step = dict(zip(control.steps.tolist(), control.values.tolist(), strict=True))
    for i, twin in enumerate(twins):
        for step, value in zip(twin.steps.tolist(), twin.values.tolist(), strict=True):
            base = by_step.get(step)
            if base is None or not (base > 0 and value > 0):
                continue
            ratio = max(value / base, base / value)
            if ratio > SPLIT_FACTOR:
                found.append(
                    (
                        step,
                        f"twin {i + 1}'s grad norm is {ratio:.3g}x the control's at step {step} "
                        f"(the control group's runs split: one spiked, one did not)",
                    )
                )
                break
    values = control.values
    for i in range(JUMP_WINDOW, len(values)):
        median = float(np.median(values[i - JUMP_WINDOW : i]))
        if median > 0 and values[i] > JUMP_FACTOR * median:
            step = int(control.steps[i])
            found.append(
                (
                    step,
                    f"the control's grad norm spikes to {values[i]:.3g} at step {step}, "
                    f"{values[i] / median:.3g}x the median of its previous {JUMP_WINDOW} steps",
                )
            )
            break
    return min(found) if found else None


def unreliable_reference(
    verdicts: Sequence[MetricVerdict], unreliable: tuple[int, str] | None
) -> str | None:
    """The pair's error when every failing gating verdict follows a trajectory and first failed
    at or after the step the reference became unreliable (None: the failure stands)."""
    if unreliable is None:
        return None
    step, why = unreliable
    failing = [v for v in verdicts if v.gate and not v.passed]
    if not failing:
        return None
    for verdict in failing:
        if verdict.metric in NOT_TRAJECTORIES or verdict.first_divergent_step is None:
            return None
        if verdict.first_divergent_step < step:
            return None
    first = min(failing, key=lambda v: v.first_divergent_step or 0)
    return (
        f"reference unreliable after step {step - 1}: {why}. The test first left it at step "
        f"{first.first_divergent_step} ({first.metric}), past that step, where a pointwise "
        f"comparison measures which run drew a spike, not the layout: not a failure, and not "
        f"a pass. Judge it from shared states instead (anchor_every), or at a steadier "
        f"learning rate / with fewer steps"
    )


#: Verdicts that do not compare trajectories: their failures stand past an unreliable step.
NOT_TRAJECTORIES = frozenset({"anchored", FINGERPRINT})
