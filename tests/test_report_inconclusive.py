"""An inconclusive pair in every report: the terminal matrix, report.json (valid against its
schema), report.md, report.html, JUnit properties, a saved outcome read back -- never shown or
counted as a pass.

The outcome is the margin comparison's real verdict on synthetic runs (numpy, fixed seeds: no
training, no rounding draw): two replicate pairs and a margin of 0.01 nats, far below the
smallest difference two pairs can exclude.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import report_examples as rx

from convergence.report import (
    REPORT_JSON_SCHEMA,
    junit_properties,
    outcome_from_json,
    outcome_to_json,
    render_matrix,
    write_reports,
)
from convergence.run.outcome import PairOutcome
from convergence.run.settle import status_of
from convergence.spec.layout import Techniques
from convergence.spec.pair import ComparisonRule
from convergence.stats.registry import compare_all


def inconclusive_pair() -> PairOutcome:
    control = rx._job("bf16", dp_shard=2, techniques=Techniques(param_dtype="bfloat16"))
    test = rx._job(
        "float8", dp_shard=2, techniques=Techniques(param_dtype="bfloat16", float8="rowwise")
    )
    rules = (
        ComparisonRule(metric="loss", method="margin", margin=0.01),
        ComparisonRule(metric="tokens_per_s", method="regression", gate=False),
    )
    pair = dataclasses.replace(
        rx._pair("float8", control, test, regime="margin"), rules=rules, replicates=2
    )
    # K = 2 controls, then the other test (regimes/margin.py control_jobs' order).
    controls = [rx.run_metrics(1), rx.run_metrics(2), rx.run_metrics(3)]
    test_metrics = rx.run_metrics(4)
    verdicts = tuple(compare_all(pair.rules, controls, test_metrics))
    return PairOutcome(
        pair=pair,
        status=status_of(verdicts),
        control=rx._side(control, controls[0], replicates=tuple(controls[:2])),
        test=rx._side(test, test_metrics),
        verdicts=verdicts,
        wall_s=3.0,
    )


def test_the_verdict_is_inconclusive_with_the_number_to_run() -> None:
    outcome = inconclusive_pair()
    assert outcome.status == "inconclusive" and not outcome.passed
    loss = outcome.verdict("loss")
    assert loss is not None and loss.inconclusive and not loss.passed
    assert "more replicates (replicates = " in loss.message


def test_every_report_says_inconclusive_and_none_counts_a_pass(tmp_path: Path) -> None:
    outcome = inconclusive_pair()
    matrix = render_matrix([outcome], width=200)
    assert "INCONCLUSIVE loss" in matrix
    assert "0 passed" in matrix and "1 inconclusive" in matrix

    paths = write_reports([outcome], tmp_path, environment={"host": "test"})
    report = json.loads(paths["json"].read_text())
    jsonschema.Draft202012Validator(REPORT_JSON_SCHEMA).validate(report)
    assert report["summary"]["inconclusive"] == 1 and report["summary"]["passed"] == 0
    (pair,) = report["pairs"]
    assert pair["status"] == "inconclusive"
    loss = next(v for v in pair["verdicts"] if v["metric"] == "loss")
    assert loss["inconclusive"] and not loss["passed"]
    assert loss["evidence"]["num_pairs"] == 2
    assert loss["evidence"]["replicates_needed"] > 2
    assert loss["evidence"]["excludable"] > loss["evidence"]["margin"]

    markdown = paths["markdown"].read_text()
    headline = markdown.splitlines()[0]
    assert "1 inconclusive" in headline and "✅" not in headline
    assert "**inconclusive**" in markdown  # the verdict's line under Failures
    html = paths["html"].read_text()
    assert "1 inconclusive" in html and "INCONCLUSIVE" in html

    props = dict(junit_properties(outcome))
    assert props["convergence.status"] == "inconclusive"
    assert props["convergence.loss.verdict"].startswith("inconclusive (margin")
    assert "convergence.loss.replicates_needed" in props


def test_a_saved_outcome_reads_back_inconclusive() -> None:
    outcome = inconclusive_pair()
    again = outcome_from_json(json.loads(json.dumps(outcome_to_json(outcome))))
    assert again.status == "inconclusive"
    loss = again.verdict("loss")
    assert loss is not None and loss.inconclusive and not loss.passed
