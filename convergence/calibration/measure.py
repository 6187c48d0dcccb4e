"""From curves to floors: what the paired and twin parameters must be on this stack.

Both start from the shipped defaults and only ever raise them (``max(default, margin x
needed)``): a calibration run sees a few layouts for a few dozen steps, a handful of samples of
the noise, while the defaults were validated against the whole detection catalogue
(BENCHMARKS.md). A noisier stack (a GPU's split-K GEMMs, flash attention) widens the band to
what it measured; a quieter one keeps the validated defaults instead of buying power nobody
has checked. ``margin`` (2 by default) is the headroom over the worst layout measured: one
calibration run is one draw of the noise, the next pair another.

- paired (fp32): control vs layouts whose only difference is the reduction order. Keeping the
  default growth and rtol, the atol that covers ``margin x |test - control|`` at every step is
  ``max over steps of (margin*|d| - rtol*|control|) / (1 + growth*sqrt(step))``.
- twin (bf16): control, its noise twin and correct layouts. Where the twin has not moved yet
  (noise 0, typically step 1: a DP change leaves the forward bit-identical) only the floor can
  cover a layout's difference, so rtol must reach ``margin x |d|/|control|`` there; after that,
  k needed = ``max over steps of (|d| - floor(step)) / noise(step)``, with noise(step) built as
  the verdict builds it (stats/twin_envelope.py ``twin_noise``: summed over the twins, pooled) -- the figure
  benchmarks/detection/twin_calibration.py prints -- and k = max(default, margin x needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from convergence.metrics.curve import Curve


def _common(control: Curve, test: Curve) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, control, |test - control|) at the steps both logged, finite only."""
    steps, ci, ti = np.intersect1d(control.steps, test.steps, return_indices=True)
    c = control.values[ci].astype(np.float64)
    d = np.abs(test.values[ti].astype(np.float64) - c)
    keep = np.isfinite(d) & np.isfinite(c)
    return steps[keep].astype(np.float64), c[keep], d[keep]


def paired_floor(
    control: Curve, tests: Sequence[Curve], default: Mapping[str, float], *, margin: float
) -> tuple[dict[str, float], dict[str, Any]]:
    """(atol/growth/rtol for this metric, the raw figures)."""
    growth, rtol = float(default["growth"]), float(default["rtol"])
    needed, worst = 0.0, 0.0
    for test in tests:
        steps, c, d = _common(control, test)
        if steps.size == 0:
            continue
        worst = max(worst, float(d.max()))
        atol = (margin * d - rtol * np.abs(c)) / (1.0 + growth * np.sqrt(steps))
        needed = max(needed, float(atol.max()))
    values = {"atol": max(float(default["atol"]), needed), "growth": growth, "rtol": rtol}
    return values, {"max_abs_diff": worst, "atol_needed": needed}


def twin_floor(
    control: Curve,
    noise: tuple[np.ndarray, np.ndarray],
    tests: Sequence[Curve],
    default: Mapping[str, float],
    *,
    margin: float,
) -> tuple[dict[str, float], dict[str, Any]]:
    """(k/atol/growth/rtol for this metric, the raw figures).

    ``noise``: (steps, noise) of the control's twins exactly as the verdict builds it
    (``convergence.stats.twin_envelope.twin_noise``: each twin's running max of |twin - control|,
    summed over the twins, the next steps pooled in; the caller computes it, stats sits above
    this layer), so the k measured here is the k the verdict needs, not the k of another
    construction.
    """
    atol, growth = float(default["atol"]), float(default["growth"])
    noise_steps = np.asarray(noise[0])
    levels = np.asarray(noise[1], dtype=np.float64)

    def noise_at(steps: np.ndarray) -> np.ndarray:
        if levels.size == 0:
            return np.zeros(steps.shape)
        index = np.searchsorted(noise_steps, steps, side="right") - 1
        return np.where(index >= 0, levels[np.clip(index, 0, None)], 0.0)

    rtol_needed = 0.0
    for test in tests:
        steps, c, d = _common(control, test)
        quiet = noise_at(steps) == 0
        if quiet.any():
            rel = d[quiet] / np.maximum(np.abs(c[quiet]), 1e-30)
            rtol_needed = max(rtol_needed, margin * float(rel.max()))
    rtol = max(float(default["rtol"]), rtol_needed)
    k_needed = 0.0
    for test in tests:
        steps, c, d = _common(control, test)
        measured = noise_at(steps)
        floor = atol * (1.0 + growth * np.sqrt(steps)) + rtol * np.abs(c)
        loud = measured > 0
        if loud.any():
            k_needed = max(k_needed, float(((d[loud] - floor[loud]) / measured[loud]).max()))
    values = {
        "k": max(float(default["k"]), margin * k_needed),
        "atol": atol,
        "growth": growth,
        "rtol": rtol,
    }
    figures = {
        "k_needed": k_needed,
        "rtol_needed": rtol_needed,
        "twin_noise_max": float(levels[-1]) if levels.size else 0.0,
    }
    return values, figures
