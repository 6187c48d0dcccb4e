"""``margin``: is the test's curve worse than the control's by more than a margin?

For a test that changes the arithmetic on purpose (float8, MXFP8: regimes/margin.py) "equal
within rounding" is the wrong question -- a correct recipe differs from its bf16 control at
every step. The question is non-inferiority: the test may differ, but not be *worse* by more
than a margin, and the evidence must be strong enough to say so.

The design: K replicate pairs. Control i and test i share seed s+i, so they start from one
seed checkpoint and read the same samples in the same order (the regime runs them). Why
paired: both curves of a pair carry the same seed's offset, which cancels in their difference
D_i(step) = test_i - control_i; what is left is the technique's effect plus the rounding noise
it adds. The spread of D is far smaller than the seed-to-seed spread of either curve, so a few
pairs decide what dozens of unpaired replicates could not.

1. Windows across the run. The compared steps are cut into NUM_WINDOWS equal consecutive
   windows; in each window j each pair gives its mean difference d_ij. Why windows and not the
   last one only: a recipe can be as good at the end and worse in the middle (a loss spike it
   recovers from, a slower start), and the final window alone would pass it.
   Estimate: delta_j = mean_i d_ij, SE_j = s_j / sqrt(K), s_j the std of the d_ij (K - 1
   degrees of freedom), floored by the per-step noise of the differences averaged over the
   window (sigma_fast / sqrt(n_j)): K = 3 pairs can agree by chance, no window mean is
   smoother than the batch noise it averages.

2. The margin m_j. A user margin (``margin``, in the metric's units: nats for the loss), or
   by default MARGIN_SEEDS times the control's own seed-to-seed spread in that window (the std
   of the K control replicates' window means, same floor). Why this default: a recipe worse by
   less than what another seed moves the curve cannot be told from another seed in any run a
   user would make, and is "as good" in the sense that matters; 2 seed std's is the width of
   the usual "within noise" eyeball (pytorch/torchtitan#4203 compares two runs' last-100-step
   means by eye). It is estimated from K runs, so it is itself uncertain (K - 1 degrees of
   freedom): set ``margin`` in nats when the margin should mean something fixed.

3. The test, per window, at level alpha (one-sided t, K - 1 degrees of freedom):
   U_j = delta_j + t[1-alpha] SE_j, L_j = delta_j - t[1-alpha] SE_j.
   Lower-is-better metrics (loss, val_loss) are one-sided: "worse" is higher. Others (grad
   norms) have no better side, so both bounds are held to the margin (two one-sided tests).
   - worse:  L_j > m_j in some window (shown worse by more than the margin) -> failed;
   - as good: U_j < m_j in every window (shown not worse by more than the margin), and the
     test had the power to show it (below) -> passed;
   - otherwise inconclusive: the interval [L_j, U_j] straddles the margin.
   Why all windows at alpha each and no multiplicity correction: "as good in every window" is
   an intersection of hypotheses, and an intersection-union test at level alpha per window has
   level alpha overall. A failure needs L_j > m_j, a one-sided test of "worse by more than m_j"
   at level alpha per window: a correct recipe (true difference 0 < m_j) fails with
   probability well below alpha per window.

4. Power. With K pairs and this spread, the smallest margin that a test truly as good as the
   control shows non-inferiority at with probability POWER is
   E_j = (t[1-alpha] + t[POWER]) SE_j, the "smallest difference this test can exclude". When
   E_j > m_j in some window the verdict is inconclusive even if U_j < m_j happened to hold (a
   lucky draw of an underpowered test is not evidence), and it says how much more would
   decide: the number of pairs K' with (t[1-alpha, K'-1] + t[POWER, K'-1]) s_j / sqrt(K') <=
   m_j in every window; or, where the per-step noise is most of s_j, roughly how many more
   steps would shrink it enough (s_j^2 = slow^2 + sigma_fast^2 / n_j, windows growing with the
   run: an estimate, since a longer run is another curve).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import ComparisonDefaults, Floats, Ints, failed, incomplete
from convergence.stats.types import Band, Check, MetricVerdict

DEFAULT_ALPHA = 0.05
#: The power at which "the smallest difference this test can exclude" is stated.
POWER = 0.8
NUM_WINDOWS = 4
#: Default margin: this many seed-to-seed standard deviations of the control's window mean.
MARGIN_SEEDS = 2.0
#: Metrics where lower is better (a one-sided test); the others are held to +-margin.
LOWER_IS_BETTER = frozenset({"loss", "val_loss"})
#: The most replicate pairs a recommendation names (beyond it: "widen the margin").
MAX_PAIRS = 1000
RELATIVE_FLOOR = 1e-9


def _t(dof: int, q: float) -> float:
    """Student-t quantile (scipy lazily: see stats/seed_band.py's note on its import cost)."""
    from scipy import special

    return float(special.stdtrit(dof, q))


def _fast_noise(rows: Floats) -> float:
    """Per-step noise of a curve (or rows of curves): robust std of its first differences over
    sqrt(2) -- a slow trend moves neighbouring steps alike and cancels in the difference."""
    if rows.shape[-1] < 3:
        return 0.0
    steps = np.diff(rows, axis=-1).ravel()
    mad = float(np.median(np.abs(steps - np.median(steps))))
    return 1.4826 * mad / math.sqrt(2.0)


def split_windows(steps: Ints, num_windows: int = NUM_WINDOWS) -> list[Ints]:
    """``steps`` cut into up to ``num_windows`` consecutive windows of near-equal size."""
    count = min(num_windows, int(steps.size))
    return [w for w in np.array_split(steps, count) if w.size] if count else []


@dataclass(frozen=True, kw_only=True)
class Window:
    """One window's estimate, bounds, margin and power."""

    first_step: int
    last_step: int
    delta: float
    """Mean over pairs of the window-mean difference test - control (positive: test higher)."""
    standard_error: float
    lower: float
    upper: float
    margin: float
    excludable: float
    """(t[1-alpha] + t[POWER]) * SE: the smallest margin this test can exclude here."""
    spread: float
    """s_j: std of the pairs' window-mean differences (floored)."""
    fast_noise: float
    """sigma_fast / sqrt(n_j): the floor of s_j, the per-step noise averaged over the window."""
    num_steps: int
    worse: bool
    as_good: bool
    p_value: float
    """p of "worse by the margin or more" (one-sided; two-sided: the larger of the two)."""

    @property
    def powered(self) -> bool:
        return self.excludable <= self.margin

    def to_json(self) -> dict[str, float | int | bool]:
        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "delta": self.delta,
            "standard_error": self.standard_error,
            "lower": self.lower,
            "upper": self.upper,
            "margin": self.margin,
            "excludable": self.excludable,
            "worse": self.worse,
            "as_good": self.as_good,
            "powered": self.powered,
            "p_value": self.p_value,
        }


def pairs_needed(spread: float, margin: float, alpha: float, start: int) -> int | None:
    """The fewest pairs K' >= start whose excludable difference is within ``margin``."""
    for pairs in range(max(start, 2), MAX_PAIRS + 1):
        if (_t(pairs - 1, 1 - alpha) + _t(pairs - 1, POWER)) * spread / math.sqrt(pairs) <= margin:
            return pairs
    return None


def steps_needed(window: Window, pairs: int, alpha: float) -> int | None:
    """Roughly how many logged steps per window would make ``pairs`` pairs powered here:
    the slow part of s_j stays, the per-step part shrinks as 1/n. None: steps cannot."""
    target = window.margin * math.sqrt(pairs) / (_t(pairs - 1, 1 - alpha) + _t(pairs - 1, POWER))
    fast_var = (window.fast_noise**2) * window.num_steps  # sigma_fast^2 per step
    slow_var = max(0.0, window.spread**2 - window.fast_noise**2)
    if fast_var <= 0.0 or slow_var >= target**2:
        return None
    return int(math.ceil(fast_var / (target**2 - slow_var)))


@dataclass(frozen=True, kw_only=True)
class Decision:
    windows: tuple[Window, ...]
    num_pairs: int
    alpha: float
    one_sided: bool
    user_margin: bool

    @property
    def failed(self) -> bool:
        return any(w.worse for w in self.windows)

    @property
    def powered(self) -> bool:
        return all(w.powered for w in self.windows)

    @property
    def passed(self) -> bool:
        return not self.failed and self.powered and all(w.as_good for w in self.windows)

    @property
    def inconclusive(self) -> bool:
        return not self.failed and not self.passed

    def more_pairs(self) -> int | None:
        """Pairs that would decide every undecided window, at the spread and difference seen
        so far (None: more than MAX_PAIRS). Powered first; then the interval's half-width
        t * s / sqrt(K') below the estimate's distance to the margin -- where the estimate
        sits on the margin no K' does that, and the powered count is the least to run."""
        needed = self.num_pairs
        for w in self.windows:
            if w.as_good and w.powered:
                continue
            k = pairs_needed(w.spread, w.margin, self.alpha, self.num_pairs)
            if k is None:
                return None
            gap = abs(w.margin - (w.delta if self.one_sided else abs(w.delta)))
            decided = k
            while decided <= MAX_PAIRS and _t(
                decided - 1, 1 - self.alpha
            ) * w.spread >= gap * math.sqrt(decided):
                decided += 1
            needed = max(needed, decided if decided <= MAX_PAIRS else k)
        return needed

    def more_steps(self) -> int | None:
        """Logged steps to add to the run (all windows grow alike) so that the current
        number of pairs is powered everywhere; None when steps alone cannot."""
        factor = 1.0
        for w in self.windows:
            if w.powered:
                continue
            per_window = steps_needed(w, self.num_pairs, self.alpha)
            if per_window is None:
                return None
            factor = max(factor, per_window / w.num_steps)
        total = sum(w.num_steps for w in self.windows)
        return int(math.ceil(total * (factor - 1.0))) if factor > 1.0 else None


def decide(
    controls: Sequence[Curve],
    tests: Sequence[Curve],
    *,
    metric: str,
    alpha: float = DEFAULT_ALPHA,
    margin: float | None = None,
    num_windows: int = NUM_WINDOWS,
) -> tuple[Decision, Ints, Floats]:
    """The verdict of K >= 2 pairs (``controls[i]`` and ``tests[i]`` share a seed), with the
    common steps and the control replicates' mean there (for the report's band)."""
    if len(controls) != len(tests) or len(controls) < 2:
        raise ValueError(f"need K >= 2 pairs, got {len(controls)} controls, {len(tests)} tests")
    steps = controls[0].steps
    for curve in (*controls[1:], *tests):
        steps = np.intersect1d(steps, curve.steps)
    steps = steps.astype(np.int64)

    def at(curve: Curve) -> Floats:
        return curve.values[np.searchsorted(curve.steps, steps)]

    ctrl = np.stack([at(c) for c in controls])
    diffs = np.stack([at(t) for t in tests]) - ctrl
    num = ctrl.shape[0]
    t_alpha, t_power = _t(num - 1, 1 - alpha), _t(num - 1, POWER)
    one_sided = metric in LOWER_IS_BETTER
    fast_d, fast_c = _fast_noise(diffs), _fast_noise(ctrl)
    windows = []
    for cut in split_windows(steps, num_windows):
        cols = np.searchsorted(steps, cut)
        n = int(cut.size)
        scale = RELATIVE_FLOOR * max(1.0, float(np.abs(ctrl[:, cols]).mean()))
        floor_d = max(fast_d / math.sqrt(n), scale)
        means = diffs[:, cols].mean(axis=1)
        spread = max(float(np.std(means, ddof=1)), floor_d)
        if margin is None:
            seed_spread = max(
                float(np.std(ctrl[:, cols].mean(axis=1), ddof=1)), fast_c / math.sqrt(n), scale
            )
            window_margin = MARGIN_SEEDS * seed_spread
        else:
            window_margin = float(margin)
        delta = float(means.mean())
        se = spread / math.sqrt(num)
        lower, upper = delta - t_alpha * se, delta + t_alpha * se
        p_worse = _p_above(delta, window_margin, se, num - 1)
        if one_sided:
            worse, as_good, p = lower > window_margin, upper < window_margin, p_worse
        else:
            worse = lower > window_margin or upper < -window_margin
            as_good = -window_margin < lower and upper < window_margin
            p = max(p_worse, _p_above(-delta, window_margin, se, num - 1))
        if not np.isfinite(delta):
            worse, as_good, p = True, False, 0.0
        windows.append(
            Window(
                first_step=int(cut[0]),
                last_step=int(cut[-1]),
                delta=delta,
                standard_error=se,
                lower=lower,
                upper=upper,
                margin=window_margin,
                excludable=(t_alpha + t_power) * se,
                spread=spread,
                fast_noise=floor_d,
                num_steps=n,
                worse=bool(worse),
                as_good=bool(as_good),
                p_value=float(p),
            )
        )
    decision = Decision(
        windows=tuple(windows),
        num_pairs=num,
        alpha=alpha,
        one_sided=one_sided,
        user_margin=margin is not None,
    )
    return decision, steps, ctrl.mean(axis=0)


def _p_above(delta: float, margin: float, se: float, dof: int) -> float:
    """p-value of H0 "true difference >= margin" against "< margin" (small: shown below)."""
    from scipy import special

    if se <= 0.0:
        return 0.0 if delta < margin else 1.0
    return float(special.stdtr(dof, (delta - margin) / se))


def split_pairs(controls: Sequence[Curve], test: Curve) -> tuple[list[Curve], list[Curve]]:
    """The margin regime's control curves are ``K`` control replicates then ``K - 1`` test
    replicates (regimes/margin.py control_jobs), ``test`` the test at the control's seed."""
    if len(controls) % 2 == 0:
        raise ValueError(
            f"the margin comparison takes K control replicates and K - 1 test replicates "
            f"(2K - 1 curves), got {len(controls)}"
        )
    num = (len(controls) + 1) // 2
    return list(controls[:num]), [test, *controls[num:]]


class NonInferiority(ComparisonDefaults):
    method: Method = "margin"
    all_controls = True  # the K control replicates and the K - 1 test replicates
    takes_alpha = True

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        return None  # judged on windows of the whole run: never stopped early

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        alpha = DEFAULT_ALPHA if rule.alpha is None else rule.alpha
        if len(controls) < 3 or len(controls) % 2 == 0:
            return failed(
                rule,
                self.method,
                'the margin comparison needs replicate pairs: regime = "margin" with '
                f"replicates >= 2 (got {len(controls)} control-side curves)",
            )
        ctrl, tests = split_pairs(controls, test)
        problem = incomplete(ctrl, test) or next(
            (incomplete(ctrl, t) for t in tests[1:] if incomplete(ctrl, t)), None
        )
        if problem:
            return failed(rule, self.method, problem)
        decision, steps, center = decide(
            ctrl, tests, metric=rule.metric, alpha=alpha, margin=rule.margin
        )
        if not decision.windows:
            return failed(rule, self.method, "no step logged by every run of the pairs")
        return _verdict(rule, decision, steps, center)


def _verdict(
    rule: ComparisonRule, decision: Decision, steps: Ints, center: Floats
) -> MetricVerdict:
    upper = np.empty_like(center)
    lower = np.empty_like(center)
    for w in decision.windows:
        inside = (steps >= w.first_step) & (steps <= w.last_step)
        # The control replicates' mean +- each window's margin: what the plots draw as the
        # control's band (centred on the mean: report/data/curves.py). A one-sided metric is
        # held to the upper edge only, and by window means, not step by step.
        upper[inside] = center[inside] + w.margin
        lower[inside] = center[inside] - w.margin
    worst = max(decision.windows, key=lambda w: w.delta if decision.one_sided else abs(w.delta))
    first_worse = next((w.first_step for w in decision.windows if w.worse), None)
    kind = "one-sided" if decision.one_sided else "two one-sided tests"
    margin_text = (
        f"margin {decision.windows[0].margin:.3g}"
        if decision.user_margin
        else f"margin {MARGIN_SEEDS:g} seed std's of the control"
    )
    tolerance = (
        f"non-inferiority ({kind}) in {len(decision.windows)} windows, {margin_text}, "
        f"α {decision.alpha:g}, K={decision.num_pairs} replicate pairs"
    )
    more_pairs = decision.more_pairs() if decision.inconclusive else None
    more_steps = decision.more_steps() if decision.inconclusive else None
    return MetricVerdict(
        metric=rule.metric,
        method="margin",
        passed=decision.passed,
        inconclusive=decision.inconclusive,
        gate=rule.gate,
        steps_compared=int(steps.size),
        first_divergent_step=first_worse,
        max_deviation=abs(worst.delta),
        max_deviation_step=worst.last_step,
        tolerance=tolerance,
        tolerance_at_max=worst.margin,
        p_values={f"window{i + 1}": w.p_value for i, w in enumerate(decision.windows)},
        band=Band.of(steps, lower, upper),
        message=message(rule.metric, decision, more_pairs, more_steps),
        details={
            "num_pairs": decision.num_pairs,
            "windows": [w.to_json() for w in decision.windows],
            "alpha": decision.alpha,
            "power": POWER,
            "excludable": max(w.excludable for w in decision.windows),
            "margin": min(w.margin for w in decision.windows),
            "replicates_needed": more_pairs,
            "band_label": f"control mean ± margin ({decision.num_pairs} seeds)",
            "more_steps": more_steps,
        },
    )


def message(metric: str, decision: Decision, more_pairs: int | None, more_steps: int | None) -> str:
    """One line: worse / as good / inconclusive, with the numbers that say why."""
    ws = decision.windows
    if decision.failed:
        w = next(w for w in ws if w.worse)
        level = f"{1 - decision.alpha:.0%}"
        bound = (
            f"one-sided {level} bound {w.lower:+.3g} > margin {w.margin:.3g}"
            if w.lower > w.margin
            else f"one-sided {level} bound {w.upper:+.3g} < -margin {-w.margin:+.3g}"
        )
        side = "worse than" if decision.one_sided else "off"
        return (
            f"{metric}: {side} the control by more than the margin in steps "
            f"{w.first_step}-{w.last_step}: difference {w.delta:+.3g} ({bound}), "
            f"K={decision.num_pairs} pairs"
        )
    if decision.passed:
        w = max(ws, key=lambda w: max(w.upper, -w.lower) - w.margin)
        return (
            f"{metric}: as good as the control within the margin in all {len(ws)} windows "
            f"(closest: steps {w.first_step}-{w.last_step}, difference {w.delta:+.3g}, "
            f"bound {w.upper:+.3g} < margin {w.margin:.3g}); the smallest difference this "
            f"test can exclude is {max(x.excludable for x in ws):.3g}"
        )
    w = max(ws, key=lambda w: w.excludable / w.margin if w.margin > 0 else math.inf)
    why = (
        f"with K={decision.num_pairs} replicate pairs the smallest difference this test can "
        f"exclude is {w.excludable:.3g} (power {POWER:.0%}, α {decision.alpha:g}), "
        f"above the margin {w.margin:.3g} (steps {w.first_step}-{w.last_step})"
        if not w.powered
        else f"the interval [{w.lower:+.3g}, {w.upper:+.3g}] of steps {w.first_step}-"
        f"{w.last_step} straddles the margin {w.margin:.3g}"
    )
    advice = []
    if more_pairs is not None:
        advice.append(
            f"run {more_pairs - decision.num_pairs} more "
            f"replicate{'' if more_pairs - decision.num_pairs == 1 else 's'} "
            f"(replicates = {more_pairs})"
        )
    if more_steps is not None:
        advice.append(f"~{more_steps} more steps")
    if not advice:
        advice.append(f"more than {MAX_PAIRS} pairs: widen the margin (margin = X nats)")
    return f"{metric}: inconclusive: {why}: " + " or ".join(advice)
