"""Write every report file of a session: plots/*.png, report.json, report.md, report.html.

Each file is written to a temp name and renamed into place, so a crash (or Ctrl-C) leaves
the previous report or a complete new file, never half of one. Plots go first and the three
documents last, so a document never points at a plot that is not there yet.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from convergence.report.data.schema import build_report
from convergence.report.files import atomic_write
from convergence.report.formats.html import render_html
from convergence.report.formats.markdown import render_markdown, write_step_summary
from convergence.report.formats.plots import (
    HEATMAP,
    PLOT_DIR,
    plot_heatmap,
    plot_names,
    plot_outcomes,
)
from convergence.report.sections import SECTIONS
from convergence.run.outcome import PairOutcome


def write_reports(
    outcomes: Iterable[PairOutcome],
    out_dir: Path,
    *,
    environment: Mapping[str, Any],
    started_at: float | None = None,
    wall_s: float | None = None,
    step_summary_env: Mapping[str, str] | None = None,
    plot_cache: Path | None = None,
) -> dict[str, Path]:
    """Write the reports into ``out_dir``; returns ``{"json", "markdown", "html", "heatmap",
    "plots"}`` paths (``plots`` is the folder of per-pair PNGs).

    ``step_summary_env`` (e.g. ``os.environ``) also appends report.md to
    ``$GITHUB_STEP_SUMMARY`` when that is set (path under ``"step_summary"``). It is opt-in:
    a test suite that writes example reports inside CI must not fill the job's summary.
    ``plot_cache``: the folder of pair plots drawn during the session (plot_cache.py).
    """
    outcomes = list(outcomes)
    out_dir = Path(out_dir)
    plot_dir = out_dir / PLOT_DIR
    names = plot_names(outcomes)
    paths, plot_errors = plot_outcomes(outcomes, plot_dir, names, plot_cache)
    heatmap = plot_heatmap(outcomes, plot_dir / f"{HEATMAP}.png")
    rel: dict[str, dict[str, str]] = {
        pid: {"pair": f"{PLOT_DIR}/{p.name}"} for pid, p in paths.items()
    }
    rel[""] = {"heatmap": f"{PLOT_DIR}/{heatmap.name}"}
    for o in outcomes:  # outcomes without a plot still use the report's plots, never stale ones
        rel.setdefault(o.pair.pair_id, {})
    report = build_report(
        outcomes,
        environment=environment,
        started_at=started_at,
        wall_s=wall_s,
        plots=rel,
        plot_errors=plot_errors,
        report_dir=out_dir,
    )
    plot_files = {f"{PLOT_DIR}/{p.name}": p for p in [*paths.values(), heatmap]}
    for section in SECTIONS:  # e.g. the reduced-communication study's plot, if any
        if section.plot is None or section.plot_key is None:
            continue
        path = section.plot(report["pairs"], plot_dir)
        if path is not None:
            report["plots"][section.plot_key] = f"{PLOT_DIR}/{path.name}"
            plot_files[report["plots"][section.plot_key]] = path
    markdown = render_markdown(report)
    written = {
        "plots": plot_dir,
        "heatmap": heatmap,
        "json": atomic_write(
            out_dir / "report.json", json.dumps(report, indent=1, allow_nan=False) + "\n"
        ),
        "markdown": atomic_write(out_dir / "report.md", markdown),
        "html": atomic_write(out_dir / "report.html", render_html(report, plot_files)),
    }
    if step_summary_env is not None:
        summary = write_step_summary(markdown, env=step_summary_env)
        if summary is not None:
            written["step_summary"] = summary
    return written
