"""``seed``: the test must look like one more control replicate (a band from K seeds + TOST).

Used when runs cannot be bitwise paired (bf16, nondeterministic kernels, a technique that
changes the math): then "equal" means "indistinguishable from another seed". K control
replicates with different seeds show how far seeds alone move the curve.

1. The band (per step). Mean curve: the replicates' per-step mean, smoothed by a
   Savitzky-Golay filter (local quadratic over SMOOTH_WINDOW logged steps). A quadratic fit,
   not a moving average, because a moving average is biased where the curve bends (the steep
   first steps of a loss) and that bias alone would leave a good run outside the band.
   Spread: the per-step variance across replicates, averaged over VAR_WINDOW steps (pools
   degrees of freedom: with K=3 one step's variance has 2). Floor: the fast (per-step) noise
   of a single run, measured from each replicate's residuals around its own smoothed curve
   (robust MAD, corrected for the fit). Why a floor: three replicates can agree by chance at
   some steps -- the cross-seed variance would be ~0 there -- but no run is smoother than its
   own batch noise, so the band can never get narrower than that.
   Half-width: q * sigma * sqrt(1 + 1/K). sqrt(1 + 1/K) because the centre is a mean of K
   runs, itself uncertain: a new run deviates from it with variance sigma^2 (1 + 1/K).
   q is the Student-t quantile matching z (same one-sided tail) with (K-1) * n_eff degrees of
   freedom, n_eff the number of independent steps the pooling window is worth (Bartlett's
   formula on the replicates' autocorrelation: when a seed's offset wanders slowly, 21 steps
   are worth ~2, and the band widens accordingly). Few replicates thus widen the band instead
   of trusting a poorly known sigma. Calibrated on simulated ensembles (tests/simulate.py;
   benchmarks/stats_false_alarm.py): z=3 keeps the band's false alarms at or
   below ~2% even when the slow seed wander dominates; z=2.5 reached 7-10% there.
   Rule: the test passes the band when at most MAX_OUTSIDE_FRACTION of its steps are outside
   and never MAX_CONSECUTIVE in a row. A few isolated excursions are what z=3 over hundreds
   of steps produces by chance; a real divergence is sustained, so the run-length rule is
   what catches it.

2. Equivalence on the final window (TOST, two one-sided t-tests at level alpha): the mean of
   the test over the last ``window`` logged steps minus the mean of the replicates' window
   means, D, must be shown to lie within +-margin. Standard error: s * sqrt(1 + 1/K) with s
   the std of the K window means (floored by the fast noise over the window), K-1 degrees of
   freedom.
   Default margin: the smallest margin at which a run that truly is another seed is declared
   equivalent with probability 1 - alpha/2, i.e. m = s * sqrt(1+1/K) *
   (t[1-alpha, K-1] + t[1-alpha/4, K-1]) -- about 10.5 s for K=3, 6 s for K=5, 4.3 s for K=20.
   A fixed multiple such as 2 s cannot work: with K=3 the TOST itself needs the difference
   to be inside m - 2.9 * 1.15 s, so a true replicate would fail ~90% of the time. Giving the
   TOST alpha/2 of null failures and the band (z=3 plus its run rule) less than the other
   half keeps the whole verdict's false-alarm rate at or below alpha. Set ``margin`` (metric
   units) for a margin that means something to you, e.g. 0.02 nats of loss.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import (
    ComparisonDefaults,
    Floats,
    Ints,
    failed,
    first_true,
    incomplete,
    worst,
)
from convergence.stats.types import Band, Check, MetricVerdict

# scipy is imported inside the functions that use it, not here. The verdict
# registry imports this module for every session, but only the seed regime calls it, and
# importing scipy.signal costs ~4.6 s of CPU on a 2-core machine (measured with cProfile on the
# quick start): seconds every fp32/bf16 session would pay before its first verdict.

DEFAULT_Z = 3.0
DEFAULT_ALPHA = 0.05
DEFAULT_WINDOW = 20
SMOOTH_WINDOW = 9
SMOOTH_ORDER = 2
VAR_WINDOW = 21
MAX_OUTSIDE_FRACTION = 0.05
MAX_CONSECUTIVE = 5
#: The band never gets narrower than this relative to the curve (a perfectly smooth metric).
RELATIVE_FLOOR = 1e-9


@dataclass(frozen=True, kw_only=True)
class ReplicateBand:
    """The replicates' band at their common steps."""

    steps: Ints
    center: Floats
    half_width: Floats
    sigma: Floats
    sigma_fast: float
    """Per-step noise of one run (the floor of ``sigma``)."""
    replicates: Floats
    """K x steps matrix of the replicate values."""
    quantile: float
    """q: the half-width is q * sigma * sqrt(1 + 1/K)."""
    z: float

    @property
    def num_replicates(self) -> int:
        return int(self.replicates.shape[0])

    def describe(self) -> str:
        return (
            f"smoothed mean ± {self.quantile:.2f}·σ·sqrt(1+1/K) (z {self.z:g}, "
            f"K={self.num_replicates}); ≤{MAX_OUTSIDE_FRACTION:.0%} of steps outside, "
            f"<{MAX_CONSECUTIVE} in a row"
        )

    def envelope(self) -> Band:
        """The verdict's band at every step the replicates share."""
        return Band.of(self.steps, self.center - self.half_width, self.center + self.half_width)

    def at(self, steps: Ints) -> tuple[Ints, Floats, Floats]:
        """(steps, centre, half-width) at those of ``steps`` the band covers."""
        common, bi, _ = np.intersect1d(self.steps, steps, return_indices=True)
        return common.astype(np.int64), self.center[bi], self.half_width[bi]


def seed_band(controls: Sequence[Curve], z: float = DEFAULT_Z) -> ReplicateBand:
    """The band of K >= 2 replicates (see the module docstring)."""
    from scipy import special  # lazy: see the note at the imports

    if len(controls) < 2:
        raise ValueError(
            f"the seed band needs at least 2 control replicates, got "
            f'{len(controls)}: use regime = "seed" with replicates >= 2, or '
            f'compare with "paired"'
        )
    steps = controls[0].steps
    for curve in controls[1:]:
        steps = np.intersect1d(steps, curve.steps)
    matrix = np.stack([c.values[np.searchsorted(c.steps, steps)] for c in controls])
    num = matrix.shape[0]
    sigma_fast = _fast_noise(matrix)
    pooled = _smooth_mean(np.var(matrix, axis=0, ddof=1))
    center = _smooth(matrix.mean(axis=0))
    floor = np.maximum(sigma_fast, RELATIVE_FLOOR * np.maximum(1.0, np.abs(center)))
    sigma = np.sqrt(np.maximum(pooled, floor**2))
    dof = (num - 1) * _effective_window(matrix)
    quantile = float(special.stdtrit(dof, special.ndtr(z)))
    half_width = quantile * sigma * np.sqrt(1.0 + 1.0 / num)
    return ReplicateBand(
        steps=steps.astype(np.int64),
        center=center,
        half_width=half_width,
        sigma=sigma,
        sigma_fast=sigma_fast,
        replicates=matrix,
        quantile=quantile,
        z=z,
    )


def _smooth(values: Floats) -> Floats:
    """Savitzky-Golay smoothing of a curve (or of each row of a matrix), quadratic fits at the
    edges (scipy's ``mode="interp"``), vectorized over rows: the false-alarm simulations call
    this thousands of times."""
    from scipy.ndimage import correlate1d  # lazy: see the note at the imports

    size = values.shape[-1]
    if size < SMOOTH_WINDOW:
        return values.copy()
    coeffs, edge = _filters()
    half = SMOOTH_WINDOW // 2
    out = np.asarray(correlate1d(values, coeffs, axis=-1, mode="nearest"), dtype=np.float64)
    out[..., :half] = (values[..., :SMOOTH_WINDOW] @ edge.T)[..., :half]
    out[..., size - half :] = (values[..., size - SMOOTH_WINDOW :] @ edge.T)[
        ..., SMOOTH_WINDOW - half :
    ]
    return out


@functools.cache
def _filters() -> tuple[Floats, Floats]:
    """(centre coefficients, W x W projection onto quadratics over one window)."""
    from scipy import signal  # lazy: see the note at the imports

    coeffs = np.asarray(signal.savgol_coeffs(SMOOTH_WINDOW, SMOOTH_ORDER, use="dot"))
    x = np.arange(SMOOTH_WINDOW, dtype=np.float64)
    vander = np.vander(x, SMOOTH_ORDER + 1)
    projection = vander @ np.linalg.pinv(vander)
    return coeffs, projection


def _smooth_mean(values: Floats) -> Floats:
    """Centered moving average (for variances: nonnegative, bias harmless)."""
    from scipy.ndimage import uniform_filter1d  # lazy: see the note at the imports

    size = min(VAR_WINDOW, values.size)
    return np.asarray(uniform_filter1d(values, size=size, mode="nearest"), dtype=np.float64)


def _effective_window(matrix: Floats) -> float:
    """How many independent steps the pooled variance window is worth (1..VAR_WINDOW).

    Neighbouring steps are correlated (a seed that runs high keeps running high), so a variance
    averaged over W steps has fewer than W steps' worth of information. Bartlett's formula for
    the variance of a sample variance: n_eff = W / (1 + 2 sum_j (1 - j/W) rho_j^2), rho_j the
    autocorrelation of the replicates' deviations from their per-step mean at lag j.
    """
    width = min(VAR_WINDOW, matrix.shape[1])
    deviations = matrix - matrix.mean(axis=0)
    energy = float(np.sum(deviations**2))
    if width < 2 or energy == 0.0:
        return float(width)
    lags = np.arange(1, width)
    rho = np.array([np.sum(deviations[:, :-j] * deviations[:, j:]) for j in lags]) / energy
    inflation = 1.0 + 2.0 * float(np.sum((1.0 - lags / width) * rho**2))
    return float(np.clip(width / inflation, 1.0, width))


def _fast_noise(matrix: Floats) -> float:
    """Per-step noise of one run: robust std of residuals around the run's own smoothed curve.

    The Savitzky-Golay residual at a step has variance sigma^2 (1 - h), h the filter's centre
    weight (the fit is a projection), hence the correction.
    """
    if matrix.shape[1] < SMOOTH_WINDOW:
        return 0.0
    residuals = matrix - _smooth(matrix)
    mad = float(np.median(np.abs(residuals - np.median(residuals))))
    centre_weight = float(_filters()[0][SMOOTH_WINDOW // 2])
    return float(1.4826 * mad / np.sqrt(1.0 - centre_weight))


@dataclass(frozen=True, kw_only=True)
class Tost:
    difference: float
    margin: float
    standard_error: float
    p_lower: float
    p_upper: float
    window_steps: Ints

    def equivalent(self, alpha: float) -> bool:
        return max(self.p_lower, self.p_upper) < alpha


def default_margin_factor(num_replicates: int, alpha: float) -> float:
    """m / s for the default margin (see the module docstring)."""
    from scipy import special  # lazy: see the note at the imports

    dof = num_replicates - 1
    return float(
        np.sqrt(1.0 + 1.0 / num_replicates)
        * (special.stdtrit(dof, 1 - alpha) + special.stdtrit(dof, 1 - alpha / 4))
    )


def tost(
    band: ReplicateBand,
    test_steps: Ints,
    test_values: Floats,
    *,
    window: int,
    alpha: float,
    margin: float | None,
) -> Tost:
    """Two one-sided tests on the mean difference over the last ``window`` common steps."""
    from scipy import special  # lazy: see the note at the imports

    common, bi, ti = np.intersect1d(band.steps, test_steps, return_indices=True)
    take = slice(max(0, common.size - window), common.size)
    window_means = band.replicates[:, bi[take]].mean(axis=1)
    num = window_means.size
    difference = float(test_values[ti[take]].mean() - window_means.mean())
    count = common[take].size
    spread = max(
        float(np.std(window_means, ddof=1)),
        band.sigma_fast / np.sqrt(max(count, 1)),
        RELATIVE_FLOOR * max(1.0, abs(float(window_means.mean()))),
    )
    if margin is None:
        margin = default_margin_factor(num, alpha) * spread
    standard_error = spread * np.sqrt(1.0 + 1.0 / num)
    dof = num - 1
    p_lower = float(special.stdtr(dof, -(difference + margin) / standard_error))
    p_upper = float(special.stdtr(dof, (difference - margin) / standard_error))
    if not np.isfinite(difference):
        p_lower = p_upper = 1.0
    return Tost(
        difference=difference,
        margin=float(margin),
        standard_error=standard_error,
        p_lower=p_lower,
        p_upper=p_upper,
        window_steps=common[take].astype(np.int64),
    )


def longest_run(mask: npt.NDArray[np.bool_]) -> int:
    best = current = 0
    for flag in mask.tolist():
        current = current + 1 if flag else 0
        best = max(best, current)
    return best


class SeedBand(ComparisonDefaults):
    method: Method = "seed"
    all_controls = True  # the K replicates
    takes_alpha = True  # the TOST on the final window

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        if len(controls) < 2:
            return None
        band = seed_band(controls, DEFAULT_Z if rule.z is None else rule.z)
        lookup = {
            s: (c, h)
            for s, c, h in zip(
                band.steps.tolist(), band.center.tolist(), band.half_width.tolist(), strict=True
            )
        }

        def check(step: int, value: float) -> tuple[float, float] | None:
            found = lookup.get(step)
            return None if found is None else (abs(value - found[0]), found[1])

        return check

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        z = DEFAULT_Z if rule.z is None else rule.z
        alpha = DEFAULT_ALPHA if rule.alpha is None else rule.alpha
        window = DEFAULT_WINDOW if rule.window is None else rule.window
        if len(controls) < 2:
            return failed(
                rule,
                self.method,
                f"the seed band needs at least 2 control "
                f'replicates, got {len(controls)}: set regime = "seed" with '
                f'replicates >= 2, or compare this metric with "paired"',
            )
        problem = incomplete(controls, test)
        if problem:
            full = seed_band(controls, z) if all(len(c) for c in controls) else None
            return failed(
                rule, self.method, problem, band=None if full is None else full.envelope()
            )
        band = seed_band(controls, z)
        steps, center, half = band.at(test.steps)
        if steps.size == 0:
            return failed(
                rule,
                self.method,
                "no step logged by the test and all replicates",
                tolerance=band.describe(),
                band=band.envelope(),
            )
        values = test.values[np.searchsorted(test.steps, steps)]
        deviation = np.abs(values - center)
        outside = ~(deviation <= half)
        run = longest_run(outside)
        fraction = float(outside.mean())
        band_ok = fraction <= MAX_OUTSIDE_FRACTION and run < MAX_CONSECUTIVE
        equivalence = tost(band, steps, values, window=window, alpha=alpha, margin=rule.margin)
        tost_ok = equivalence.equivalent(alpha)
        max_dev, max_step, index = worst(deviation, steps)
        first = first_true(outside, steps)
        passed = band_ok and tost_ok
        described = (
            f"{band.describe()}; TOST ±{equivalence.margin:.3g} on the last "
            f"{equivalence.window_steps.size} steps at α {alpha:g}"
        )
        return MetricVerdict(
            metric=rule.metric,
            method=self.method,
            passed=passed,
            gate=rule.gate,
            steps_compared=int(steps.size),
            first_divergent_step=first,
            max_deviation=max_dev,
            max_deviation_step=max_step,
            tolerance=described,
            tolerance_at_max=None if index is None else float(half[index]),
            p_values={"tost_lower": equivalence.p_lower, "tost_upper": equivalence.p_upper},
            band=Band.of(steps, center - half, center + half),
            message=_message(
                rule.metric, band_ok, tost_ok, outside, run, first, equivalence, alpha
            ),
            details={
                "num_replicates": band.num_replicates,
                "steps_outside": int(outside.sum()),
                "fraction_outside": fraction,
                "longest_run_outside": run,
                "final_window_difference": equivalence.difference,
                "margin": equivalence.margin,
                "quantile": band.quantile,
                "sigma_fast": band.sigma_fast,
            },
        )


def _message(
    metric: str,
    band_ok: bool,
    tost_ok: bool,
    outside: npt.NDArray[np.bool_],
    run: int,
    first: int | None,
    equivalence: Tost,
    alpha: float,
) -> str:
    p_value = max(equivalence.p_lower, equivalence.p_upper)
    final = (
        f"final-window difference {equivalence.difference:+.3g} "
        f"(margin ±{equivalence.margin:.3g}, TOST p={p_value:.2g})"
    )
    if band_ok and tost_ok:
        return f"{metric}: inside the seed band ({int(outside.sum())} steps outside); {final}"
    reasons = []
    if not band_ok:
        reasons.append(
            f"outside the seed band at {int(outside.sum())} of {outside.size} steps "
            f"(first at step {first}, {run} in a row)"
        )
    if not tost_ok:
        reasons.append(f"not shown equivalent at α {alpha:g}: {final}")
    return f"{metric}: " + "; ".join(reasons)
