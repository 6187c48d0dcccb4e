"""Reports never break on odd outcomes: no curves, NaN curves, no sides at all."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from report_examples import DIVERGES_AT, errored_pair, failing_pair, seed_pair

from convergence.metrics.curve import Curve
from convergence.report import REPORT_JSON_SCHEMA, divergence_table, render_matrix, write_reports
from convergence.run.outcome import PairOutcome
from convergence.stats.seed_band import seed_band


def _odd_outcomes() -> list[PairOutcome]:
    fail = failing_pair()
    assert fail.test is not None
    loss = fail.test.metrics["loss"]
    values = loss.values.copy()
    values[30:] = math.nan  # the test run went NaN
    nan_test = dataclasses.replace(fail.test, metrics={"loss": Curve("loss", loss.steps, values)})
    nan_pair = dataclasses.replace(
        fail, pair=dataclasses.replace(fail.pair, pair_id="odd.toml::nan"), test=nan_test
    )
    no_curves = dataclasses.replace(
        seed_pair(),
        pair=dataclasses.replace(seed_pair().pair, pair_id="odd.toml::empty"),
        control=dataclasses.replace(seed_pair().control, metrics={}, replicates=()),
        test=None,
        verdicts=(),
    )
    bare = dataclasses.replace(
        errored_pair(),
        control=None,
        test=None,
        pair=dataclasses.replace(errored_pair().pair, pair_id="odd.toml::bare"),
    )
    return [nan_pair, no_curves, bare]


def test_odd_outcomes_still_make_a_full_report(tmp_path: Path) -> None:
    outcomes = _odd_outcomes()
    paths = write_reports(outcomes, tmp_path, environment={})
    text = paths["json"].read_text(encoding="utf-8")
    report = json.loads(text)  # strict JSON: non-finite numbers are strings
    jsonschema.Draft202012Validator(REPORT_JSON_SCHEMA).validate(report)
    by_name = {p["name"]: p for p in report["pairs"]}
    assert by_name["nan"]["max_abs_delta"]["loss"] == "NaN"
    assert by_name["nan"]["max_abs_delta"]["grad_norm"] is None
    assert all(p["plot_error"] is None for p in report["pairs"])
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
    assert "nan" in render_matrix(outcomes)
    html = paths["html"].read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") == 4


def test_divergence_table_edges() -> None:
    rows = divergence_table(failing_pair(), "loss", 2)
    assert [r[0] for r in rows] == [
        DIVERGES_AT - 2,
        DIVERGES_AT - 1,
        DIVERGES_AT,
        DIVERGES_AT + 1,
        DIVERGES_AT + 2,
    ]
    step, control, test, delta = rows[2]
    assert delta == test - control and abs(delta - 2e-3) < 1e-12
    assert divergence_table(errored_pair()) == []  # no verdict to centre on
    assert divergence_table(failing_pair(), "val_loss") == []
    # Seed regime: the reference is the seed method's band centre (smoothed mean).
    seed = seed_pair()
    rows = divergence_table(seed, "loss", 0)
    assert seed.control is not None and len(rows) == 1
    step = rows[0][0]
    band = seed_band([r["loss"] for r in seed.control.replicates])
    assert rows[0][1] == pytest.approx(band.center[step - 1], rel=1e-14)  # via the verdict
    mean = np.mean([r["loss"].values[step - 1] for r in seed.control.replicates])
    assert rows[0][1] != mean
