"""The matrix per dimension: grouping pairs by what their test adds over the control."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from report_examples import all_examples, failing_pair, passing_pair

from convergence.report.data.records import pair_record
from convergence.report.sections.dimensions import (
    SAME,
    dimension_of,
    group_by_dimension,
    html_section,
    markdown_lines,
    render_dimensions,
)
from convergence.spec.layout import ParallelLayout


def _records() -> list[dict[str, Any]]:
    return [pair_record(o, include_curves=False) for o in all_examples()]


def _with(
    record: dict[str, Any], name: str, status: str, dloss: Any, **test_degrees: int
) -> dict[str, Any]:
    out = copy.deepcopy(record)
    out["name"], out["status"] = name, status
    out["max_abs_delta"]["loss"] = dloss
    out["test"]["degrees"].update(test_degrees)
    return out


def test_dimension_names_what_the_test_adds() -> None:
    by_name = {r["name"]: dimension_of(r) for r in _records()}
    assert by_name == {
        "fsdp2-tp2": "+tp2",
        "fsdp2-pp2": "+pp2",
        "fsdp2-cp2": "+cp2",
        "fsdp2-bf16": "+param:bf16 +no-determ",
    }
    base = pair_record(passing_pair(), include_curves=False)
    assert dimension_of(_with(base, "x", "passed", 0.0, tp=2, pp=2, cp=2)) == "+tp2+cp2+pp2"
    assert dimension_of(_with(base, "x", "passed", 0.0, tp=1, cp=4)) == "+cp4"
    assert dimension_of(_with(base, "x", "passed", 0.0, tp=1, dp_shard=4)) == "shard2→4"
    ddp_vs_fsdp = _with(base, "x", "passed", 0.0, tp=1)
    ddp_vs_fsdp["control"]["degrees"].update(dp_replicate=2, dp_shard=1)
    assert dimension_of(ddp_vs_fsdp) == "-rep2+shard2"
    same = _with(base, "x", "passed", 0.0, tp=1)
    assert dimension_of(same) == SAME
    same["techniques_changed"] = {
        "activation_checkpoint": "full",
        "hook": "my_project.parallel:apply_my_tp",
    }
    assert dimension_of(same) == "+ac:full +hook:apply_my_tp"


def test_groups_count_verdicts_and_keep_the_worst_delta() -> None:
    base = pair_record(passing_pair(), include_curves=False)
    failing = pair_record(failing_pair(), include_curves=False)
    records = [
        base,  # +tp2, |Δloss| 2.5e-07, passed
        _with(base, "tp2-again", "failed", 3e-3),
        failing,  # +pp2
        _with(base, "tp2-broken", "error", None),
        _with(base, "tp2-nan", "failed", "NaN", tp=2, pp=2),
        _with(failing, "pp2-skipped", "skipped", None),
    ]
    rows = {r.dimension: r for r in group_by_dimension(records)}
    assert list(rows) == ["+tp2", "+pp2", "+tp2+pp2"]  # order of first appearance
    tp = rows["+tp2"]
    assert tp.pairs == ["fsdp2-tp2", "tp2-again", "tp2-broken"]
    assert tp.counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 0}
    assert tp.worst_dloss == 3e-3 and tp.worst_pair == "tp2-again"
    pp = rows["+pp2"]
    assert pp.counts["failed"] == 1 and pp.counts["skipped"] == 1
    assert pp.worst_pair == "fsdp2-pp2" and pp.worst_dloss is not None
    nan = rows["+tp2+pp2"]
    assert nan.worst_dloss is not None and nan.worst_dloss != nan.worst_dloss  # NaN is worst


def test_terminal_block_fits_the_width() -> None:
    records = _records()
    long = _with(records[0], "p" * 90, "passed", 1e-7, tp=2, cp=8, pp=4)
    long["techniques_changed"] = {
        "activation_checkpoint": "selective",
        "compile": True,
        "hook": "pkg.mod:" + "h" * 60,
    }
    for width in (120, 80):
        lines = render_dimensions([*records, long], width=width).splitlines()
        assert max(len(line) for line in lines) <= width
    lines = render_dimensions(records).splitlines()
    assert lines[0].split()[:6] == ["dimension", "pairs", "pass", "fail", "error", "skip"]
    pp = next(line for line in lines if line.startswith("+pp2"))
    assert pp.split()[1:5] == ["1", "0", "1", "0"] and pp.rstrip().endswith("fsdp2-pp2")


def test_markdown_and_html_sections(tmp_path: Path) -> None:
    from convergence.report.formats.write import write_reports

    records = _records()
    md = markdown_lines(records)
    assert md[1] == "### By dimension"
    assert any(line.startswith("| +pp2 | 1 | 0 | 1 | 0 | 0 |") for line in md)
    # One pair gets its row too (what the test changes over its control); none, nothing.
    assert (
        markdown_lines(records[:1])[1] == "### By dimension"
        and len(markdown_lines(records[:1])) == 6
    )
    assert "<h3>By dimension</h3>" in html_section(records[:1])
    assert markdown_lines([]) == [] and html_section([]) == ""
    html = html_section(records)
    assert "<h3>By dimension</h3>" in html and "+param:bf16 +no-determ" in html
    # Wired into the report files.
    outcomes = all_examples()
    outcomes[0] = dataclasses.replace(
        outcomes[0],
        pair=dataclasses.replace(
            outcomes[0].pair,
            test=dataclasses.replace(
                outcomes[0].pair.test, layout=ParallelLayout(dp_shard=2, tp=2, pp=2)
            ),
        ),
    )
    write_reports(outcomes, tmp_path, environment={"python": "3"})
    assert "| +tp2+pp2 | 1 | 1 | 0 | 0 | 0 |" in (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "<h3>By dimension</h3>" in html
    # The heatmap is one pair x metric grid, titled as such (not a heatmap "per dimension").
    assert "<h3>Every pair × gating metric</h3>" in html


def test_heatmap_rows_are_named_as_the_dimension_table_names_them() -> None:
    from convergence.report.formats.plots import dimension

    outcome = all_examples()[0]
    tp = dataclasses.replace(
        outcome,
        pair=dataclasses.replace(
            outcome.pair,
            test=(dataclasses.replace(outcome.pair.test, layout=ParallelLayout(dp_shard=2, tp=2))),
        ),
    )
    assert dimension(tp) == dimension_of(pair_record(tp, include_curves=False)) == "+tp2"


def test_terminal_summary_of_one_pair_has_its_dimension_and_says_1_pair() -> None:
    from convergence.report.formats.terminal import render_summary

    text = render_summary(all_examples()[:1])
    assert "1 pair:" in text and "1 pairs" not in text
    assert "by dimension (what each test adds over its control):" in text


def _resume_pair():  # type: ignore[no-untyped-def]
    """The passing FSDP2+TP2 example as a resume pair: FSDP2 for 4 steps, then FSDP2+TP2."""
    from convergence.spec.resume import Resume

    outcome = passing_pair()
    test = outcome.pair.test
    resumed = dataclasses.replace(
        test,
        layout=outcome.pair.control.layout,
        resume=Resume(at_step=4, layout=test.layout, techniques=test.techniques),
    )
    pair = dataclasses.replace(outcome.pair, test=resumed)
    assert outcome.test is not None
    return dataclasses.replace(
        outcome, pair=pair, test=dataclasses.replace(outcome.test, job=resumed)
    )


def test_a_resume_pair_is_shown_as_the_layout_it_resumed_on() -> None:
    """Issue 52: a resume pair FSDP2 -> FSDP2+TP2 was shown in the matrix, report.md and JUnit
    as its pre-resume layout (fsdp2) under "same layout"."""
    import jsonschema

    from convergence.report.data.schema import REPORT_JSON_SCHEMA, build_report
    from convergence.report.formats.junit import junit_properties
    from convergence.report.formats.markdown import render_markdown
    from convergence.report.formats.plots import dimension
    from convergence.report.formats.terminal import render_matrix

    outcome = _resume_pair()
    record = pair_record(outcome, include_curves=False)
    assert dimension_of(record) == "resume@4 +tp2" == dimension(outcome)
    assert SAME not in render_dimensions([record])
    matrix = render_matrix([outcome])
    header, _, row = matrix.splitlines()[:3]
    tp_at = header.index(" tp") + 1
    assert row[tp_at : tp_at + 2].strip() == "2", matrix  # the resumed layout's degree
    assert "resume@4" in row, matrix
    report = build_report([outcome], environment={}, started_at=None, wall_s=1.0)
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    markdown = render_markdown(report)
    assert "fsdp2→fsdp2-tp2@4" in markdown and "same layout" not in markdown, markdown
    props = dict(junit_properties(outcome))
    assert props["convergence.test_layout"].startswith("fsdp2→fsdp2-tp2@4"), props
