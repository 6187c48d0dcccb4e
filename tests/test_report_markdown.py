"""report.md details and the GitHub step summary (append, 1 MiB limit)."""

from __future__ import annotations

from pathlib import Path

from report_examples import passing_pair, seed_pair

from convergence.report import build_report, render_markdown, write_step_summary
from convergence.report.formats.markdown import STEP_SUMMARY_LIMIT
from convergence.report.markup import md_cell as cell


def _md(outcomes: list) -> str:
    return render_markdown(
        build_report(outcomes, environment={}, started_at=None, wall_s=None, include_curves=False)
    )


def test_all_passing_has_no_failure_section() -> None:
    md = _md([passing_pair(), seed_pair()])
    assert md.startswith("## ✅ Convergence: 2 passed, 0 failed, 0 errors (2 pairs)")
    assert "## Failures" not in md
    assert md.split("## Resources")[0].count("\n| fsdp2-") == 2  # the matrix rows


def test_cells_are_escaped() -> None:
    assert cell("a|b\nc") == "a\\|b c"


def test_step_summary_unset_does_nothing(tmp_path: Path) -> None:
    assert write_step_summary("# hi\n", env={}) is None
    assert list(tmp_path.iterdir()) == []


def test_step_summary_appends(tmp_path: Path) -> None:
    target = tmp_path / "summary.md"
    target.write_text("earlier step output\n", encoding="utf-8")
    md = _md([passing_pair()])
    assert write_step_summary(md, env={"GITHUB_STEP_SUMMARY": str(target)}) == target
    text = target.read_text(encoding="utf-8")
    assert text == "earlier step output\n" + md


def test_step_summary_is_truncated_below_the_limit(tmp_path: Path) -> None:
    target = tmp_path / "summary.md"
    target.write_text("x" * 1000 + "\n", encoding="utf-8")
    # Multi-byte characters: the cut must not split one.
    big = "".join(f"| row {i} | Δ ✅ |\n" for i in range(120_000))
    assert len(big.encode("utf-8")) > STEP_SUMMARY_LIMIT
    write_step_summary(big, env={"GITHUB_STEP_SUMMARY": str(target)})
    data = target.read_bytes()
    assert len(data) < STEP_SUMMARY_LIMIT
    text = data.decode("utf-8")  # valid UTF-8
    assert "truncated" in text.splitlines()[-1]
    body = text.splitlines()[1:-2]
    assert body[-1].endswith("|")  # cut at a line end


def test_write_reports_appends_the_summary_only_when_asked(tmp_path: Path) -> None:
    from convergence.report import write_reports

    target = tmp_path / "summary.md"
    env = {"GITHUB_STEP_SUMMARY": str(target)}
    paths = write_reports([passing_pair()], tmp_path / "a", environment={})
    assert "step_summary" not in paths and not target.exists()
    paths = write_reports([passing_pair()], tmp_path / "b", environment={}, step_summary_env=env)
    assert paths["step_summary"] == target
    assert target.read_text(encoding="utf-8") == paths["markdown"].read_text(encoding="utf-8")


def test_step_summary_already_full_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "summary.md"
    target.write_bytes(b"x" * STEP_SUMMARY_LIMIT)
    write_step_summary("## more\n", env={"GITHUB_STEP_SUMMARY": str(target)})
    assert target.stat().st_size == STEP_SUMMARY_LIMIT


def test_hostile_names_and_messages_are_escaped() -> None:
    """report.md is rendered by GitHub (step summaries): names come from experiment files and
    messages from job output, so neither may inject HTML."""
    import dataclasses

    from report_examples import errored_pair, failing_pair

    hostile = "<img src=x onerror=alert(1)>"
    failing = failing_pair()
    pair = dataclasses.replace(
        failing.pair, test=dataclasses.replace(failing.pair.test, name=hostile)
    )
    failing = dataclasses.replace(
        failing,
        pair=pair,
        localisation={
            "module": "<script>alert(2)</script>",
            "parameter": "weight",
            "max_abs_diff": 1e-3,
        },
    )
    errored = dataclasses.replace(errored_pair(), error="boom <script>alert(3)</script>")
    md = _md([failing, errored])
    # Fenced code blocks (the error text) are shown literally by every renderer: only the rest
    # must be free of raw HTML.
    outside_fences = "".join(md.split("```")[0::2])
    assert "<img" not in outside_fences and "<script" not in outside_fences, md
    assert "```text\nboom <script>alert(3)</script>\n```" in md
    assert "&lt;img src=x onerror=alert(1)&gt;" in md  # shown, as text


def test_localisation_is_a_sentence_not_a_key_value_dump() -> None:
    import dataclasses

    from report_examples import failing_pair

    failing = dataclasses.replace(
        failing_pair(),
        localisation={
            "module": "layers.1.attention",
            "parameter": "layers.1.attention.wq.weight",
            "max_abs_diff": 1e-3,
            "modules_differing": 3,
            "modules_compared": 20,
            "step": 1,
            "loss_control": 5.5,
            "loss_test": 5.6,
        },
    )
    md = _md([failing])
    line = next(ln for ln in md.splitlines() if ln.startswith("Localisation"))
    assert "first differing module `layers.1.attention`" in line, line
    assert "3 of 20 modules differ" in line and "=" not in line, line


def test_one_tokens_per_s_change_per_pair() -> None:
    """Issue 36: report.md gave a pair two tokens/s changes (the Resources table's median
    after step 1, the regression verdict's after the warm-up steps); now one. A test whose
    first steps are slow (warm-up) shows the difference."""
    import numpy as np

    from convergence.metrics.curve import Curve
    from convergence.report.data.records import resources
    from convergence.spec.pair import ComparisonRule
    from convergence.stats.regression import Regression

    outcome = passing_pair()
    assert outcome.test is not None and outcome.control is not None
    tps = outcome.test.metrics["tokens_per_s"]
    warm = np.where(np.arange(len(tps.values)) < 3, 100.0, tps.values)
    outcome.test.metrics["tokens_per_s"] = Curve("tokens_per_s", tps.steps, warm)
    rule = ComparisonRule(metric="tokens_per_s", method="regression", gate=False)
    verdict = Regression().compare(
        rule, [outcome.control.metrics["tokens_per_s"]], outcome.test.metrics["tokens_per_s"]
    )
    ratio = resources(outcome)["tokens_per_s"]["ratio"]
    assert ratio is not None
    assert abs((ratio - 1.0) - verdict.details["relative_change"]) < 1e-12


def test_a_passing_anchored_verdict_is_shown_in_the_terminal_and_report_md() -> None:
    """A pass from the control's states is evidence of its own (issue 47): the terminal
    summary and report.md list it, not only report.json."""
    import dataclasses

    from convergence.report.formats.terminal import render_summary
    from convergence.stats.types import MetricVerdict

    message = "anchored: 9 anchors, every one-step check within its tolerance (0.2x at worst)"
    anchored = MetricVerdict(
        metric="anchored",
        method="paired",
        passed=True,
        gate=True,
        steps_compared=9,
        message=message,
    )
    outcome = passing_pair()
    outcome = dataclasses.replace(outcome, verdicts=(*outcome.verdicts, anchored))
    terminal = render_summary([outcome])
    assert f"{outcome.pair.name}: anchored PASS -- {message}" in terminal
    md = _md([outcome])
    assert "## Checks judged from the control's states" in md and message in md
    assert "## Checks" not in _md([passing_pair()])  # nothing to show without one
