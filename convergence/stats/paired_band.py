"""``paired``: a per-step band around the control, sized by the numerical noise floor.

The paired regime runs control and test from the same seed checkpoint, on the same samples in
the same order, with deterministic kernels. The only legitimate difference is then the order of
floating-point reductions (a TP all-reduce sums partial matmuls in another order than one
device; FSDP reduce-scatters gradients in buckets). That noise is tiny and measurable: here, in
fp32 on CPU, |loss(FSDP) - loss(FSDP+TP)| <= 5e-7 over 100 steps, with losses of ~2-10.

    tol(step) = atol * (1 + growth * sqrt(step)) + rtol * |control(step)|

- ``atol`` is the floor at step 1. Rounding differences feed back through the optimizer and
  accumulate roughly like a random walk, hence the sqrt(step) growth rather than linear.
- ``rtol`` keeps the band meaningful for metrics whose scale is not ~1 (float32 spacing is
  relative: a value of 10 carries 10x the rounding of a value of 1).

Defaults for the loss: atol 1e-5, growth 0.1, rtol 1e-6. At step 100 that is ~2.5e-5 for a
loss of 3: 50x the measured floor, so reduction-order noise never fails a pair; at step 1000 it
is ~4.5e-5, still 200x below 1e-2. A real bug is far outside: a gradient scaled by 2 under Adam
moves the loss by ~1e-2 (Adam normalizes the scale away, almost) -- 400x the tolerance -- while
it doubles the grad norm.

The grad norm is judged mostly relatively (rtol 2e-5 plus a small growing atol): its scale
varies during training (spikes, clipping) and its reduction-order noise is relative (a sum of
squares over shards). Measured here in fp32 on CPU over 100 steps of the debug model: FSDP2 vs
FSDP2+TP differ by at most 2e-8 relative, DDP vs FSDP by 2e-16. 2e-5 is ~1000x that floor. It
has to be that tight: a planted bug that doubles ONE weight's gradient (layer 0's MLP output)
moves the total grad norm by only 2.7e-4 relative and leaves an Adam loss curve bit-identical
(Adam's update is invariant to the gradient's scale), so the grad norm is the only witness.

The per-part grad norm (``grad_norm_parts``: the geometric mean over the model's parts of each
part's gradient norm, rank/norms.py) has the grad norm's tolerance. Its noise is the parts'
reduction-order noise averaged: measured FSDP2 vs FSDP2+CP2 at steps 1-3, every part within
1.2e-7 relative. It exists for bugs the total cannot see: a rotary offset dropped under CP moves
the query/key gradients by 2e-3..9e-3 relative at step 1, the geometric mean by ~6e-4 (30x
the tolerance), the total by less than 2e-5.

The learning rate comes from the schedule, not from the model: it must agree to float64
rounding. ``rule.atol`` / ``rule.growth`` / ``rule.rtol`` override each default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from convergence.calibration.select import calibrated
from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import (
    ComparisonDefaults,
    Floats,
    Ints,
    align,
    failed,
    first_true,
    incomplete,
    point_check,
    tolerance_at,
    worst,
)
from convergence.stats.types import Band, Check, MetricVerdict, Tolerance


@dataclass(frozen=True, kw_only=True)
class PairedTolerance:
    atol: float
    growth: float
    rtol: float

    def at(self, steps: Ints, control: Floats) -> Floats:
        floor = self.atol * (1.0 + self.growth * np.sqrt(steps.astype(np.float64)))
        return floor + self.rtol * np.abs(control)

    def describe(self) -> str:
        if self.growth == 0:
            return f"atol {self.atol:g} + rtol {self.rtol:g}*|control|"
        return f"atol {self.atol:g}*(1+{self.growth:g}*sqrt(step)) + rtol {self.rtol:g}*|control|"


_LOSS = PairedTolerance(atol=1e-5, growth=0.1, rtol=1e-6)
#: Calibrated defaults per metric (see the module docstring); other metrics use the loss's.
PAIRED_DEFAULTS: dict[str, PairedTolerance] = {
    "loss": _LOSS,
    "val_loss": _LOSS,
    "grad_norm": PairedTolerance(atol=1e-7, growth=0.1, rtol=2e-5),
    "grad_norm_parts": PairedTolerance(atol=1e-7, growth=0.1, rtol=2e-5),
    "update_norm_parts": PairedTolerance(atol=1e-7, growth=0.1, rtol=2e-5),
    "lr": PairedTolerance(atol=1e-12, growth=0.0, rtol=1e-9),
}


def paired_tolerance(rule: ComparisonRule) -> PairedTolerance:
    """The rule's tolerance: its own parameters where set, else the metric's defaults."""
    base = calibrated("paired", rule.metric, PAIRED_DEFAULTS.get(rule.metric, _LOSS))
    return PairedTolerance(
        atol=base.atol if rule.atol is None else rule.atol,
        growth=base.growth if rule.growth is None else rule.growth,
        rtol=base.rtol if rule.rtol is None else rule.rtol,
    )


def envelope_verdict(
    rule: ComparisonRule,
    method: Method,
    controls: Sequence[Curve],
    test: Curve,
    tol: Tolerance,
    *,
    band: str,
) -> MetricVerdict:
    """Pointwise check ``|test - control| <= tol(step)`` at every common step (paired,
    allclose and twin share it: allclose is the envelope without growth, twin sizes it from
    a twin run)."""
    described = tol.describe()
    problem = incomplete(controls, test)
    if problem:
        return failed(
            rule,
            method,
            problem,
            tolerance=described,
            band=_full_band(tol, controls[0] if controls else None),
        )
    pairs = align(controls[0], test)
    if pairs.steps.size == 0:
        return failed(
            rule,
            method,
            "no step logged by both runs",
            tolerance=described,
            band=_full_band(tol, controls[0]),
        )
    tolerance = tol.at(pairs.steps, pairs.control)
    deviation = np.abs(pairs.test - pairs.control)
    outside = ~(deviation <= tolerance)  # NaN is outside
    max_dev, max_step, index = worst(deviation, pairs.steps)
    # The step closest to its limit says more than the largest raw deviation.
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isnan(deviation), np.inf, deviation / tolerance)
    first = first_true(outside, pairs.steps)
    passed = first is None
    if passed:
        message = (
            f"{rule.metric}: within {band} at all {pairs.steps.size} steps "
            f"(max |diff| {max_dev:.3g} at step {max_step}, "
            f"{float(ratio.max()):.2g}x of the tolerance at worst)"
        )
    else:
        first_i = int(np.argmax(outside))
        message = (
            f"{rule.metric}: outside {band} at {int(outside.sum())} of "
            f"{pairs.steps.size} steps, first at step {first} "
            f"(|diff| {deviation[first_i]:.3g} > tol {tolerance[first_i]:.3g}); "
            f"max |diff| {max_dev:.3g} at step {max_step}"
        )
    return MetricVerdict(
        metric=rule.metric,
        method=method,
        passed=passed,
        gate=rule.gate,
        steps_compared=int(pairs.steps.size),
        first_divergent_step=first,
        max_deviation=max_dev,
        max_deviation_step=max_step,
        tolerance=described,
        tolerance_at_max=None if index is None else float(tolerance[index]),
        message=message,
        band=Band.of(pairs.steps, pairs.control - tolerance, pairs.control + tolerance),
        details={
            "max_ratio": _json_float(float(ratio.max())),
            "atol": tol.atol,
            "growth": tol.growth,
            "rtol": tol.rtol,
            "steps_outside": int(outside.sum()),
        },
    )


def _full_band(tol: Tolerance, control: Curve | None) -> Band | None:
    """The band at every step the control logged: what a test that stopped early (or logged
    other steps) would have had to stay in."""
    if control is None or len(control) == 0:
        return None
    tolerance = tol.at(control.steps, control.values)
    return Band.of(control.steps, control.values - tolerance, control.values + tolerance)


class PairedBand(ComparisonDefaults):
    method: Method = "paired"
    calibrated = True  # its parameters come from the calibration in force (calibration/)

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        return point_check(controls[0], tolerance_at(paired_tolerance(rule)))

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        return paired_tolerance(rule)  # its growth term is nil at step 1

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        return envelope_verdict(
            rule, self.method, controls, test, paired_tolerance(rule), band="the paired band"
        )


def _json_float(value: float) -> float | None:
    """JSON has no inf/NaN: a NaN test value makes the ratio infinite."""
    return value if np.isfinite(value) else None
