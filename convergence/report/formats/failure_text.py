"""How a failed or broken pair reads as text: pytest's failure section (TOML items and the
``convergence_pair`` fixture, via :mod:`pytest_convergence.failure_section`) and ``convergence compare``
print the same words."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convergence.report.data.curves import divergence_table
from convergence.report.data.records import first_divergent_step
from convergence.report.data.resume import resume_record
from convergence.report.fmt import fmt_delta, fmt_float, fmt_value, verdict_state
from convergence.report.formats.plots import PLOT_DIR, plot_names
from convergence.report.sections.probe import failure_line
from convergence.run.outcome import PairOutcome
from convergence.run.probe_compare import summary_items
from convergence.spec.job import JobSpec
from convergence.stats.anchored import ANCHORED
from convergence.stats.resumed import RESUMED
from convergence.stats.types import MetricVerdict

TRACEBACK_HEAD_LINES = 25
"""Lines of a broken job's traceback shown in the failure text; the rest is in the logs."""
TABLE_AROUND = 3
"""Steps shown before and after the first divergent step."""


def _verdict_line(v: MetricVerdict, metric_width: int = 12) -> str:
    state = verdict_state(v.passed, v.gate, v.steps_compared, v.not_compared, v.inconclusive)
    if v.passed and not v.gate and not v.not_compared:
        state += " (report only)"
    parts = [f"  {v.metric:<{metric_width}} {v.method:<10} {state:<6}"]
    if v.first_divergent_step is not None:
        parts.append(f"first divergent step {v.first_divergent_step}")
    at = f" at step {v.max_deviation_step}" if v.max_deviation_step is not None else ""
    if v.tolerance == "equal":  # an exact check (data fingerprint): its deviation is a count
        parts.append(f"{int(v.max_deviation)} steps differ")
    else:
        parts.append(f"max |Δ| {fmt_float(float(v.max_deviation))}{at}")
    if v.tolerance_at_max is not None:
        parts.append(f"(tolerance there {fmt_float(float(v.tolerance_at_max))})")
    if v.message:
        parts.append(f"- {v.message}")
    return "  ".join(parts)


def _table_rows(outcome: PairOutcome, metric: str, around: int) -> Sequence[Sequence[Any]]:
    return [tuple(row) for row in divergence_table(outcome, metric, around)]


def _table(outcome: PairOutcome, metric: str) -> list[str]:
    rows = _table_rows(outcome, metric, TABLE_AROUND)
    if not rows:
        return []
    out = [
        f"  {metric} around the divergence:",
        f"    {'step':>6}  {'control':>16}  {'test':>16}  {'Δ':>12}",
    ]
    for row in rows:
        step, cv, tv, delta = (list(row) + [None] * 4)[:4]
        out.append(
            f"    {step!s:>6}  {fmt_value(cv):>16}  {fmt_value(tv):>16}  {fmt_delta(delta):>12}"
        )
    return out


def _paths(outcome: PairOutcome) -> list[str]:
    out = []
    for side_name, side in (("control", outcome.control), ("test", outcome.test)):
        if side is None or side.run_dir is None:
            continue
        note = " (from cache)" if side.cached else ""
        out.append(f"  {side_name} run: {side.run_dir}{note}")
        if side.result is not None:
            out.append(f"  {side_name} logs: {side.result.log_dir}")
    for plot in outcome.plots:
        out.append(f"  plot: {plot}")
    return out


def _traceback_head(text: str) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) <= TRACEBACK_HEAD_LINES:
        return "\n".join(lines)
    rest = len(lines) - TRACEBACK_HEAD_LINES
    return "\n".join(lines[:TRACEBACK_HEAD_LINES] + [f"... ({rest} more lines in the logs)"])


def headline(outcome: PairOutcome) -> str:
    """One line (it is what pytest's short test summary shows)."""
    pair = outcome.pair
    if outcome.status == "error":
        first = (outcome.error or "a job broke").strip().splitlines()[0]
        return f"{pair.pair_id}: ERROR: {first}"
    if outcome.error:  # e.g. the test job's loss became NaN: that is the news, not the Δ
        return f"{pair.pair_id}: {outcome.error.strip().splitlines()[0]}"
    failing = [v for v in outcome.verdicts if not v.passed and v.gate]
    if not failing:
        return f"{pair.pair_id}: {outcome.status.upper()}"
    parts = []
    for v in failing:
        if v.metric in (ANCHORED, RESUMED):  # its message names the anchor or the resume
            parts.append(v.message)
            continue
        where = (
            f"diverges from step {v.first_divergent_step}"
            if v.first_divergent_step is not None
            else "fails"
        )
        parts.append(f"{v.metric} {where} (max |Δ| {fmt_float(float(v.max_deviation))})")
    resume = resume_record(outcome, first_divergent_step(outcome))
    at_resume = f" -- {resume['note']}" if resume and resume["note"] else ""
    return f"{pair.pair_id}: " + "; ".join(parts) + at_resume


def render_outcome(
    outcome: PairOutcome, *, report_dir: Path | None = None, show_layouts: bool = True
) -> str:
    """The failure section of a pair: verdicts, the table around the divergence, paths.

    ``show_layouts=False`` for runs whose layout we do not know (``convergence compare`` on
    two folders): the sides are then named by their path alone.
    """
    pair = outcome.pair

    def side(job: JobSpec) -> str:
        return f"{job.name} [{job.layout.short_name()}]" if show_layouts else job.name

    lines = [
        headline(outcome),
        f"  {outcome.status.upper()}: test {side(pair.test)} vs control "
        f"{side(pair.control)}, {pair.regime} regime",
    ]
    resume = resume_record(outcome, first_divergent_step(outcome))
    if resume is not None:
        lines.append(
            f"  resume: checkpoint after step {resume['at_step']}, {resume['before']} "
            f"-> {resume['after']}"
        )
    if outcome.status == "error":
        asked = any(v.not_compared and v.gate for v in outcome.verdicts)
        lines.append(
            "a metric the experiment compares was not logged:"
            if asked
            else "a job broke before a verdict:"
        )
        lines.append(_traceback_head(outcome.error or "(no error text)"))
    elif outcome.error:
        lines.append(f"  {outcome.error.strip()}")
    verdicts = sorted(outcome.verdicts, key=lambda v: (v.passed, not v.gate, v.metric != "loss"))
    if verdicts:
        lines.append("verdicts:")
        # One column width for the names: grad_norm_parts and data_fingerprint pushed their
        # rows' method and state out of line.
        width = max([12, *(len(v.metric) for v in verdicts)])
        lines.extend(_verdict_line(v, width) for v in verdicts)
    if outcome.stopped_early_at is not None:
        lines.append(
            f"  test stopped early at step {outcome.stopped_early_at} (verdict already decided)"
        )
    failing = [v for v in verdicts if not v.passed and v.gate]
    if failing:
        lines.extend(_table(outcome, failing[0].metric))
    if outcome.localisation:
        # One-line entries here; the per-module tables are in the report.

        lines.append(f"localisation (numerics probe): {failure_line(outcome.localisation)}")
        lines.extend(f"  {k}: {v}" for k, v in summary_items(outcome.localisation))
    if outcome.attribution:
        lines.append(f"attribution (which axis): {outcome.attribution['summary']}")
    lines.extend(_paths(outcome))
    if report_dir is not None and not outcome.plots:
        name = plot_names([outcome])[outcome.pair.pair_id]
        lines.append(f"  plot: {report_dir / PLOT_DIR / name}.png (written at session end)")
    return "\n".join(lines)
