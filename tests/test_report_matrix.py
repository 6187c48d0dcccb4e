"""The terminal matrix and the JUnit properties."""

from __future__ import annotations

import dataclasses

from report_examples import DIVERGES_AT, all_examples, errored_pair, failing_pair, passing_pair

from convergence.report import junit_properties, matrix_rows, render_matrix


def test_rows_hold_the_columns() -> None:
    rows = {r["pair"]: r for r in matrix_rows(all_examples())}
    tp = rows["fsdp2-tp2"]
    assert (tp["rep"], tp["shard"], tp["tp"], tp["cp"], tp["pp"]) == ("-", "2", "2", "-", "-")
    assert tp["verdict"] == "PASS" and tp["tps"] == "0.93x" and tp["cache"] == "ctrl cached"
    assert tp["dloss"] == "2.5e-07" and tp["techniques"] == "-"
    pp = rows["fsdp2-pp2"]
    assert pp["verdict"] == "FAIL loss+1" and pp["pp"] == "2" and pp["dloss"] == "0.048"
    assert pp["cache"] == "-" and pp["wall"] == "16.0s"
    cp = rows["fsdp2-cp2"]
    assert cp["verdict"] == "ERROR" and cp["dloss"] == "-" and cp["tps"] == "-"
    assert rows["fsdp2-bf16"]["techniques"] == "param:bf16,no-determ"


def test_render_is_aligned_and_fits_120_columns() -> None:
    text = render_matrix(all_examples())
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines)
    header = lines[0]
    for title in (
        "pair",
        "rep",
        "shard",
        "tp",
        "cp",
        "pp",
        "techniques",
        "verdict",
        "|Δloss|",
        "|Δgnorm|",
        "tok/s",
        "mem",
        "wall",
        "cache",
    ):
        assert title in header
    # Right-aligned numbers end in the same column in every row.
    end = header.index("|Δloss|") + len("|Δloss|")
    for line in lines[2:6]:
        assert line[end - 1] != " "
    assert lines[-1] == "4 pairs: 2 passed, 1 failed, 1 error"
    assert (
        render_matrix([passing_pair()]).splitlines()[-1] == "1 pair: 1 passed, 0 failed, 0 errors"
    )


def test_long_names_are_cut_to_the_width() -> None:
    o = passing_pair()
    long = dataclasses.replace(
        o,
        pair=dataclasses.replace(
            o.pair, pair_id="x.toml::" + "fsdp2-tp2-with-a-very-long-descriptive-name" * 3
        ),
    )
    for width in (120, 100):
        lines = render_matrix([long, failing_pair()], width=width).splitlines()
        assert max(len(line) for line in lines) <= width
        assert "…" in lines[2]


def test_the_failing_metric_is_named_and_memory_without_a_device_reading_is_a_dash() -> None:
    failed = dataclasses.replace(
        failing_pair(),
        verdicts=tuple(v for v in failing_pair().verdicts if v.metric != "loss"),
    )
    row = matrix_rows([failed])[0]
    assert row["verdict"].startswith("FAIL grad_norm"), row
    from convergence.report.formats.terminal import _memory_ratio

    assert matrix_rows([passing_pair()])[0]["mem"] == "0.59x"  # a device that reports memory
    assert _memory_ratio({"control": -9.5e-07, "test": -9.5e-07, "ratio": 1.0}) == "-"  # CPU
    assert _memory_ratio({"control": 0.0, "test": 0.0, "ratio": None}) == "-"


def test_stopped_early_is_marked() -> None:
    o = dataclasses.replace(passing_pair(), stopped_early_at=25)
    text = render_matrix([o])
    assert "PASS*" in text and "stopped early" in text


def test_junit_properties() -> None:
    props = dict(junit_properties(failing_pair()))
    assert all(k.startswith("convergence.") and isinstance(v, str) for k, v in props.items())
    assert props["convergence.status"] == "failed"
    assert props["convergence.control_layout"] == "fsdp2"
    assert props["convergence.test_layout"] == "fsdp2-pp2"
    assert props["convergence.first_divergent_step"] == str(DIVERGES_AT)
    assert props["convergence.loss.verdict"] == "fail (paired)"
    assert props["convergence.loss.max_deviation"] == "0.048 at step 40"
    assert props["convergence.tokens_per_s.verdict"] == "pass (regression, not gating)"
    assert props["convergence.control_cached"] == "false"
    assert props["convergence.wall_s"] == "27.10"

    err = dict(junit_properties(errored_pair()))
    assert err["convergence.status"] == "error"
    assert err["convergence.error"].startswith("test job 'fsdp2-cp2'")
    assert err["convergence.control_cached"] == "true"
    assert "convergence.test_wall_s" not in err


def test_a_fingerprint_failure_counts_steps_not_a_deviation() -> None:
    from convergence.report.formats.failure_text import _verdict_line
    from convergence.stats.types import MetricVerdict

    line = _verdict_line(
        MetricVerdict(
            metric="data_fingerprint",
            method="exact",
            passed=False,
            gate=True,
            steps_compared=6,
            first_divergent_step=1,
            tolerance="equal",
            max_deviation=6.0,
        )
    )
    assert "6 steps differ" in line and "max |Δ|" not in line


def test_a_passing_anchored_pair_says_so_in_the_matrix_and_report_md() -> None:
    """Issue 52: a passing anchored pair showed nothing of its anchored check in the terminal
    or report.md (only report.json and the html card)."""
    from convergence.metrics.curve import Curve
    from convergence.report.data.schema import build_report
    from convergence.report.formats.markdown import render_markdown
    from convergence.stats.anchored import anchored_verdict

    outcome = passing_pair()
    assert outcome.control is not None
    control = outcome.control.metrics
    at = [11, 21, 31]  # one step after each anchor of anchor_every = 10
    anchored = {
        m: Curve(m, control[m].steps[[s - 1 for s in at]], control[m].values[[s - 1 for s in at]])
        for m in ("loss", "grad_norm")
    }
    verdict = anchored_verdict(outcome.pair.rules, [control], anchored, every=10)
    assert verdict.passed and verdict.metric == "anchored", verdict
    pair = dataclasses.replace(outcome.pair, check_keys=(("anchor_every", 10),))
    outcome = dataclasses.replace(outcome, pair=pair, verdicts=(*outcome.verdicts, verdict))
    (row,) = matrix_rows([outcome])
    assert row["verdict"] == "PASS +anchored", row
    report = build_report([outcome], environment={}, started_at=None, wall_s=1.0)
    assert "PASS +anchored" in render_markdown(report)
    assert "PASS +anchored" in render_matrix([outcome])
