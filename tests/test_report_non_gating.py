"""A metric that does not gate (tokens/s by default) and regressed is shown as "regressed
(report only)" -- amber in HTML -- never as FAIL, in every rendering."""

from __future__ import annotations

import dataclasses

from report_examples import judge, passing_pair, run_metrics

from convergence.report import build_report, render_markdown
from convergence.report.formats.failure_text import render_outcome
from convergence.report.formats.html import render_html


def _slow_but_correct():  # type: ignore[no-untyped-def]
    base = passing_pair()
    assert base.control is not None and base.test is not None
    slow = run_metrics(1, tps=500.0)  # half the control's throughput, same loss
    verdicts = judge(base.pair, [base.control.metrics], slow)
    tps = next(v for v in verdicts if v.metric == "tokens_per_s")
    assert not tps.passed and not tps.gate
    assert all(v.passed for v in verdicts if v.gate)
    return dataclasses.replace(
        base, test=dataclasses.replace(base.test, metrics=slow), verdicts=verdicts, status="passed"
    )


def test_a_non_gating_regression_never_reads_as_fail() -> None:
    outcome = _slow_but_correct()
    report = build_report(
        [outcome], environment={}, started_at=None, wall_s=None, include_curves=False
    )
    html = render_html(report, {})
    assert '<span class="warn">regressed (report only)</span>' in html
    assert 'class="bad"' not in html
    md = render_markdown(report)
    assert "## Regressions (report only)" in md and "FAIL" not in md
    assert "**tokens_per_s** (regression): regressed (report only, does not gate)" in md
    text = render_outcome(outcome)
    tps_line = next(line for line in text.splitlines() if "tokens_per_s" in line)
    assert "regressed (report only)" in tps_line and "FAIL" not in tps_line


def test_a_metric_one_side_did_not_log_is_not_compared_not_regressed() -> None:
    base = passing_pair()
    assert base.control is not None and base.test is not None
    metrics = {k: v for k, v in base.test.metrics.items() if k != "tokens_per_s"}
    verdicts = judge(base.pair, [base.control.metrics], metrics)
    outcome = dataclasses.replace(
        base, test=dataclasses.replace(base.test, metrics=metrics), verdicts=verdicts
    )
    tps_line = next(line for line in render_outcome(outcome).splitlines() if "tokens_per_s" in line)
    assert "not compared (report only)" in tps_line and "regressed" not in tps_line
    report = build_report(
        [outcome], environment={}, started_at=None, wall_s=None, include_curves=False
    )
    assert "## Regressions" not in render_markdown(report)


def test_verdict_rows_line_up_with_long_metric_names() -> None:
    """grad_norm_parts / data_fingerprint are longer than the old fixed column: every row's
    method still starts in one column."""
    outcome = _slow_but_correct()
    long = dataclasses.replace(outcome.verdicts[0], metric="grad_norm_parts_long_name")
    outcome = dataclasses.replace(outcome, verdicts=(*outcome.verdicts, long))
    text = render_outcome(outcome)
    rows = text.split("verdicts:\n", 1)[1].splitlines()[: len(outcome.verdicts)]
    starts = {len(row) - len(row[2:].split(None, 1)[1]) for row in rows}
    assert len(starts) == 1, rows
