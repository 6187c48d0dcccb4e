"""Nightly runs under Slurm: the sbatch script, the history file and the trend report.

    convergence nightly --experiments experiments/ --out /shared/conv-nightly [--submit]
        writes OUT/nightly.sbatch (see scripts/nightly.sbatch, the documented example). Each
        night it runs ``pytest -m convergence --convergence-tier nightly --convergence-launcher
        slurm --junitxml ... --convergence-report ...`` and then ``convergence record`` appends
        the night's results to OUT/history.jsonl.
    convergence record REPORT.json HISTORY.jsonl --night NAME
        one JSON line per pair: verdict, final loss delta, the control's final loss, step time
        and tokens/s of both sides, peak memory.
    convergence trend HISTORY.jsonl --out DIR
        DIR/trend.md, DIR/trend.json, DIR/trend*.png (one panel per pair, nights on x) and
        DIR/tensorboard/<pair>/ (the scalars per night, for TensorBoard).

Modules, each importing only those above it:

    sbatch.py       the script (NightlySettings, render_sbatch, write_sbatch)
    history.py      report.json -> history lines; reading them back (any version)
    trend_plots.py  the trend's PNGs: small multiples, verdict markers, gaps
    tensorboard_export.py  the trend's scalars as TensorBoard runs
    trend.py        series per pair over nights; trend.md / trend.json; write_trend
"""

from __future__ import annotations

from convergence.nightly.history import (
    HISTORY_VERSION,
    History,
    NightRecord,
    append_history,
    control_final_loss,
    final_loss_delta,
    history_records,
    load_report,
    read_history,
    step_times,
)
from convergence.nightly.sbatch import NightlySettings, render_sbatch, write_sbatch
from convergence.nightly.tensorboard_export import export_tensorboard, run_names
from convergence.nightly.trend import (
    TREND_METRICS,
    Trend,
    TrendFiles,
    build_trend,
    render_trend_markdown,
    trend_json,
    trend_series,
    write_trend,
)
from convergence.nightly.trend_plots import PLOTS, PlotSpec, plot_trend_panels, runs

__all__ = [
    "HISTORY_VERSION",
    "History",
    "NightRecord",
    "NightlySettings",
    "PLOTS",
    "PlotSpec",
    "TREND_METRICS",
    "Trend",
    "TrendFiles",
    "append_history",
    "build_trend",
    "control_final_loss",
    "export_tensorboard",
    "final_loss_delta",
    "history_records",
    "load_report",
    "plot_trend_panels",
    "read_history",
    "render_sbatch",
    "render_trend_markdown",
    "run_names",
    "runs",
    "step_times",
    "trend_json",
    "trend_series",
    "write_sbatch",
    "write_trend",
]
