"""Pair plots rendered while the session still runs jobs, and reused by the report.

Drawn at the session's end, after the last job, matplotlib's import and one figure per pair
(~0.15 s of CPU each on a 2-core machine, benchmarks/report_cost.py) would all be on the
critical path. A pair's plot depends only on its outcome, so it is drawn as soon as the verdict
is in, on a background thread, while the next pair's jobs run (the pytest process mostly waits
on them; prerender.py). The PNG goes to a cache folder under a name hashed from the outcome;
:func:`cached_plot` hands it to the report, which copies it in place of drawing it again. A
missing or stale entry is simply drawn then, so the cache can never change a report: the same
outcome draws the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from convergence.report.data.serialize import outcome_to_json
from convergence.run.outcome import PairOutcome

#: Bump when plot_pair draws something else for the same outcome (old entries then miss).
PLOT_VERSION = "1"


def plot_key(outcome: PairOutcome) -> str:
    """The cache name of ``outcome``'s plot: a hash of everything the plot is drawn from."""
    text = json.dumps(outcome_to_json(outcome), sort_keys=True, default=str)
    return hashlib.sha256(f"{PLOT_VERSION}\n{text}".encode()).hexdigest()[:32]


def cached_plot(cache_dir: Path | None, outcome: PairOutcome) -> Path | None:
    """The pre-rendered plot of ``outcome``, if one is there."""
    if cache_dir is None:
        return None
    path = cache_dir / f"{plot_key(outcome)}.png"
    return path if path.is_file() else None
