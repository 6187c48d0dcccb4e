"""matplotlib figures for the report's PNGs: built on ``matplotlib.figure.Figure`` with the Agg
canvas, never pyplot (no global state, no GUI backend, safe in xdist workers and threads).

matplotlib is imported lazily, here and in the drawing functions of
:mod:`convergence.report.formats.plots`: importing the report (the plugin does at start-up)
must not pay for it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from convergence.report.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins (set by the callers), not constrained layout: that doubles the time.
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> Path:
    """Write the figure as PNG through :func:`~convergence.report.files.atomic_write`, so a
    crash never leaves a truncated PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return atomic_write(path, buffer.getvalue())
