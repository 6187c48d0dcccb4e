"""Numbers every report shows, computed once from an outcome's curves.

The *reference* a test curve is compared with is the control curve (paired regime) or the
centre of the band the seed verdict held the test to (seed regime: the replicates' smoothed
mean, carried by the verdict), so |Δ| in every report means the same thing as the verdict's
``max_deviation``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from convergence.metrics.curve import Curve
from convergence.regimes import REGISTRY
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.stats.regression import steady_median

#: One row of a divergence table: (step, control, test, test - control); None where missing.
DivergenceRow = tuple[int, float | None, float | None, float | None]

DEFAULT_Z = 3.0
"""Band z when the rule states none (the seed method's default)."""


@dataclass(frozen=True, kw_only=True)
class ControlBand:
    """The seed verdict's band of one metric as the reports draw it: centre ± half-width."""

    steps: npt.NDArray[np.int64]
    center: npt.NDArray[np.float64]
    half_width: npt.NDArray[np.float64]
    num_replicates: int
    z: float
    label: str = ""
    """What the band is, where its method says (``details["band_label"]``: the margin
    comparison's mean +- margin); "" for the seed band's z-band."""


def band_z(outcome: PairOutcome, metric: str) -> float:
    rule = outcome.pair.rule_for(metric)
    return float(rule.z) if rule is not None and rule.z is not None else DEFAULT_Z


def replicate_band(outcome: PairOutcome, metric: str) -> ControlBand | None:
    """The band the seed verdict held the test to (None for other methods, and for verdicts
    without a band: errored pairs, outcomes saved before verdicts carried one).

    Read from the verdict, never rebuilt from the replicates: the report then draws and
    measures from exactly the band that decided, whatever the method computes it from.
    """
    verdict = outcome.verdict(metric)
    if verdict is None or verdict.band is None or not verdict.band.steps:
        return None
    # Only a band of control replicates (the regimes say whose method draws one).
    if not any(r.band_of_replicates and r.method == verdict.method for r in REGISTRY.all()):
        return None
    lower = np.asarray(verdict.band.lower, dtype=np.float64)
    upper = np.asarray(verdict.band.upper, dtype=np.float64)
    replicates = len(outcome.control.replicates) if outcome.control is not None else 0
    return ControlBand(
        steps=np.asarray(verdict.band.steps, dtype=np.int64),
        center=(lower + upper) / 2,
        half_width=(upper - lower) / 2,
        num_replicates=replicates,
        z=band_z(outcome, metric),
        label=str(verdict.details.get("band_label", "")),
    )


def reference_curve(outcome: PairOutcome, metric: str) -> Curve | None:
    """What the test is compared with: the band centre (seed regime) or the control curve."""
    band = replicate_band(outcome, metric)
    if band is not None:
        return Curve(metric, band.steps, band.center)
    if outcome.control is None:
        return None
    curve = outcome.control.metrics.get(metric)
    return curve if curve is not None and len(curve) else None


def curve_of_test(outcome: PairOutcome, metric: str) -> Curve | None:
    if outcome.test is None:
        return None
    curve = outcome.test.metrics.get(metric)
    return curve if curve is not None and len(curve) else None


def aligned_delta(
    outcome: PairOutcome, metric: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]] | None:
    """Steps logged by both sides and test - reference at those steps."""
    ref, test = reference_curve(outcome, metric), curve_of_test(outcome, metric)
    if ref is None or test is None:
        return None
    steps, ri, ti = np.intersect1d(ref.steps, test.steps, return_indices=True)
    if steps.size == 0:
        return None
    return steps.astype(np.int64), test.values[ti] - ref.values[ri]


def max_abs_delta(outcome: PairOutcome, metric: str) -> float | None:
    """max |test - reference| over common steps; NaN when either side went non-finite."""
    found = aligned_delta(outcome, metric)
    if found is None:
        return None
    delta = np.abs(found[1])
    if not np.all(np.isfinite(delta)):
        return float("nan")
    return float(delta.max())


def side_stat(side: SideOutcome | None, metric: str, how: str) -> float | None:
    """Summary of a per-step resource metric: ``median`` (throughput) or ``max`` (memory).

    The median is the regression rule's own (:func:`~convergence.stats.regression.steady_median`:
    after the warm-up steps, which include the allocator's and compile's start), so the
    report's tokens/s change and a tokens/s verdict's are one number.
    """
    if side is None or metric not in side.metrics:
        return None
    curve = side.metrics[metric]
    values = curve.values[np.isfinite(curve.values)]
    if values.size == 0:
        return None
    if how == "max":
        return float(values.max())
    return steady_median(curve)[0]


def ratio(test: float | None, control: float | None) -> float | None:
    if test is None or control is None or control == 0:
        return None
    return test / control


def divergence_table(
    outcome: PairOutcome, metric: str = "loss", around: int = 3
) -> list[DivergenceRow]:
    """Rows around the first divergent step (else the step of the largest deviation).

    ``control`` is the band centre (smoothed replicate mean) for the seed regime. Empty when
    there is nothing to
    centre on (no verdict for ``metric``, or no curves).
    """
    verdict = outcome.verdict(metric)
    center = None
    if verdict is not None:
        center = verdict.first_divergent_step or verdict.max_deviation_step
    ref, test = reference_curve(outcome, metric), curve_of_test(outcome, metric)
    if center is None or (ref is None and test is None):
        return []
    ref_map = _as_map(ref)
    test_map = _as_map(test)
    steps = sorted(set(ref_map) | set(test_map))
    i = min(int(np.searchsorted(np.asarray(steps), center)), len(steps) - 1)
    rows: list[DivergenceRow] = []
    for step in steps[max(0, i - around) : i + around + 1]:
        cv, tv = ref_map.get(step), test_map.get(step)
        rows.append((step, cv, tv, None if cv is None or tv is None else tv - cv))
    return rows


def _as_map(curve: Curve | None) -> dict[int, float]:
    if curve is None:
        return {}
    return dict(zip(curve.steps.tolist(), curve.values.tolist(), strict=True))
