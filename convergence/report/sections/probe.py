"""The numerics probe (PairOutcome.localisation): its one-line summary, the failure
message's line, and the per-module / per-parameter tables of report.md ("## Numerics probe",
after the failures) and report.html (inside each probed pair's section).

See convergence.run.probe_compare for the dict's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from convergence.report.data.records import Localisation, PairRecord
from convergence.report.data.schema import ReportDocument
from convergence.report.fmt import fmt_num
from convergence.report.markup import html_table, md_code, md_table, md_text

HEADER: tuple[str, ...] = ("module", "control norm", "test norm", "|Δ|", "rel Δ", "")
RIGHT: tuple[bool, ...] = (False, True, True, True, True, False)
#: Titles of the two tables, by localisation key.
TABLES: tuple[tuple[str, str], ...] = (
    ("modules", "Module output norms (forward order)"),
    ("parameters", "Gradient norms (forward order)"),
)


def has_probe_table(record: PairRecord) -> bool:
    loc = record.get("localisation")
    return isinstance(loc, Mapping) and isinstance(loc.get("modules"), list)


def step_text(loc: Localisation) -> str:
    """Which step was probed, and why: "step 3 (first divergent step; step 1 agreed)"."""
    step, first = loc.get("step"), loc.get("first_divergent_step")
    notes = []
    if first is not None and first == step and step != 1:
        notes.append("first divergent step")
    elif first is not None and first != step:
        notes.append(f"curves part at step {first}")
    if loc.get("step_1_agrees"):
        notes.append("step 1 agreed")
    return f"step {step}" + (f" ({'; '.join(notes)})" if notes else "")


def summary_text(loc: Localisation) -> str:
    """One line: the first differing module/parameter, or agreement, or the probe's error."""
    where = step_text(loc)
    if loc.get("error"):
        return f"{where}: numerics probe failed: {loc['error']}"
    replay = loc.get("replay_loss_max_abs_diff")
    caveat = (
        f"; the replay did NOT reproduce the run (loss off by up to {fmt_num(replay)} "
        "before this step)"
        if isinstance(replay, (int, float)) and replay > 0
        else ""
    )
    caveat += dp_losses_text(loc)
    if loc.get("module") is None and loc.get("parameter") is None:
        return (
            f"{where}: all {loc.get('modules_compared')} module outputs and gradients "
            f"agree (rtol {loc.get('rtol')}, atol {loc.get('atol')}){caveat}"
        )
    return (
        f"{where}: first differing module `{loc.get('module')}` "
        f"(|Δ norm| {fmt_num(loc.get('max_abs_diff'))}), first differing gradient "
        f"`{loc.get('parameter')}`; {loc.get('modules_differing')} of "
        f"{loc.get('modules_compared')} modules differ; loss {fmt_num(loc.get('loss_control'))}"
        f" vs {fmt_num(loc.get('loss_test'))}{caveat}"
    )


def dp_losses_text(loc: Localisation) -> str:
    """ "; per-DP-rank loss control [a, b] vs test [c, d]" where either side has DP > 1 (a
    data-sharding bug shows as per-rank losses that differ while their mean may not)."""
    ctrl, test = loc.get("dp_losses_control"), loc.get("dp_losses_test")
    if not any(isinstance(x, list) and len(x) > 1 for x in (ctrl, test)):
        return ""

    def listed(values: Any) -> str:
        return (
            "-"
            if not isinstance(values, list)
            else ("[" + ", ".join(fmt_num(v) for v in values) + "]")
        )

    return f"; per-DP-rank loss {listed(ctrl)} vs {listed(test)}"


def failure_line(loc: Localisation) -> str:
    """The failure message's line: "first divergence at step 3; probe at step 3: first
    differing module X, first differing gradient Y"."""
    first = loc.get("first_divergent_step")
    head = f"first divergence at step {first}; " if first is not None else ""
    probe = "probe" if loc.get("step") is None else f"probe at step {loc.get('step')}"
    if loc.get("error"):
        return f"{head}{probe} failed (see below)"
    module, parameter = loc.get("module"), loc.get("parameter")
    if module is None and parameter is None:
        earlier = " (and at step 1)" if loc.get("step_1_agrees") else ""
        return f"{head}{probe}{earlier}: every module output and gradient agrees"
    found = [
        f"first differing module {module}" if module else "module outputs agree",
        f"first differing gradient {parameter}" if parameter else "gradients agree",
    ]
    return f"{head}{probe}: " + ", ".join(found)


def rows(entries: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [
        [
            str(e.get("name")),
            fmt_num(e.get("control")),
            fmt_num(e.get("test")),
            fmt_num(e.get("abs_diff")),
            fmt_num(e.get("rel_diff")),
            "differs" if e.get("differs") else "",
        ]
        for e in entries
    ]


def markdown_section(record: PairRecord) -> list[str]:
    """The numerics probe of one pair: summary line and the per-module/parameter tables."""
    loc = record["localisation"] or {}  # has_probe_table: never None here
    lines = [f"### {md_code(record['name'])}", "", md_text(summary_text(loc))]
    for key, title in TABLES:
        if loc.get(key):
            lines += ["", f"{title}:", ""]
            lines += md_table(HEADER, rows(loc[key]), list(RIGHT))
    return lines + [""]


def markdown_lines(report: ReportDocument) -> list[str]:
    """report.md's "## Numerics probe" section ([] when no pair was probed)."""
    probed = [p for p in report["pairs"] if has_probe_table(p)]
    if not probed:
        return []
    lines = ["", "## Numerics probe", ""]
    for record in probed:
        lines += markdown_section(record)
    return lines


def pair_html(record: PairRecord) -> str:
    """The probe's per-module and per-parameter tables in a pair's section ("" without)."""
    if not has_probe_table(record):
        return ""
    loc = record["localisation"] or {}  # has_probe_table: never None here
    parts = [f"<h4>Numerics probe</h4><p>{escape(summary_text(loc))}</p>"]
    for key, title in TABLES:
        entries = loc.get(key) or []
        if not entries:
            continue
        cells = [[escape(c) for c in row] for row in rows(entries)]
        classes = ["bad" if e.get("differs") else "" for e in entries]
        table = html_table([escape(h) for h in HEADER], cells, right=RIGHT, row_class=classes)
        parts.append(
            f"<details{' open' if key == 'modules' else ''}><summary>{escape(title)}"
            f"</summary>{table}</details>"
        )
    return "".join(parts)
