"""The "Resources" (trade-off) table: what each job of an experiment costs, beside its loss.

One table per experiment file and control: a row for the control, then one per test, each
with the median step time, tokens/s and peak memory per rank (the largest over the ranks; on
GPU the caching allocator's peak, on CPU the process's peak resident set), the relative
difference of each against the control, and the max |Δloss| against the control. It answers
the studies' question "what does this layout buy, and what does it cost" (DP vs TP with
accumulation, DDP vs the ZeRO-like FSDP stages) in one place.

Rendered from report.json pair records (``resources``, ``max_abs_delta``), so it is rebuilt
with the rest of the report from saved outcomes. Shared by report.md and report.html.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from convergence.report.data.records import JsonFloat, PairRecord, ResourceRecord, SideRecord
from convergence.report.fmt import (
    VERDICTS,
    as_float,
    fmt_amount,
    fmt_num,
    fmt_pct,
    fmt_techniques,
)
from convergence.report.markup import TitledTable, html_tables_section, md_cell, md_table
from convergence.spec.layout import Techniques

HEADER: tuple[str, ...] = (
    "job",
    "role",
    "layout",
    "verdict",
    "step time (s)",
    "Δ step time",
    "tokens/s",
    "Δ tokens/s",
    "peak mem/rank (MiB)",
    "Δ peak mem",
    "max |Δloss|",
)
RIGHT: tuple[bool, ...] = (False, False, False, False) + (True,) * 7
NOTE = (
    "Per experiment file: each job's median step time, tokens/s and peak memory per rank "
    "(the largest over the ranks; GPU: the allocator's peak reserved, CPU: the process's "
    "peak resident set, mostly the Python/torch runtime for a tiny model); Δ = relative "
    "difference against the control; max |Δloss| against the control (seed regime: the "
    "centre of its replicates' band)."
)
_DEFAULT_TECHNIQUES = Techniques().to_dict()


@dataclass(frozen=True, kw_only=True)
class TradeoffRow:
    """One job of the table; relative values are (job - control) / control."""

    job: str
    role: str
    """"control" or "test"."""
    layout: str
    """Short layout name plus the techniques that differ from the defaults."""
    verdict: str
    step_time_s: float | None
    step_time_rel: float | None
    tokens_per_s: float | None
    tokens_per_s_rel: float | None
    peak_mem_mib: float | None
    peak_mem_rel: float | None
    max_abs_dloss: float | None


@dataclass(frozen=True, kw_only=True)
class TradeoffTable:
    source: str
    """The experiment file (or test module) the pairs come from."""
    control: str
    rows: tuple[TradeoffRow, ...]


def layout_text(side: SideRecord) -> str:
    """``tp2 +accum:4``: the layout and every technique set away from its default."""
    techniques = side.get("techniques") or {}
    changed = {k: v for k, v in techniques.items() if _DEFAULT_TECHNIQUES.get(k, v) != v}
    if side.get("hook"):
        changed["hook"] = side["hook"]
    text = fmt_techniques(changed)
    return str(side["short_name"]) if text == "-" else f"{side['short_name']} +{text}"


def _rel(ratio: JsonFloat | None) -> float | None:
    value = as_float(ratio)
    return None if value is None else value - 1.0


def _entry(record: PairRecord, metric: str) -> ResourceRecord:
    entry = (record.get("resources") or {}).get(metric)
    return entry if entry else {"control": None, "test": None, "ratio": None}


def _step_time_ratio(record: PairRecord) -> float | None:
    """Test / control step time; without step times (e.g. no run meta) it is the inverse of
    the tokens/s ratio, since a pair's tokens per step are equal by construction."""
    ratio = as_float(_entry(record, "step_time_s").get("ratio"))
    if ratio is None:
        tps = as_float(_entry(record, "tokens_per_s").get("ratio"))
        ratio = 1.0 / tps if tps else None
    return ratio


def _test_row(record: PairRecord) -> TradeoffRow:
    return TradeoffRow(
        job=str(record["test"]["name"]),
        role="test",
        layout=layout_text(record["test"]),
        verdict=VERDICTS.get(str(record["status"]), str(record["status"])),
        step_time_s=as_float(_entry(record, "step_time_s").get("test")),
        step_time_rel=_rel(_step_time_ratio(record)),
        tokens_per_s=as_float(_entry(record, "tokens_per_s").get("test")),
        tokens_per_s_rel=_rel(_entry(record, "tokens_per_s").get("ratio")),
        peak_mem_mib=as_float(_entry(record, "peak_mem_mib").get("test")),
        peak_mem_rel=_rel(_entry(record, "peak_mem_mib").get("ratio")),
        max_abs_dloss=as_float((record.get("max_abs_delta") or {}).get("loss")),
    )


def _control_row(records: Sequence[PairRecord]) -> TradeoffRow:
    """The control's numbers from the first pair that has them (pairs of one file share it)."""

    def first(metric: str) -> float | None:
        for record in records:
            value = as_float(_entry(record, metric).get("control"))
            if value is not None:
                return value
        return None

    return TradeoffRow(
        job=str(records[0]["control"]["name"]),
        role="control",
        layout=layout_text(records[0]["control"]),
        verdict="reference",
        step_time_s=first("step_time_s"),
        step_time_rel=None,
        tokens_per_s=first("tokens_per_s"),
        tokens_per_s_rel=None,
        peak_mem_mib=first("peak_mem_mib"),
        peak_mem_rel=None,
        max_abs_dloss=None,
    )


def tables(pairs: Sequence[PairRecord]) -> list[TradeoffTable]:
    """One table per (experiment file, control job), in the order the pairs come."""
    groups: dict[tuple[str, str], list[PairRecord]] = {}
    for record in pairs:
        groups.setdefault((str(record["source"]), str(record["control"]["name"])), []).append(
            record
        )
    out = []
    for (source, control), records in groups.items():
        if not any(r["control"].get("ran") or r["test"].get("ran") for r in records):
            continue  # nothing ran (all skipped or failed before launch): no numbers to show
        rows = (_control_row(records), *(_test_row(r) for r in records))
        out.append(TradeoffTable(source=source, control=control, rows=rows))
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def cells(row: TradeoffRow) -> list[str]:
    return [
        row.job,
        row.role,
        row.layout,
        row.verdict,
        _seconds(row.step_time_s),
        fmt_pct(row.step_time_rel),
        fmt_amount(row.tokens_per_s),
        fmt_pct(row.tokens_per_s_rel),
        fmt_amount(row.peak_mem_mib),
        fmt_pct(row.peak_mem_rel),
        fmt_num(row.max_abs_dloss),
    ]


def title(table: TradeoffTable) -> str:
    return f"{Path(table.source).name} — control {table.control}"


def markdown_lines(pairs: Sequence[PairRecord]) -> list[str]:
    """The "## Resources" section of report.md ([] when no pair ran)."""
    found = tables(pairs)
    if not found:
        return []
    lines = ["", "## Resources", "", NOTE]
    for found_table in found:
        lines += ["", f"### {md_cell(title(found_table))}", ""]
        lines += md_table(HEADER, [cells(row) for row in found_table.rows], RIGHT)
    return lines


def html_section(pairs: Sequence[PairRecord]) -> str:
    """The "Resources" section of report.html ("" when no pair ran)."""
    found = tables(pairs)
    if not found:
        return ""
    return html_tables_section(
        "Resources",
        NOTE,
        HEADER,
        RIGHT,
        [
            TitledTable(title(t), [cells(row) for row in t.rows], [row.role for row in t.rows])
            for t in found
        ],
    )
