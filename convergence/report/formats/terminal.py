"""The terminal summary: the matrix (one row per pair, aligned plain text that fits 120
columns) and the per-dimension block under it.

    pair        rep shard tp cp pp techniques  verdict  |Δloss|  |Δgnorm|  tok/s  mem   wall   cache
    fsdp2-tp2     -     2  2  -  -  -          PASS     2.5e-07  0         0.93x  0.59x 14.2s  ctrl cached

Axis degrees are the test's; "-" means 1 (axis off). Ratios are test / control.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from convergence.report.data.records import PairRecord, pair_record
from convergence.report.data.resume import ResumeRecord
from convergence.report.data.schema import floor_notes
from convergence.report.fmt import (
    NOT_COMPARED_TITLE,
    VERDICTS,
    as_float,
    cut,
    fmt_deg,
    fmt_num,
    fmt_ratio,
    fmt_techniques,
    fmt_wall,
)
from convergence.report.sections.blame import attribution_cell
from convergence.report.sections.dimensions import render_dimensions
from convergence.run.outcome import PairOutcome
from convergence.stats.anchored import ANCHORED
from convergence.stats.resumed import RESUMED

AXIS_COLUMNS: tuple[tuple[str, str], ...] = (
    ("rep", "dp_replicate"),
    ("shard", "dp_shard"),
    ("tp", "tp"),
    ("cp", "cp"),
    ("pp", "pp"),
)

COLUMNS: tuple[tuple[str, str], ...] = (
    # (key, header); numbers right-aligned, text left-aligned.
    ("pair", "pair"),
    ("rep", "rep"),
    ("shard", "shard"),
    ("tp", "tp"),
    ("cp", "cp"),
    ("pp", "pp"),
    ("techniques", "techniques"),
    ("verdict", "verdict"),
    ("dloss", "|Δloss|"),
    ("dgnorm", "|Δgnorm|"),
    ("tps", "tok/s"),
    ("mem", "mem"),
    ("wall", "wall"),
    ("cache", "cache"),
)
DEVICE_COLUMN = ("device", "device")
"""Where each pair ran (convergence.launch.placement: cuda, cuda-shared, cpu): shown when a
pair ran off the CPU, so a CPU machine's matrix stays as narrow as it was."""
EP_COLUMN = ("ep", "ep")
"""The test's expert-parallel degree: shown when a pair has EP (MoE models), after pp, so a
dense matrix stays as it was."""
BLAME_COLUMN = ("blame", "blame")
"""The attribution of a failing N-D pair (which axis): shown when a pair was attributed."""
RIGHT = frozenset({"rep", "shard", "tp", "cp", "pp", "ep", "dloss", "dgnorm", "tps", "mem", "wall"})
SHRINKABLE = ("techniques", "pair", "verdict")
"""Columns cut (with "…") when the table is too wide, in this order."""
MIN_SHRINK = 8
GAP = "  "


def record_row(record: PairRecord) -> dict[str, str]:
    """Formatted cells of one pair, from its report record (see records.pair_record)."""
    degrees = record["test"]["degrees"]
    resume = record.get("resume")
    if resume is not None and "layout" in resume:  # shown as the layout it resumed on
        degrees = resume["layout"]["degrees"]
    res = record["resources"]
    wall = record["wall_s"]["test"] or record["wall_s"]["pair"] or None
    cached = [
        name
        for name, on in (("ctrl", record["cached"]["control"]), ("test", record["cached"]["test"]))
        if on
    ]
    verdict = VERDICTS.get(record["status"], str(record["status"]).upper())
    row = {"pair": record["name"]}
    row.update({key: fmt_deg(int(degrees[axis])) for key, axis in AXIS_COLUMNS})
    row["ep"] = fmt_deg(int(degrees.get("ep", 1)))  # report.json files from before EP: 1
    row.update(
        {
            "techniques": _with_resume(fmt_techniques(record["techniques_changed"]), resume),
            "verdict": verdict
            + ("*" if record["stopped_early_at"] is not None else "")
            + (_failed_metrics(record) or _passed_checks(record)),
            "dloss": fmt_num(record["max_abs_delta"]["loss"]),
            "dgnorm": fmt_num(record["max_abs_delta"]["grad_norm"]),
            "tps": fmt_ratio(res["tokens_per_s"]["ratio"]),
            "mem": _memory_ratio(res["peak_mem_mib"]),
            "wall": fmt_wall(as_float(wall)),
            "cache": "+".join(cached) + " cached" if cached else "-",
            # Where the pair ran (convergence.launch.placement): cuda, cuda-shared or cpu.
            "device": str(record.get("placement") or "-").partition(":")[0],
            # Which axis a failing N-D pair's failure belongs to (run/attribution.py).
            "blame": attribution_cell(dict(record)),
        }
    )
    return row


def _with_resume(techniques: str, resume: ResumeRecord | None) -> str:
    """The techniques cell of a resume pair starts with where it resumed (``resume@10``)."""
    if resume is None:
        return techniques
    where = f"resume@{resume['at_step']}"
    return where if techniques == "-" else f"{where},{techniques}"


#: Verdicts of the checks a pair asked for beyond its curves (the anchored check, a resume's
#: twins), named after a PASS: a passing anchored or resumed pair showed nothing of them.
EXTRA_CHECKS = (ANCHORED, RESUMED)


def _passed_checks(record: PairRecord) -> str:
    """`` +anchored`` after a passing verdict whose pair ran the anchored check (and
    ``+resumed`` for a resume judged against its twins)."""
    names = [
        str(v["metric"])
        for v in record["verdicts"]
        if v["metric"] in EXTRA_CHECKS and v["passed"] and not v.get("not_compared")
    ]
    return "".join(f" +{name}" for name in dict.fromkeys(names))


def _failed_metrics(record: PairRecord) -> str:
    """The first gating metric that failed (and how many more), after the verdict ("FAIL
    grad_norm_parts", "FAIL loss+1"): the deltas
    shown are the loss's and the grad norm's, which may be small when another metric failed."""
    names = [
        v["metric"]
        for v in record["verdicts"]
        if v["gate"] and not v["passed"] and not v.get("not_compared")
    ]
    if not names:
        return ""
    return f" {names[0]}" + (f"+{len(names) - 1}" if len(names) > 1 else "")


def _memory_ratio(mem: Mapping[str, Any]) -> str:
    """The peak-memory ratio, or "-" where a device reports no memory (CPU: zero or a
    meaningless negative number)."""
    values = [as_float(mem.get(side)) for side in ("control", "test")]
    if any(v is None or not v > 0 for v in values):
        return "-"
    return fmt_ratio(mem["ratio"])


def matrix_rows(outcomes: Iterable[PairOutcome]) -> list[dict[str, str]]:
    """One dict of formatted cells per pair, keyed by the column keys of :data:`COLUMNS`."""
    return [record_row(pair_record(o, include_curves=False)) for o in outcomes]


def with_device(
    columns: tuple[tuple[str, str], ...], rows: Sequence[Mapping[str, str]]
) -> tuple[tuple[str, str], ...]:
    """``columns`` plus :data:`EP_COLUMN` when a row has EP (after pp, or at the end),
    :data:`DEVICE_COLUMN` when a row ran on a GPU, and :data:`BLAME_COLUMN` when a pair was
    attributed."""
    if any(r.get("ep", "-") != "-" for r in rows):
        keys = [key for key, _ in columns]
        at = keys.index("pp") + 1 if "pp" in keys else len(columns)
        columns = (*columns[:at], EP_COLUMN, *columns[at:])
    shown = any(r["device"] not in ("-", "cpu") for r in rows)
    columns = (*columns, DEVICE_COLUMN) if shown else columns
    return (*columns, BLAME_COLUMN) if any(r.get("blame") for r in rows) else columns


def _layout(
    rows: Sequence[Mapping[str, str]], width: int, columns: tuple[tuple[str, str], ...]
) -> tuple[dict[str, int], str]:
    """Column widths and the gap: cut the name columns first, then narrow the gaps."""
    widths = {key: max([len(header)] + [len(r[key]) for r in rows]) for key, header in columns}
    gaps = len(columns) - 1
    excess = sum(widths.values()) + len(GAP) * gaps - width
    for key in SHRINKABLE:
        if excess <= 0:
            break
        cut = min(excess, max(widths[key] - MIN_SHRINK, 0))
        widths[key] -= cut
        excess -= cut
    return widths, (GAP if excess <= 0 else " ")


def render_matrix(outcomes: Iterable[PairOutcome], width: int = 120) -> str:
    """The matrix as aligned plain text (newline-terminated), with a one-line summary."""
    outcomes = list(outcomes)
    rows = matrix_rows(outcomes)
    columns = with_device(COLUMNS, rows)
    widths, gap = _layout(rows, width, columns)
    header = {key: title for key, title in columns}
    lines = []
    for row in [header, *rows]:
        cells = []
        for key, _ in columns:
            text = cut(row[key], widths[key])
            cells.append(text.rjust(widths[key]) if key in RIGHT else text.ljust(widths[key]))
        lines.append(gap.join(cells).rstrip())
    lines.insert(1, "-" * min(max(len(line) for line in lines), width))
    counts = {s: sum(o.status == s for o in outcomes) for s in VERDICTS}
    summary = (
        f"{len(outcomes)} pair{'' if len(outcomes) == 1 else 's'}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['error']} error{'' if counts['error'] == 1 else 's'}"
    )
    if counts["inconclusive"]:
        summary += f", {counts['inconclusive']} inconclusive"
    if counts["skipped"]:
        summary += f", {counts['skipped']} skipped"
    if any(o.stopped_early_at is not None for o in outcomes):
        summary += "  (* stopped early: verdict decided)"
    lines.append(summary)
    return "\n".join(lines) + "\n"


def render_outcome_dimensions(outcomes: Iterable[PairOutcome], width: int = 120) -> str:
    """:func:`~convergence.report.sections.dimensions.render_dimensions` of outcomes."""
    return render_dimensions((pair_record(o, include_curves=False) for o in outcomes), width)


def not_compared_lines(outcomes: Iterable[PairOutcome]) -> list[str]:
    """Every pair's gating metrics that a run did not log, with the fix (the plugin prints
    them in yellow): a pair that passed on the loss alone says so."""
    lines = [
        f"  {o.pair.name}: {v.metric} not compared -- {v.message}"
        for o in outcomes
        for v in o.verdicts
        if v.not_compared
    ]
    return [f"{NOT_COMPARED_TITLE}:", *lines] if lines else []


def floors_lines(outcomes: Iterable[PairOutcome]) -> list[str]:
    """Whose noise floors the paired/twin verdicts used, one line per distinct note."""
    return [f"noise {n}" if n.startswith("floors") else n for n in floor_notes(outcomes)]


#: The verdicts that judge from a state shared with the control (one step from each of its
#: anchors; the steps after a resume) rather than along the trajectory: shown passed too, so a
#: pass says it held from those states, not only along the curves.
SHARED_STATE_VERDICTS = ("anchored", "resumed")
SHARED_STATE_TITLE = "judged from the control's states (anchored) / after the resume (resumed)"


def shared_state_verdicts(
    outcomes: Iterable[PairOutcome],
) -> list[tuple[str, str, bool, str]]:
    """(pair, verdict name, passed, message) of every anchored or resumed verdict."""
    return [
        (o.pair.name, v.metric, v.passed, v.message)
        for o in outcomes
        for v in o.verdicts
        if v.metric in SHARED_STATE_VERDICTS and not v.not_compared
    ]


def shared_state_lines(outcomes: Iterable[PairOutcome]) -> list[str]:
    lines = [
        f"  {name}: {metric} {'PASS' if passed else 'FAIL'} -- {message}"
        for name, metric, passed, message in shared_state_verdicts(outcomes)
    ]
    return [f"{SHARED_STATE_TITLE}:", *lines] if lines else []


def render_summary(
    outcomes: Iterable[PairOutcome], width: int = 120, *, not_compared: bool = True
) -> str:
    """The terminal summary shared by the plugin and the CLI: the matrix, then the
    per-dimension block under it (for one pair too: it says what the test changes over its
    control, which the matrix's degree columns leave to the reader), then the gating metrics
    not compared (``not_compared=False``: the caller prints :func:`not_compared_lines`)."""
    outcomes = list(outcomes)
    text = render_matrix(outcomes, width)
    if outcomes:
        text = (
            text.rstrip("\n")
            + "\nby dimension (what each test adds over its control):\n"
            + render_outcome_dimensions(outcomes, width)
        )
    floors = floors_lines(outcomes)
    if floors:
        text = text.rstrip("\n") + "\n" + "\n".join(floors) + "\n"
    shared = shared_state_lines(outcomes)
    if shared:
        text = text.rstrip("\n") + "\n" + "\n".join(shared) + "\n"
    missing = not_compared_lines(outcomes) if not_compared else []
    if missing:
        text = text.rstrip("\n") + "\n" + "\n".join(missing) + "\n"
    return text
