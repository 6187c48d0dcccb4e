"""Every paired/twin verdict says whose floors it used (convergence/calibration/select.py).

The note goes where each report already reads: the tolerance text (report.json/.md/.html, the
failure text) and ``details["floors"]`` (saved outcomes, JUnit's ``convergence.floors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from convergence.calibration.select import Selection
from convergence.stats.types import MetricVerdict

#: The methods whose parameters come from a calibration (stats/paired.py, stats/twin.py).
CALIBRATED_METHODS = ("paired", "twin")


def with_floors(
    verdicts: Sequence[MetricVerdict], selection: Selection
) -> tuple[MetricVerdict, ...]:
    out = []
    for v in verdicts:
        if v.method not in CALIBRATED_METHODS or v.not_compared or v.metric == "lr":
            out.append(v)
            continue
        tolerance = f"{v.tolerance} [{selection.label()}]" if v.tolerance else v.tolerance
        details = {**v.details, "floors": selection.to_json()}
        out.append(dataclasses.replace(v, tolerance=tolerance, details=details))
    return tuple(out)
