"""How much of its tolerance a test used: the largest |test - band centre| / band half-width
over the compared steps (1 = at the edge). One function for every reader of a verdict's band:
the resumed twins' envelope (stats/resumed.py) and the selftest's correct layout
(selftest/run.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from convergence.stats.types import Band


def band_share(band: Band, values: Mapping[int, float]) -> float:
    """The worst share of ``band`` the ``values`` (step -> test value) used; 0 without a
    compared step. A NaN value counts as past any band (capped at 1e300: JSON has no inf); a
    zero-width band as 1 where the value is off it; a one-sided band (an infinite limit) has
    no centre and is left out."""
    worst = 0.0
    for step, lower, upper in zip(band.steps, band.lower, band.upper, strict=True):
        value = values.get(step)
        half = (upper - lower) / 2
        if value is None or not math.isfinite(half):
            continue
        gap = abs(value - (upper + lower) / 2)
        share = math.inf if math.isnan(value) else (gap / half if half > 0 else float(gap > 0))
        worst = max(worst, share)
    return min(worst, 1e300)
