"""The report's sections: blocks of report.md and report.html beyond the matrix and the
per-pair failures, each rendered from the report.json document (so they are rebuilt with the
rest from saved outcomes).

:data:`SECTIONS` is the registry, in report order; the output formats (report.md, report.html,
the plot folder) walk it instead of naming sections. A section module knows its own rows and
uses :mod:`convergence.report.markup` for tables; it never imports an output format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from convergence.report.data.records import PairRecord
from convergence.report.data.schema import ReportDocument
from convergence.report.markup import html_img
from convergence.report.sections import comm_blocks, dimensions, probe, resources

Report = ReportDocument
"""The report.json document (``pairs``: one record per pair, ``plots``: report-wide plots)."""


@dataclass(frozen=True, kw_only=True)
class Section:
    name: str
    markdown: Callable[[Report], list[str]]
    """report.md lines ([] when the section has nothing to show)."""
    markdown_after_failures: bool = False
    """True: placed after the failures (long per-pair detail), else right after the matrix."""
    html: Callable[[Report, Mapping[str, Path]], str] | None = None
    """The report-wide part of report.html (after the matrix), given the plot files to embed."""
    pair_html: Callable[[PairRecord], str] | None = None
    """The part of report.html inside one pair's section."""
    plot: Callable[[Sequence[PairRecord], Path], Path | None] | None = None
    """Writes the section's PNG into the plot folder (None when it has nothing to plot)..."""
    plot_key: str | None = None
    """...which report.json's ``plots`` then names under this key."""


def _dimensions_html(report: Report, plot_files: Mapping[str, Path]) -> str:
    """The "By dimension" table, then the heatmap under its own heading: it is one cell per
    pair and gating metric (rows grouped by dimension), not a heatmap per dimension."""
    heatmap = html_img(report.get("plots", {}).get("heatmap"), plot_files, "heatmap")
    if heatmap:
        heatmap = (
            '<h3>Every pair × gating metric</h3><div class="sub">max |Δ| over the '
            "tolerance, one row per pair, rows grouped by dimension</div>" + heatmap
        )
    return dimensions.html_section(report["pairs"]) + "\n" + heatmap


SECTIONS: tuple[Section, ...] = (
    Section(
        name="dimensions",
        markdown=lambda report: dimensions.markdown_lines(report["pairs"]),
        html=_dimensions_html,
    ),
    Section(
        name="resources",
        markdown=lambda report: resources.markdown_lines(report["pairs"]),
        html=lambda report, _plots: resources.html_section(report["pairs"]),
    ),
    Section(
        name="comm blocks",
        markdown=comm_blocks.markdown_lines,
        html=comm_blocks.html_section,
        plot=comm_blocks.write_plot,
        plot_key=comm_blocks.PLOT_KEY,
    ),
    Section(
        name="probe",
        markdown=probe.markdown_lines,
        markdown_after_failures=True,
        pair_html=probe.pair_html,
    ),
)
