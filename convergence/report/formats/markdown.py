"""report.md and the GitHub Actions step summary, rendered from the report.json document."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from convergence.report.data.records import DivergenceRecord, PairRecord, not_compared
from convergence.report.data.resume import resumed_label
from convergence.report.data.schema import ReportDocument
from convergence.report.fmt import (
    NOT_COMPARED_TITLE,
    as_float,
    fmt_delta,
    fmt_num,
    fmt_value,
    fmt_wall,
)
from convergence.report.formats.terminal import (
    AXIS_COLUMNS,
    COLUMNS,
    RIGHT,
    SHARED_STATE_TITLE,
    SHARED_STATE_VERDICTS,
    record_row,
    with_device,
)
from convergence.report.markup import md_cell as cell
from convergence.report.markup import md_code as code
from convergence.report.markup import md_table as table
from convergence.report.markup import md_text as text
from convergence.report.sections import SECTIONS
from convergence.report.sections.blame import attribution_lines
from convergence.report.sections.probe import summary_text

STEP_SUMMARY_LIMIT = 1024 * 1024
"""GitHub rejects a step summary over 1 MiB (the whole file of one step)."""
STEP_SUMMARY_MARGIN = 8 * 1024
ERROR_LINES = 30
ICONS = {"passed": "✅", "failed": "❌", "inconclusive": "❔", "error": "💥", "skipped": "⏭️"}


def headline(summary: Mapping[str, int]) -> str:
    bad = summary["failed"] + summary["errors"]
    undecided = summary.get("inconclusive", 0)
    icon = "❌" if bad else "❔" if undecided else "✅"
    errors = summary["errors"]
    parts = [
        f"{summary['passed']} passed",
        f"{summary['failed']} failed",
        f"{errors} error{'' if errors == 1 else 's'}",
    ]
    if undecided:
        parts.append(f"{undecided} inconclusive")
    if summary.get("skipped"):
        parts.append(f"{summary['skipped']} skipped")
    count = summary["pairs"]
    return f"## {icon} Convergence: {', '.join(parts)} ({count} pair{'' if count == 1 else 's'})"


#: The terminal matrix's columns with the five axis-degree columns folded into one "layout"
#: cell (the test's short name, e.g. fsdp2-tp2): 10 columns instead of 14, so the table fits
#: a GitHub step summary or PR comment without a horizontal scroll.
MD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("pair", "pair"),
    ("layout", "layout"),
    *(
        (key, title)
        for key, title in COLUMNS
        if key not in {k for k, _ in AXIS_COLUMNS} and key != "pair"
    ),
)


def matrix_table(pairs: Sequence[PairRecord]) -> list[str]:
    """The matrix in :data:`MD_COLUMNS`; the layout column is left out when every pair is
    named after its test's layout (an experiment's ``fsdp2-tp2``): it would repeat the name."""
    columns = with_device(MD_COLUMNS, [record_row(record) for record in pairs])
    if pairs and all(
        str(r["name"]) == str(r["test"]["short_name"]) and "resume" not in r for r in pairs
    ):
        columns = tuple(c for c in columns if c[0] != "layout")
    rows = []
    for record in pairs:
        row = record_row(record)
        row["verdict"] = f"{ICONS.get(record['status'], '')} {row['verdict']}".strip()
        resume = record.get("resume")
        row["layout"] = (
            resumed_label(resume) if resume is not None else str(record["test"]["short_name"])
        )
        rows.append([row[key] for key, _ in columns])
    return table([title for _, title in columns], rows, [key in RIGHT for key, _ in columns])


def divergence_lines(rows: Sequence[DivergenceRecord], reference: str) -> list[str]:
    return table(
        ["step", reference, "test", "Δ"],
        [
            [r["step"], fmt_value(r["control"]), fmt_value(r["test"]), fmt_delta(r["delta"])]
            for r in rows
        ],
        [True] * 4,
    )


def verdict_lines(record: PairRecord) -> list[str]:
    lines: list[str] = []
    for v in record["verdicts"]:
        if v["passed"] or v.get("not_compared"):
            continue  # not compared: its own section, for every pair
        gate = (
            ": **inconclusive** (not enough evidence either way)"
            if v.get("inconclusive")
            else ""
            if v["gate"]
            else (
                ": regressed (report only, does not gate)"
                if v.get("steps_compared", 1)
                else ": not compared (report only)"
            )
        )
        where = (
            f"first divergent step **{v['first_divergent_step']}**; "
            if v["first_divergent_step"] is not None
            else ""
        )
        tol = (
            f" (tolerance {fmt_num(v['tolerance_at_max'])}: {v['tolerance']})"
            if v["tolerance"]
            else ""
        )
        lines.append(
            f"- **{v['metric']}** ({v['method']}){gate}: {where}max |Δ| "
            f"{fmt_num(v['max_deviation'])} at step {v['max_deviation_step']}{tol}"
        )
        if v["p_values"]:
            lines.append(
                "  p-values: " + ", ".join(f"{k}={fmt_num(p)}" for k, p in v["p_values"].items())
            )
        if v["message"]:
            lines.append(f"  > {text(v['message'])}")
    return lines


def failure_section(record: PairRecord) -> list[str]:
    status = record["status"]
    head = (
        f"### {ICONS.get(status, '')} {code(record['name'])} — {status.upper()}  \n"
        f"{code(record['id'])} · control {code(record['control']['short_name'])} vs test "
        f"{code(record['test']['short_name'])} · {text(record['regime'])} regime"
    )
    lines = [head, ""]
    resume = record.get("resume")
    if resume is not None:
        lines += [
            f"Resume: checkpoint after step {resume['at_step']}, "
            f"{code(resume['before'])} → {code(resume['after'])}"
            + (f" — {text(resume['note'])}" if resume["note"] else ""),
            "",
        ]
    if record["first_divergent_step"] is not None:
        lines.append(f"**First divergent step: {record['first_divergent_step']}**")
        lines.append("")
    lines += verdict_lines(record)
    reference = str(record.get("delta_reference") or "control")
    for metric, rows in record["divergence"].items():
        lines += ["", f"{metric} around the divergence:", ""]
        lines += divergence_lines(rows, reference)
    if record["localisation"]:
        lines += [
            "",
            f"Localisation (numerics probe): {text(summary_text(record['localisation']))}",
        ]
    if "attribution" in record:
        lines += ["", *attribution_lines(record["attribution"])]
    if record["error"]:
        err = record["error"].rstrip().splitlines()
        shown = err[:ERROR_LINES] + (
            [f"... ({len(err) - ERROR_LINES} more lines)"] if len(err) > ERROR_LINES else []
        )
        if lines[-1]:
            lines.append("")
        # A ``` inside the error would close the fence early.
        lines += ["```text", *(line.replace("```", "ˋˋˋ") for line in shown), "```"]
    return lines + [""]


def environment_line(report: ReportDocument) -> str:
    env = report["environment"]
    parts = [
        f"python {env.get('python')}",
        f"torch {env.get('torch')}",
        str(env.get("hostname") or env.get("host") or ""),
        str(env.get("platform", "")),
    ]
    if report.get("wall_s") is not None:
        parts.append(f"wall {fmt_wall(as_float(report['wall_s']))}")
    summary = report["summary"]
    parts.append(f"{summary['cached_runs']} cached / {summary['fresh_runs']} fresh runs")
    floors = env.get("noise_floors")  # whose floors the paired/twin verdicts used
    return (
        "<sub>"
        + " · ".join(cell(p) for p in parts if p)
        + f" · generated {report['generated_at']}"
        + (f"<br>noise {cell(str(floors))}" if floors else "")
        + "</sub>"
    )


def regression_lines(pairs: Sequence[PairRecord]) -> list[str]:
    """Pairs that passed but whose non-gating metrics (tokens/s, memory) regressed: worth a
    look, never a failure (failed pairs list them in their own section)."""
    lines: list[str] = []
    for record in pairs:
        for v in record["verdicts"]:
            if v["passed"] or v["gate"] or not v.get("steps_compared", 1):
                continue  # a metric a side did not log is not a regression
            detail = (
                text(v["message"]) if v["message"] else f"max |Δ| {fmt_num(v['max_deviation'])}"
            )
            lines.append(
                f"- {cell(record['name'])}: **{v['metric']}** ({v['method']}): "
                f"regressed (report only, does not gate): {detail}"
            )
    return ["", "## Regressions (report only)", "", *lines] if lines else []


def not_compared_lines(pairs: Sequence[PairRecord]) -> list[str]:
    """Every pair's gating metrics that a run did not log, passed pairs too, with the fix:
    a pair that passed on the loss alone must say so."""
    lines = [
        f"- {cell(p['name'])}: **{v['metric']}** ({v['method']}): not compared: "
        f"{text(v['message'])}"
        for p, v in not_compared(pairs)
    ]
    return ["", f"## ⚠️ {NOT_COMPARED_TITLE}", "", *lines] if lines else []


def shared_state_lines(pairs: Sequence[PairRecord]) -> list[str]:
    """Every anchored or resumed verdict, passed ones too (terminal.SHARED_STATE_VERDICTS)."""
    lines = [
        f"- {ICONS['passed' if v['passed'] else 'failed']} {cell(p['name'])}: "
        f"**{v['metric']}**: {text(v['message'])}"
        for p in pairs
        for v in p["verdicts"]
        if v["metric"] in SHARED_STATE_VERDICTS and not v.get("not_compared")
    ]
    return ["", f"## Checks {SHARED_STATE_TITLE}", "", *lines] if lines else []


def render_markdown(report: ReportDocument) -> str:
    """Headline, the matrix, the sections (:data:`~convergence.report.sections.SECTIONS`),
    one part per failed/errored pair, the report-only regressions, then the sections placed
    after the failures."""
    pairs = report["pairs"]
    lines = [headline(report["summary"]), "", environment_line(report), ""]
    lines += matrix_table(pairs)
    if any(p["stopped_early_at"] is not None for p in pairs):
        lines += ["", "\\* stopped early: the verdict was decided before the last step."]
    for section in SECTIONS:
        if not section.markdown_after_failures:
            lines += section.markdown(report)
    bad = [p for p in pairs if p["status"] in ("failed", "inconclusive", "error")]
    if bad:
        lines += ["", "## Failures", ""]
        for record in bad:
            lines += failure_section(record)
    lines += regression_lines([p for p in pairs if p not in bad])
    lines += not_compared_lines(pairs)
    lines += shared_state_lines(pairs)
    for section in SECTIONS:
        if section.markdown_after_failures:
            lines += section.markdown(report)
    return "\n".join(lines).rstrip() + "\n"


def truncate_utf8(text: str, max_bytes: int) -> str:
    """At most ``max_bytes`` of UTF-8, cut at a line end (never inside a character)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    cut = data[:max_bytes].decode("utf-8", errors="ignore")
    return cut[: cut.rfind("\n") + 1] if "\n" in cut else cut


def write_step_summary(md: str, env: Mapping[str, str] = os.environ) -> Path | None:
    """Append ``md`` to $GITHUB_STEP_SUMMARY when set; returns the file (None when unset).

    The file already holds earlier output of the same step, which counts against GitHub's
    1 MiB limit, so only what is left is used (with a note when the report was cut).
    """
    target = env.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    path = Path(target)
    used = path.stat().st_size if path.exists() else 0
    budget = STEP_SUMMARY_LIMIT - STEP_SUMMARY_MARGIN - used
    note = (
        "\n> **Note:** the convergence report was truncated to fit GitHub's 1 MiB step "
        "summary limit; see report.md / report.html in the job's artifacts.\n"
    )
    text = md
    if len(text.encode("utf-8")) > budget:
        room = budget - len(note.encode("utf-8"))
        if room <= 0:
            return path  # the step's summary is already full: adding a note would break it
        text = truncate_utf8(text, room) + note
    with open(path, "a", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path
