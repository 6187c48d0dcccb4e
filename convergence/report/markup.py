"""Markdown and HTML building blocks (escaping, tables, embedded images), shared by the
report's sections (:mod:`convergence.report.sections`) and its output formats
(:mod:`convergence.report.formats`). It knows nothing of either, so neither imports the other
to draw a table."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path


# -- markdown (report.md, GitHub step summaries) ---------------------------------------------
def md_text(value: object) -> str:
    """Plain markdown text: HTML escaped. report.md is rendered by GitHub (step summaries, PR
    comments), and names and messages come from experiment files and job output."""
    return html.escape(str(value), quote=False)


def md_code(value: object) -> str:
    """An inline code span; a backtick inside would end it early (entities are not decoded
    inside code spans, so escaping cannot help there)."""
    return "`" + str(value).replace("`", "ˋ").replace("\n", " ") + "`"


def md_cell(value: object) -> str:
    """Escape a table cell: HTML, pipes split cells, newlines end rows."""
    return md_text(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def md_table(
    header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None
) -> list[str]:
    right = right or [False] * len(header)
    lines = [
        "| " + " | ".join(md_cell(h) for h in header) + " |",
        "|" + "|".join("---:" if r else ":---" for r in right) + "|",
    ]
    lines += ["| " + " | ".join(md_cell(v) for v in row) + " |" for row in rows]
    return lines


# -- HTML (report.html) -----------------------------------------------------------------------
def _data_uri(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def html_img(rel: str | None, plot_files: Mapping[str, Path], alt: str) -> str:
    """The plot ``rel`` (as the report names it) embedded as a data URI; a note when the file
    is missing; "" when there is no plot."""
    if not rel:
        return ""
    path = plot_files.get(rel)
    uri = _data_uri(path) if path is not None else None
    if uri is None:
        return f'<p class="sub">plot {escape(rel)} is missing</p>'
    return f'<img src="{uri}" alt="{escape(alt)}">'


def html_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[bool],
    row_class: Sequence[str] | None = None,
    cell_class: Mapping[int, str] | None = None,
) -> str:
    """An HTML table; header and cells are already-escaped HTML."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cells = []
        for j, value in enumerate(row):
            classes = " ".join(
                c for c in (("num" if right[j] else ""), (cell_class or {}).get(j, "")) if c
            )
            cells.append(f'<td class="{classes}">{value}</td>' if classes else f"<td>{value}</td>")
        cls = f' class="{escape(row_class[i])}"' if row_class else ""
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


@dataclass(frozen=True)
class TitledTable:
    """One table of a report.html section: its heading and plain-text cells (escaped when
    written), with a CSS class per row where the section colours its rows."""

    title: str
    rows: Sequence[Sequence[str]]
    row_class: Sequence[str] | None = None


def html_tables_section(
    title: str,
    note: str,
    header: Sequence[str],
    right: Sequence[bool],
    tables: Sequence[TitledTable],
) -> str:
    """A report.html section of plain-text tables under one header: an h2 with its note, then
    an h3 and a table per entry (every text escaped here)."""
    parts = [f'<h2>{escape(title)}</h2><p class="sub">{escape(note)}</p>']
    for table in tables:
        body = [[escape(c) for c in row] for row in table.rows]
        parts.append(
            f"<h3>{escape(table.title)}</h3>"
            + html_table([escape(h) for h in header], body, right=right, row_class=table.row_class)
        )
    return "".join(parts)
