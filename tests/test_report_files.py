"""write_reports end to end: report.json (schema), report.md, report.html, PNG plots."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import jsonschema
import matplotlib.image
import numpy as np
import pytest
from report_examples import DIVERGES_AT, all_examples, failing_pair, twin_pair

from convergence.report import (
    REPORT_JSON_SCHEMA,
    REPORT_SCHEMA_VERSION,
    build_report,
    write_reports,
)
from convergence.report.data.serialize import outcome_from_json, outcome_to_json
from convergence.report.formats.plots import plot_pair
from convergence.run.outcome import PairOutcome

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("report_files")

ENV = {"launcher": "local", "devices": 2}


@pytest.fixture(scope="module")
def outcomes() -> list[PairOutcome]:
    return all_examples()


@pytest.fixture(scope="module")
def written(
    outcomes: list[PairOutcome], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("report")
    return write_reports(outcomes, out, environment=ENV, started_at=1_700_000_000.0, wall_s=42.0)


@pytest.fixture(scope="module")
def report(written: dict[str, Path]) -> dict:
    return json.loads(written["json"].read_text(encoding="utf-8"))


def _validate(doc: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(REPORT_JSON_SCHEMA)
    jsonschema.Draft202012Validator(REPORT_JSON_SCHEMA).validate(doc)


def test_writes_every_file_atomically(written: dict[str, Path]) -> None:
    out = written["json"].parent
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", "plots"}
    plots = sorted(p.name for p in (out / "plots").iterdir())
    assert plots == [
        "converging.toml_fsdp2-bf16.png",
        "converging.toml_fsdp2-cp2.png",
        "converging.toml_fsdp2-pp2.png",
        "converging.toml_fsdp2-tp2.png",
        "heatmap.png",
    ]  # no temp files left behind
    assert written["html"].stat().st_mode & 0o044  # readable by others (CI artifacts)


def test_report_json_is_strict_and_valid(written: dict[str, Path], report: dict) -> None:
    text = written["json"].read_text(encoding="utf-8")
    assert "NaN" not in text.replace('"NaN"', "")
    _validate(report)
    assert report["schema_version"] == REPORT_SCHEMA_VERSION
    assert report["summary"] == {
        "pairs": 4,
        "passed": 2,
        "failed": 1,
        "inconclusive": 0,
        "errors": 1,
        "skipped": 0,
        "cached_runs": 3,
        "fresh_runs": 4,
        "stopped_early": 0,
    }
    env = report["environment"]
    assert env["launcher"] == "local" and env["python"] and env["hostname"]
    assert report["started_at"].startswith("2023-11-14")


def test_schema_rejects_a_broken_report(report: dict) -> None:
    broken = json.loads(json.dumps(report))
    del broken["pairs"][0]["verdicts"][0]["first_divergent_step"]
    with pytest.raises(jsonschema.ValidationError, match="first_divergent_step"):
        _validate(broken)
    broken = json.loads(json.dumps(report))
    broken["pairs"][1]["status"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


def test_pair_records(report: dict) -> None:
    by_name = {p["name"]: p for p in report["pairs"]}
    fail = by_name["fsdp2-pp2"]
    assert fail["status"] == "failed" and fail["first_divergent_step"] == DIVERGES_AT
    assert fail["test"]["degrees"] == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 1,
        "tp": 1,
        "ep": 1,
    }
    assert fail["test"]["pp_schedule"] == "1F1B"
    loss = next(v for v in fail["verdicts"] if v["metric"] == "loss")
    assert loss["passed"] is False and loss["first_divergent_step"] == DIVERGES_AT
    assert fail["max_abs_delta"]["loss"] == pytest.approx(0.048)
    assert fail["resources"]["tokens_per_s"]["ratio"] == pytest.approx(1.1, rel=0.02)
    assert fail["resources"]["peak_mem_mib"]["ratio"] == pytest.approx(700 / 512)
    rows = fail["divergence"]["loss"]
    assert [r["step"] for r in rows] == list(range(DIVERGES_AT - 3, DIVERGES_AT + 4))
    assert rows[3]["delta"] == pytest.approx(2e-3) and rows[2]["delta"] == 0
    assert fail["localisation"]["module"] == "layers.1.attention.wo"
    assert fail["plots"] == {"pair": "plots/converging.toml_fsdp2-pp2.png"}
    assert report["plots"] == {"heatmap": "plots/heatmap.png"}

    ok = by_name["fsdp2-tp2"]
    assert ok["cached"] == {"control": True, "test": False}
    assert ok["control"]["status"] == "cached" and ok["max_abs_delta"]["loss"] < 1e-6
    # Curves in full, float64 exactly.
    assert len(ok["curves"]["test"]["loss"]["values"]) == 40

    err = by_name["fsdp2-cp2"]
    assert err["status"] == "error" and err["verdicts"] == []
    assert err["test"]["ran"] is False and err["test"]["degrees"]["cp"] == 2
    assert "rank 1" in err["error"]

    seed = by_name["fsdp2-bf16"]
    assert seed["regime"] == "seed" and seed["delta_reference"] == "control band centre"
    assert len(seed["curves"]["control_replicates"]) == 3
    assert seed["techniques_changed"] == {"param_dtype": "bfloat16", "deterministic": False}
    assert set(seed["verdicts"][0]["p_values"]) == {"tost_lower", "tost_upper"}
    # |Δ| is measured from the band centre, as the seed verdict measures it.
    assert seed["max_abs_delta"]["loss"] == pytest.approx(seed["verdicts"][0]["max_deviation"])


def test_curves_in_report_are_exact(outcomes: list[PairOutcome], report: dict) -> None:
    o = outcomes[0]
    assert o.test is not None
    saved = report["pairs"][0]["curves"]["test"]["loss"]["values"]
    assert np.array(saved, dtype=np.float64).tobytes() == o.test.metrics["loss"].values.tobytes()


def test_markdown(written: dict[str, Path]) -> None:
    md = written["markdown"].read_text(encoding="utf-8")
    assert md.startswith("## ❌ Convergence: 2 passed, 1 failed, 1 error (4 pairs)")
    header = next(line for line in md.splitlines() if line.startswith("| pair |"))
    assert "\\|Δloss\\|" in header and "tok/s" in header
    # The five axis columns of the terminal folded into one layout cell: 10 columns, so the
    # table fits a step summary.
    assert header.count(" | ") == 9 and "| layout |" in header and "| tp |" not in header
    assert re.search(r"^\| fsdp2-pp2 \| fsdp2-pp2 \| - \| ❌ FAIL\b", md, re.M)
    assert re.search(r"^\| fsdp2-tp2 .*\| 0\.93x \|.*\| ctrl cached \|$", md, re.M)
    assert f"First divergent step: {DIVERGES_AT}" in md
    assert f"first divergent step **{DIVERGES_AT}**" in md
    # The compact table around the divergence: the first divergent row and its delta.
    assert re.search(
        rf"^\| {DIVERGES_AT} \| 2\.728357666 \| 2\.730357666 \| \+2\.000e-03 \|$", md, re.M
    )
    assert "```text\ntest job 'fsdp2-cp2'" in md
    assert "fsdp2-bf16" in md and "## Failures" in md


def test_markdown_matrix_drops_a_layout_column_that_repeats_every_name(
    outcomes: list[PairOutcome],
) -> None:
    from convergence.report.data.records import pair_record
    from convergence.report.formats.markdown import matrix_table

    records = [pair_record(o, include_curves=False) for o in outcomes]
    named = [r for r in records if r["name"] == r["test"]["short_name"]]
    assert named and len(named) < len(records)
    assert "| layout |" in matrix_table(records)[0]  # a name that is not its layout: kept
    header = matrix_table(named)[0]
    assert "| layout |" not in header and header.count(" | ") == 8


def test_html_is_self_contained(written: dict[str, Path], report: dict) -> None:
    html = written["html"].read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "<style>" in html
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 5  # 4 pairs + heatmap
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r'src="(?!data:)', html)  # nothing to fetch
    for record in report["pairs"]:
        assert record["name"] in html and record["id"] in html
    assert 'class="failed"' in html and 'class="passed"' in html and 'class="error"' in html
    # Error text is escaped, not markup.
    assert "shapes do not match &lt;q&gt; &amp; &quot;k&quot;" in html
    assert "<q>" not in html


def _assert_real_image(path: Path, min_size: tuple[int, int]) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[0] >= min_size[0] and img.shape[1] >= min_size[1]
    rgb = img[..., :3]
    q = (rgb * 255).astype(np.uint32)
    colours = np.unique((q[..., 0] << 16) | (q[..., 1] << 8) | q[..., 2])  # 1-D: fast
    assert len(colours) > 20, f"{path.name} looks blank ({len(colours)} colours)"
    non_white = np.mean(np.any(rgb < 0.95, axis=-1))
    assert non_white > 0.03, f"{path.name} is almost empty ({non_white:.1%} ink)"


def test_pngs_have_content(written: dict[str, Path]) -> None:
    for png in sorted(written["plots"].glob("*.png")):
        _assert_real_image(png, (250, 400))


def test_failing_plot_marks_the_divergence(written: dict[str, Path]) -> None:
    img = matplotlib.image.imread(written["plots"] / "converging.toml_fsdp2-pp2.png")[..., :3]
    # The divergence marker and the residual are drawn in red (#d62728).
    red = np.abs(img - np.array([0xD6, 0x27, 0x28]) / 255).max(axis=-1) < 0.08
    assert red.sum() > 500
    img_ok = matplotlib.image.imread(written["plots"] / "converging.toml_fsdp2-tp2.png")[..., :3]
    red_ok = np.abs(img_ok - np.array([0xD6, 0x27, 0x28]) / 255).max(axis=-1) < 0.08
    assert red_ok.sum() < red.sum() / 5


def _stretched(o: PairOutcome, factor: int) -> PairOutcome:
    """The same outcome with every curve ``factor`` times longer (a 2000-step run)."""
    import dataclasses

    from convergence.metrics.curve import Curve

    def stretch(metrics: dict) -> dict:
        out = {}
        for name, c in metrics.items():
            steps = np.arange(1, len(c) * factor + 1, dtype=np.int64)
            out[name] = Curve(name, steps, np.interp(steps / factor, c.steps, c.values))
        return out

    assert o.control is not None and o.test is not None
    return dataclasses.replace(
        o,
        control=dataclasses.replace(o.control, metrics=stretch(o.control.metrics)),
        test=dataclasses.replace(o.test, metrics=stretch(o.test.metrics)),
    )


def test_plot_of_a_twin_pair_shows_the_twins_noise(tmp_path: Path) -> None:
    o = twin_pair()
    loss = o.verdict("loss")
    assert loss is not None and loss.method == "twin" and loss.band is not None
    plot_pair(o, tmp_path / "twin.png")
    assert (tmp_path / "twin.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_long_run(tmp_path: Path) -> None:
    o = _stretched(failing_pair(), 50)
    assert o.test is not None and len(o.test.metrics["loss"]) == 2000
    plot_pair(o, tmp_path / "fail.png")
    # Its speed is not asserted here (a loaded CI machine says nothing about it): the plot
    # of 2000 steps per side is drawn and is a real PNG.
    assert (tmp_path / "fail.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reports_rebuild_from_saved_outcomes(
    outcomes: list[PairOutcome], report: dict, tmp_path: Path
) -> None:
    saved = [json.loads(json.dumps(outcome_to_json(o))) for o in outcomes]
    again = build_report(
        [outcome_from_json(d) for d in saved],
        environment=ENV,
        started_at=1_700_000_000.0,
        wall_s=42.0,
        plots={o.pair.pair_id: r["plots"] for o, r in zip(outcomes, report["pairs"], strict=True)}
        | {"": report["plots"]},
    )
    for key in ("summary", "pairs", "plots", "started_at"):
        assert again[key] == report[key]


def test_same_name_in_two_files_gets_two_plots(tmp_path: Path) -> None:
    import dataclasses

    a = failing_pair()
    b = dataclasses.replace(
        a, pair=dataclasses.replace(a.pair, pair_id="other/converging.toml::fsdp2-pp2")
    )
    paths = write_reports([a, b], tmp_path, environment={})
    report = json.loads(paths["json"].read_text())
    plots = [p["plots"]["pair"] for p in report["pairs"]]
    assert len(set(plots)) == 2 and all((tmp_path / p).is_file() for p in plots)
