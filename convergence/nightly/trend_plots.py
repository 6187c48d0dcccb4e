"""The trend's PNGs: small multiples, one panel per pair, nights on the x axis.

Why one panel per pair rather than a line per pair on one axis: pairs differ by orders of
magnitude (a loss delta at the fp32 noise floor next to a bf16 pair's), and ten lines in one
panel hide which pair moved. Each point carries the night's verdict (green circle passed, red
x failed, grey square error, light grey diamond skipped); a night the pair ran without a value
(an errored pair has no final loss) gets its marker on the panel's lower edge.

Gaps: a line joins consecutive nights only (:func:`runs`), so no line crosses a night the pair
did not run, while the points on either side keep their markers and a pair that ran only some
nights still gets its panel.

Figures are ``matplotlib.figure.Figure`` on the Agg canvas, never pyplot (as in
convergence/report/figure.py): no global state, no GUI backend. matplotlib is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from convergence.report.figure import new_figure, save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LINE_COLOR = "#1f77b4"
SECOND_COLOR = "0.45"
#: verdict -> (marker, colour, label).
VERDICT_STYLE: dict[str, tuple[str, str, str]] = {
    "passed": ("o", "#2ca02c", "passed"),
    "failed": ("x", "#d62728", "failed"),
    "inconclusive": ("P", "#bf8700", "inconclusive"),
    "error": ("s", "0.5", "error"),
    "skipped": ("D", "0.75", "skipped"),
}
_OTHER_STYLE = ("^", "0.3", "other")
#: Panel size in inches, and at most this many night labels per axis.
PANEL_W, PANEL_H, MAX_TICKS = 3.8, 2.3, 8


@dataclass(frozen=True, kw_only=True)
class PlotSpec:
    """One PNG: ``metrics`` as (series name, legend label); the first carries the verdicts,
    a second one is drawn dashed in grey (the control, next to the test)."""

    file: str
    title: str
    metrics: tuple[tuple[str, str], ...]
    zero_line: bool = False


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec(
        file="trend.png",
        title="final loss Δ (test − control)",
        metrics=(("final_loss_delta", "test − control"),),
        zero_line=True,
    ),
    PlotSpec(
        file="trend_control_loss.png",
        title="control final loss",
        metrics=(("control_final_loss", "control"),),
    ),
    PlotSpec(
        file="trend_step_time.png",
        title="step time (s)",
        metrics=(("step_time_s", "test"), ("control_step_time_s", "control")),
    ),
    PlotSpec(
        file="trend_tokens_per_s.png",
        title="tokens/s",
        metrics=(("tokens_per_s", "test"), ("control_tokens_per_s", "control")),
    ),
)


def _present(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def runs(values: Sequence[float | None]) -> list[list[int]]:
    """Indices of consecutive nights that have a value: each run is one line segment, so a
    missing night (or a NaN) breaks the line. ``[1, None, 3, 4] -> [[0], [2, 3]]``."""
    out: list[list[int]] = []
    for i, value in enumerate(values):
        if not _present(value):
            continue
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def grid_shape(panels: int) -> tuple[int, int]:
    """(rows, columns): up to 4 columns, as square as a page allows."""
    cols = 1 if panels <= 1 else 2 if panels <= 4 else 3 if panels <= 9 else 4
    return math.ceil(panels / cols), cols


def _figure(rows: int, cols: int) -> Figure:
    fig = new_figure(PANEL_W * cols + 0.6, PANEL_H * rows + 1.6)
    # Fixed margins in inches (constrained layout doubles the time): title + legend on top,
    # rotated night names below.
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=0.75 / width,
        right=1 - 0.2 / width,
        top=1 - 1.0 / height,
        bottom=1.0 / height,
        hspace=0.45,
        wspace=0.35,
    )
    return fig


def _title(pair: str, limit: int = 48) -> str:
    # the end of an id (file::name) is the part that tells pairs apart
    return pair if len(pair) <= limit else "…" + pair[-(limit - 1) :]


def _panel(
    ax: Axes,
    spec: PlotSpec,
    series: Mapping[str, list[float | None]],
    statuses: Sequence[str | None],
) -> None:
    for k, (metric, _) in enumerate(spec.metrics):
        values = series.get(metric) or [None] * len(statuses)
        style: dict[str, Any] = (
            {"color": LINE_COLOR, "linewidth": 1.2}
            if k == 0
            else {
                "color": SECOND_COLOR,
                "linewidth": 1.0,
                "linestyle": "--",
                "marker": ".",
                "markersize": 4,
            }
        )
        for run in runs(values):
            ax.plot(run, [float(values[i] or 0.0) for i in run], zorder=2, **style)
    if spec.zero_line:
        ax.axhline(0.0, color="0.6", linewidth=0.8, zorder=1)
    primary = series.get(spec.metrics[0][0]) or [None] * len(statuses)
    edge = ax.get_xaxis_transform()  # x in nights, y in axes fractions: the lower edge
    for i, status in enumerate(statuses):
        if status is None:
            continue  # the pair did not run that night: nothing to mark
        marker, color, _ = VERDICT_STYLE.get(status, _OTHER_STYLE)
        value = primary[i] if i < len(primary) else None
        if _present(value):
            ax.plot(
                [i],
                [value],
                linestyle="none",
                marker=marker,
                color=color,
                markersize=6,
                markeredgewidth=1.8,
                zorder=3,
            )
        else:
            ax.plot(
                [i],
                [0.04],
                linestyle="none",
                marker=marker,
                color=color,
                markersize=6,
                markeredgewidth=1.8,
                transform=edge,
                clip_on=False,
                zorder=3,
            )


def _legend(fig: Figure, spec: PlotSpec) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], linestyle="none", marker=m, color=c, markeredgewidth=1.8, label=label)
        for m, c, label in VERDICT_STYLE.values()
    ]
    if len(spec.metrics) > 1:
        handles += [
            Line2D([], [], color=LINE_COLOR, label=spec.metrics[0][1]),
            Line2D(
                [], [], color=SECOND_COLOR, linestyle="--", marker=".", label=spec.metrics[1][1]
            ),
        ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.45 / fig.get_size_inches()[1]),
    )


def plot_trend_panels(
    nights: Sequence[str],
    series: Mapping[str, Mapping[str, list[float | None]]],
    statuses: Mapping[str, Sequence[str | None]],
    spec: PlotSpec,
    path: Path,
) -> Path:
    """One PNG for ``spec``: a grid with one panel per pair (sorted), shared night axis."""
    pairs = sorted(series)
    rows, cols = grid_shape(max(1, len(pairs)))
    fig = _figure(rows, cols)
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    x = list(range(len(nights)))
    step = max(1, math.ceil(len(nights) / MAX_TICKS))
    for ax, pair in zip(axes, pairs, strict=False):
        _panel(ax, spec, series[pair], statuses.get(pair) or [None] * len(nights))
        ax.set_title(_title(pair), fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[len(pairs) :]:
        ax.set_visible(False)
    for ax in axes:
        ax.set_xlim(-0.5, max(0.5, len(nights) - 0.5))
        ax.set_xticks(x[::step])
        ax.set_xticklabels([nights[i] for i in x[::step]], rotation=30, ha="right", fontsize=6)
    # sharex hides labels on all but the bottom row; a short last row leaves the columns
    # above its gaps without them, so show them on every panel that has none below it
    for k, ax in enumerate(axes[: len(pairs)]):
        if k + cols >= len(pairs):
            ax.tick_params(labelbottom=True)
    fig.suptitle(f"pytest-convergence nightly trend: {spec.title}", fontsize=10)
    _legend(fig, spec)
    return save_png(fig, path)
