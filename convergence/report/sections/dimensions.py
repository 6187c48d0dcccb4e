"""The matrix per dimension: pairs grouped by what their test adds over its control.

A dimension is the change from control to test: the mesh axes whose degree differs, and the
techniques that differ, e.g. ``+tp2``, ``+tp2+pp2``, ``+cp4``, ``shard2→4``, ``-rep2+shard2``
(DDP -> FSDP), ``+tp2 +hook:apply_my_tp``, ``+ac:full``. Pairs of one dimension are one row:
how many passed, failed, broke, and the worst |Δloss| among them (and which pair it was), so a
reader sees at a glance that, say, everything with PP fails while TP alone is fine.

Rendered from report records (convergence.report.data.records.pair_record, or report.json's
pairs) for the terminal (:func:`render_dimensions`), report.md (:func:`markdown_lines`) and
report.html (:func:`html_section`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import NotRequired, TypedDict

from convergence.report.data.records import LayoutRecord, PairRecord, TechniqueValue
from convergence.report.data.resume import ResumeRecord
from convergence.report.fmt import as_float, cut, fmt_num, fmt_techniques
from convergence.report.markup import html_table, md_table

#: Short axis names, as the matrix's columns.
AXIS_NAMES: tuple[tuple[str, str], ...] = (
    ("dp_replicate", "rep"),
    ("dp_shard", "shard"),
    ("tp", "tp"),
    ("cp", "cp"),
    ("pp", "pp"),
    ("ep", "ep"),
)
SAME = "same layout"
"""The dimension of a pair whose test changes nothing a record shows (e.g. a seed check)."""

HEADER: tuple[str, ...] = (
    "dimension",
    "pairs",
    "pass",
    "fail",
    "error",
    "skip",
    "worst |Δloss|",
    "worst pair",
)
RIGHT: tuple[bool, ...] = (False, True, True, True, True, True, True, False)


@dataclass(kw_only=True)
class DimensionRow:
    """The pairs of one dimension."""

    dimension: str
    pairs: list[str] = field(default_factory=list)
    """Pair names, in report order."""
    counts: dict[str, int] = field(
        default_factory=lambda: {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    )
    worst_dloss: float | None = None
    """Largest max |Δloss| of the pairs (NaN when a pair's is NaN); None when none has one."""
    worst_pair: str | None = None


def _axis_change(name: str, control: int, test: int) -> str:
    if control == 1:
        return f"+{name}{test}"
    if test == 1:
        return f"-{name}{control}"
    return f"{name}{control}→{test}"


class ChangeRecord(TypedDict):
    """What :func:`dimension_of` reads: a pair record's layouts and changed techniques (a
    PairRecord has them; the heatmap builds just these from an outcome)."""

    control: LayoutRecord
    test: LayoutRecord
    techniques_changed: dict[str, TechniqueValue]
    resume: NotRequired[ResumeRecord]


def dimension_of(record: PairRecord | ChangeRecord) -> str:
    """``+tp2+pp2``, ``+cp4``, ``+tp2 +ac:full``, ... (see the module docstring). A resume
    pair is named by the layout it resumed on, after ``resume@K`` (``resume@10 +tp2``)."""
    control = record["control"]
    resume = record.get("resume")
    test = record["test"]
    degrees, schedule, sp = test["degrees"], test.get("pp_schedule"), test["sequence_parallel"]
    if resume is not None and "layout" in resume:
        after = resume["layout"]
        degrees, schedule, sp = after["degrees"], after["pp_schedule"], after["sequence_parallel"]
    # .get(axis, 1): report.json files written before EP was a degree have no "ep".
    axes = "".join(
        _axis_change(name, int(control["degrees"].get(axis, 1)), int(degrees.get(axis, 1)))
        for axis, name in AXIS_NAMES
        if int(control["degrees"].get(axis, 1)) != int(degrees.get(axis, 1))
    )
    parts = [f"resume@{resume['at_step']}"] if resume is not None else []
    parts += [axes] if axes else []
    if int(degrees["pp"]) > 1 and control.get("pp_schedule") not in (None, schedule):
        parts.append(f"pp:{schedule}")
    if bool(sp) != bool(control.get("sequence_parallel")):
        parts.append("+sp" if sp else "-sp")
    techniques = fmt_techniques(record.get("techniques_changed") or {})
    if techniques != "-":
        parts += [f"+{t}" for t in techniques.split(",")]
    return " ".join(parts) or SAME


def _worse(value: float | None, than: float | None) -> bool:
    if value is None:
        return False
    if than is None or math.isnan(value):
        return than is None or not math.isnan(than)
    return not math.isnan(than) and value > than


def group_by_dimension(records: Iterable[PairRecord]) -> list[DimensionRow]:
    """One row per dimension, in the order the dimensions first appear."""
    rows: dict[str, DimensionRow] = {}
    for record in records:
        dim = dimension_of(record)
        row = rows.setdefault(dim, DimensionRow(dimension=dim))
        row.pairs.append(str(record["name"]))
        status = str(record["status"])
        row.counts[status] = row.counts.get(status, 0) + 1
        dloss = as_float((record.get("max_abs_delta") or {}).get("loss"))
        if _worse(dloss, row.worst_dloss):
            row.worst_dloss, row.worst_pair = dloss, str(record["name"])
    return list(rows.values())


def cells(row: DimensionRow) -> list[str]:
    """The row's cells, in :data:`HEADER` order."""
    c = row.counts
    return [
        row.dimension,
        str(len(row.pairs)),
        str(c["passed"]),
        str(c["failed"]),
        str(c["error"]),
        str(c["skipped"]),
        fmt_num(row.worst_dloss),
        row.worst_pair or "-",
    ]


def render_dimensions(records: Iterable[PairRecord], width: int = 120) -> str:
    """The per-dimension block for the terminal (aligned text, each line within ``width``)."""
    table = [list(HEADER)] + [cells(r) for r in group_by_dimension(records)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    # The text columns (dimension, worst pair) give way when the block is too wide.
    for i in (len(HEADER) - 1, 0):
        excess = sum(widths) + 2 * (len(HEADER) - 1) - width
        if excess > 0:
            widths[i] = max(widths[i] - excess, len(HEADER[i]))
    lines = []
    for row in table:
        text = [
            cut(v, w).rjust(w) if right else cut(v, w).ljust(w)
            for v, w, right in zip(row, widths, RIGHT, strict=False)
        ]
        lines.append("  ".join(text).rstrip()[:width])
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines) + "\n"


def markdown_lines(records: Sequence[PairRecord]) -> list[str]:
    """report.md's "By dimension" section (empty without pairs). One pair gets it too: the
    matrix shows the test's degrees, this row what the test changes over its control."""
    if not records:
        return []
    rows = group_by_dimension(records)
    return ["", "### By dimension", "", *md_table(HEADER, [cells(r) for r in rows], list(RIGHT))]


def html_section(records: Sequence[PairRecord]) -> str:
    """report.html's "By dimension" table ("" without pairs)."""
    if not records:
        return ""
    rows = group_by_dimension(records)
    status = [
        "failed"
        if r.counts["failed"]
        else "error"
        if r.counts["error"]
        else "inconclusive"
        if r.counts.get("inconclusive")
        else "passed"
        for r in rows
    ]
    body = [[escape(c) for c in cells(r)] for r in rows]
    return "<h3>By dimension</h3>" + html_table(
        [escape(h) for h in HEADER], body, right=RIGHT, row_class=status
    )
