"""The attribution of a failing N-D pair (PairOutcome.attribution, run/attribution.py): one
line with the blame, then a table of the isolating pairs, for report.md."""

from __future__ import annotations

from typing import Any


def attribution_lines(record: dict[str, Any]) -> list[str]:
    """Markdown lines: the blame, and one row per isolating pair."""
    lines = [
        f"Attribution (which axis): **{record['blame']}** ({record['jobs']} isolating pair(s) "
        "against the same control)",
        "",
        "| axes | layout | verdict | first divergent step | metric | note |",
        "|---|---|---|---:|---|---|",
    ]
    for run in record["runs"]:
        step = run["first_divergent_step"]
        lines.append(
            f"| {run['label']} | {run['layout']} | {run['status']} | "
            f"{'' if step is None else step} | {run['metric'] or ''} | {run['note']} |"
        )
    return lines


def attribution_cell(record: dict[str, Any]) -> str:
    """The matrix's attribution column: the blame, or empty."""
    attribution = record.get("attribution")
    return str(attribution["blame"]) if attribution else ""
