"""Issue 24, trap 3: a gating metric that the trainer does not log under our name (an in-house
trainer logging its grad norm as ``gnorm`` with no ``keys.grad_norm`` map) never silently stops
gating. By default the pair is judged on what it has and every report says, in amber, which
gating metric was not compared and how to fix it; an experiment that names the metric in
``compare`` gets an error.

One real pytest session (subprocess): the command-backend fixture trainer, DDP 1 vs 2 ranks,
4 steps; the control is shared by both pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convergence.report.fmt import verdict_state
from experiments import command_pair

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "command_trainer" / "train.py"


def test_verdict_state_never_reads_pass_for_not_compared() -> None:
    assert verdict_state(True, False, 0, not_compared=True) == "not compared"
    assert verdict_state(False, True, 0, not_compared=True) == "not compared"


def test_unlogged_gating_metric_is_shown_or_an_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    command_pair(
        pytester.path / "experiments",
        file="mine.toml",
        command=[str(SCRIPT), "--steps", "{steps}", "--seed", "{seed}", "--out", "{dump_dir}"],
        keys={"loss": "train_loss"},  # the grad norm is logged as gnorm, not mapped
        compare=None,
        steps=4,
        train_config="trainer.toml",
        control={"name": "ddp1", "parallelism": {"dp_replicate": 1}, "local_batch_size": 2},
        tests=[
            {"name": "ddp2", "parallelism": {"dp_replicate": 2}, "local_batch_size": 1},
            {
                "name": "ddp2-asked",
                "parallelism": {"dp_replicate": 2},
                "local_batch_size": 1,
                "compare": {"grad_norm": "paired"},
            },
        ],
    )
    (pytester.path / "experiments" / "trainer.toml").write_text("lr = 0.05\n")
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-m",
        "convergence",
        "--convergence-report",
        "report",
        "--junitxml",
        "junit.xml",
        "-rA",
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, errors=0, failed=1)  # the error is the pair's (runtest)
    # The default rule: passed on the loss, and the terminal says what was not compared.
    assert "PASSED experiments/mine.toml::ddp2" in out, out
    assert "Not compared (gating metrics a run did not log):" in out, out
    assert "ddp2: grad_norm not compared -- grad_norm: missing in the test run" in out, out
    assert 'keys.grad_norm = "..."' in out, out
    # Named in compare: an error naming the metric and the fix.
    assert "ddp2-asked" in out and "asked for in compare.grad_norm" in out, out
    assert "a metric the experiment compares was not logged:" in out, out
    report = pytester.path / "report"
    data = json.loads((report / "report.json").read_text())
    pairs = {p["name"]: p for p in data["pairs"]}
    assert pairs["ddp2"]["status"] == "passed" and pairs["ddp2-asked"]["status"] == "error"
    grad = next(v for v in pairs["ddp2"]["verdicts"] if v["metric"] == "grad_norm")
    assert grad["not_compared"] and not grad["gate"]
    md = (report / "report.md").read_text()
    assert "Not compared (gating metrics a run did not log)" in md
    assert "ddp2: **grad_norm** (paired): not compared:" in md, md
    html = (report / "report.html").read_text()
    assert '<span class="warn">not compared</span>' in html
    assert '<span class="ok">pass</span>' not in html.split("grad_norm", 1)[1][:200]
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="convergence.grad_norm.verdict" value="not compared (paired)"' in junit


def test_every_format_shows_not_compared_without_a_run(tmp_path: Path) -> None:
    """The same, from a judged outcome (no jobs): markdown, HTML, JSON, JUnit, terminal and
    the heatmap cell all say "not compared" for a default gating metric the test lacks."""
    import dataclasses
    import math

    from report_examples import judge, passing_pair

    from convergence.report import build_report, junit_properties, render_markdown
    from convergence.report.formats.html import render_html
    from convergence.report.formats.plots import _cell
    from convergence.report.formats.terminal import render_summary

    base = passing_pair()
    assert base.control is not None and base.test is not None
    metrics = {k: v for k, v in base.test.metrics.items() if k != "grad_norm"}
    verdicts = judge(base.pair, [base.control.metrics], metrics)
    outcome = dataclasses.replace(
        base,
        test=dataclasses.replace(base.test, metrics=metrics),
        verdicts=verdicts,
        status="passed",
    )
    grad = outcome.verdict("grad_norm")
    assert grad is not None and grad.not_compared and not grad.gate
    report = build_report(
        [outcome], environment={}, started_at=None, wall_s=None, include_curves=False
    )
    record = next(v for v in report["pairs"][0]["verdicts"] if v["metric"] == "grad_norm")
    assert record["not_compared"]
    assert "**grad_norm** (paired): not compared:" in render_markdown(report)
    assert '<span class="warn">not compared</span>' in render_html(report, {})
    assert ("convergence.grad_norm.verdict", "not compared (paired)") in junit_properties(outcome)
    assert "grad_norm not compared -- " in render_summary([outcome])
    value, label = _cell(outcome, "grad_norm")
    assert math.isnan(value) and label == "not\ncompared"
