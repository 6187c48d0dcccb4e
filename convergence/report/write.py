"""Write every report file of a session: plots/*.png, report.json, report.md, report.html.

Each file is written to a temp name and renamed into place, so a crash (or Ctrl-C) leaves
the previous report or a complete new file, never half of one. Plots go first and the three
documents last, so a document never points at a plot that is not there yet.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from convergence.run.outcome import PairOutcome
from convergence.report.curves import DivergenceRow
from convergence.report.curves import divergence_table as _divergence_table
from convergence.report.html import render_html
from convergence.report.markdown import render_markdown, write_step_summary
from convergence.report.plots import plot_heatmap, plot_outcomes
from convergence.report.schema import build_report

PLOT_DIR = "plots"
HEATMAP = "heatmap"


def divergence_table(outcome: PairOutcome, metric: str = "loss", around: int = 3
                     ) -> list[DivergenceRow]:
    """``[(step, control, test, test - control), ...]`` around the first divergent step.

    Also used by the pytest failure message; see :func:`convergence.report.curves.divergence_table`.
    """
    return _divergence_table(outcome, metric, around)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        # mkstemp makes the file 0600; reports are read by CI artifact steps and colleagues.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def plot_names(outcomes: Iterable[PairOutcome]) -> dict[str, str]:
    """A unique, file-system-safe stem per pair id (two files may hold the same test name)."""
    names: dict[str, str] = {}
    used: set[str] = {HEATMAP}
    for o in outcomes:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", o.pair.pair_id).strip("_.")[:100] or "pair"
        name, i = base, 2
        while name in used:
            name, i = f"{base}-{i}", i + 1
        used.add(name)
        names[o.pair.pair_id] = name
    return names


def write_reports(outcomes: Iterable[PairOutcome], out_dir: Path, *,
                  environment: Mapping[str, Any], started_at: float | None = None,
                  wall_s: float | None = None,
                  step_summary_env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Write the reports into ``out_dir``; returns ``{"json", "markdown", "html", "heatmap",
    "plots"}`` paths (``plots`` is the folder of per-pair PNGs).

    ``step_summary_env`` (e.g. ``os.environ``) also appends report.md to
    ``$GITHUB_STEP_SUMMARY`` when that is set (path under ``"step_summary"``). It is opt-in:
    a test suite that writes example reports inside CI must not fill the job's summary.
    """
    outcomes = list(outcomes)
    out_dir = Path(out_dir)
    plot_dir = out_dir / PLOT_DIR
    names = plot_names(outcomes)
    paths, plot_errors = plot_outcomes(outcomes, plot_dir, names)
    heatmap = plot_heatmap(outcomes, plot_dir / f"{HEATMAP}.png")
    rel: dict[str, dict[str, str]] = {
        pid: {"pair": f"{PLOT_DIR}/{p.name}"} for pid, p in paths.items()}
    rel[""] = {"heatmap": f"{PLOT_DIR}/{heatmap.name}"}
    for o in outcomes:  # outcomes without a plot still use the report's plots, never stale ones
        rel.setdefault(o.pair.pair_id, {})
    report = build_report(outcomes, environment=environment,
                          started_at=started_at,
                          wall_s=wall_s, plots=rel, plot_errors=plot_errors, report_dir=out_dir)
    plot_files = {f"{PLOT_DIR}/{p.name}": p for p in [*paths.values(), heatmap]}
    from convergence.report.comm_table import PLOT_KEY, write_plot

    comm_plot = write_plot(report["pairs"], plot_dir)  # reduced-communication study, if any
    if comm_plot is not None:
        report["plots"][PLOT_KEY] = f"{PLOT_DIR}/{comm_plot.name}"
        plot_files[report["plots"][PLOT_KEY]] = comm_plot
    markdown = render_markdown(report)
    written = {
        "plots": plot_dir,
        "heatmap": heatmap,
        "json": atomic_write(out_dir / "report.json",
                             json.dumps(report, indent=1, allow_nan=False) + "\n"),
        "markdown": atomic_write(out_dir / "report.md", markdown),
        "html": atomic_write(out_dir / "report.html", render_html(report, plot_files)),
    }
    if step_summary_env is not None:
        summary = write_step_summary(markdown, env=step_summary_env)
        if summary is not None:
            written["step_summary"] = summary
    return written
