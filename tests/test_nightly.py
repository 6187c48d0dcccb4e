"""Nightly: the sbatch script, report.json -> history JSONL, and the trend report with its PNG.

The reports are real report.json documents (convergence.report.build_report on the example
outcomes of tests/report_examples.py), with a second night's numbers changed by hand.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convergence.cli import main
from convergence.metrics.tensorboard import read_tensorboard
from convergence.nightly import (
    NightlySettings,
    append_history,
    final_loss_delta,
    history_records,
    read_history,
    render_sbatch,
    run_names,
    runs,
    write_trend,
)
from convergence.report.data.schema import build_report
from convergence.spec.errors import SpecError
from experiments import builtin_pair, write_toml

sys.path.insert(0, str(Path(__file__).parent))
import report_examples as ex

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = NightlySettings(
    experiments=("experiments",),
    out="/shared/convergence-nightly",
    rootdir=None,  # the folder sbatch is run from: the checkout
    python="python3",
    gpus_per_node=8,
    nodes=4,
)
"""The settings scripts/nightly.sbatch was rendered from (kept in sync by a test); 4 nodes:
what `convergence nightly --gpus-per-node 8` computes for this repository's experiments/."""


def _report(
    tmp_path: Path,
    name: str,
    *,
    tps_scale: float = 1.0,
    loss_shift: float = 0.0,
    control_shift: float = 0.0,
    drop: str | None = None,
    status: dict[str, str] | None = None,
    step_time: dict[str, float] | None = None,
) -> Path:
    """A real report.json of the example pairs, changed by hand: test tokens/s scaled, test
    and control loss shifted, the pair whose id ends with ``drop`` left out, statuses
    overridden by id suffix, ``resources.step_time_s`` set (as when the run meta has tokens
    per step; the examples have none)."""
    doc = build_report(
        [ex.passing_pair(), ex.failing_pair(), ex.errored_pair()],
        environment={},
        started_at=None,
        wall_s=10.0,
    )
    if drop:
        doc["pairs"] = [p for p in doc["pairs"] if not p["id"].endswith(drop)]
    for pair in doc["pairs"]:
        res = pair["resources"]["tokens_per_s"]
        if isinstance(res["test"], float):
            res["test"] *= tps_scale
        for side, shift in (("test", loss_shift), ("control", control_shift)):
            curve = pair.get("curves", {}).get(side, {}).get("loss")
            if curve:
                curve["values"] = [v + shift for v in curve["values"]]
        for suffix, new_status in (status or {}).items():
            if pair["id"].endswith(suffix):
                pair["status"] = new_status
        if step_time is not None:
            pair["resources"]["step_time_s"] = {**step_time, "ratio": None}
    path = tmp_path / name / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return path


def test_example_script_is_the_rendered_template() -> None:
    text = (ROOT / "scripts" / "nightly.sbatch").read_text()
    assert text == render_sbatch(EXAMPLE, script_name="scripts/nightly.sbatch"), (
        "regenerate scripts/nightly.sbatch from convergence.nightly.render_sbatch(EXAMPLE)"
    )
    from convergence.nightly.sizing import largest_job, nodes_for

    largest = largest_job([ROOT / "experiments"], rootdir=ROOT)
    assert largest is not None and nodes_for(largest.world_size, 8) == EXAMPLE.nodes, largest
    assert "--convergence-refresh" in text  # controls re-run each night by default


def test_script_runs_pytest_then_records(tmp_path: Path) -> None:
    out = tmp_path / "n"
    assert (
        main(
            [
                "nightly",
                "--experiments",
                "experiments/a.toml",
                "experiments/b dir",
                "--out",
                str(out),
                "--partition",
                "gpu",
                "--gpus-per-node",
                "4",
                "--nodes",
                "2",
                "--sbatch-option=--account=ml",
                "--pytest-args",
                "-n 2 --convergence-refresh",
            ]
        )
        == 0
    )
    text = (out / "nightly.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "nightly.sbatch")]).returncode == 0
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --account=ml",
        "#SBATCH --exclusive",
        f"#SBATCH --output={out.resolve()}/slurm-%j.out",
    ):
        assert line in text
    pytest_line = text[text.index('"$PYTHON" -m pytest') : text.index("status=$?")]
    for part in (
        "-m convergence",
        "--convergence-tier nightly",
        "--convergence-launcher slurm",
        '--junitxml "$NIGHT_DIR/junit.xml"',
        '--convergence-report "$NIGHT_DIR/report"',
        "-n 2 --convergence-refresh",
        "experiments/a.toml",
        "'experiments/b dir'",
    ):
        assert part in pytest_line, part
    assert text.index("status=$?") < text.index("convergence.cli record")
    assert text.rstrip().endswith("exit $status")


def test_no_experiments_is_an_error() -> None:
    with pytest.raises(SpecError, match="--experiments"):
        NightlySettings(experiments=(), out="x")


def test_final_loss_delta_uses_last_common_step() -> None:
    pair: dict[str, Any] = {
        "curves": {
            "control": {"loss": {"steps": [1, 2, 3], "values": [3.0, 2.0, 1.0]}},
            "test": {"loss": {"steps": [1, 2], "values": [3.0, 2.5]}},
        }
    }
    assert final_loss_delta(pair) == (2, 0.5)
    assert final_loss_delta({"curves": {}}) == (None, None)


def test_two_nights_to_history_to_trend(tmp_path: Path) -> None:
    history = tmp_path / "hist" / "history.jsonl"
    first = append_history(_report(tmp_path, "n1"), history, night="night-1", pytest_status=1)
    second = append_history(
        _report(tmp_path, "n2", tps_scale=0.5, loss_shift=0.25),
        history,
        night="night-2",
        pytest_status=1,
    )
    assert [r["pair"] for r in first] == [r["pair"] for r in second] and len(first) == 3
    by_status = {r["status"]: r for r in first}
    assert set(by_status) == {"passed", "failed", "error"}
    ok1 = by_status["passed"]
    ok2 = next(r for r in second if r["pair"] == ok1["pair"])
    assert ok1["final_step"] == ex.STEPS and ok1["verdicts"]["loss"] is True
    assert ok2["final_loss_delta"] == pytest.approx(ok1["final_loss_delta"] + 0.25)
    assert ok2["tokens_per_s"]["test"] == pytest.approx(ok1["tokens_per_s"]["test"] * 0.5)
    assert ok1["peak_mem_mib"]["test"] is not None
    assert by_status["error"]["final_loss_delta"] is None  # no test curve

    with open(history, "a") as fh:
        fh.write('{"truncated": \n')  # a night killed while writing
    files = write_trend(history, tmp_path / "trend")
    data = json.loads(files.json.read_text())
    assert data["nights"] == ["night-1", "night-2"] and data["skipped_lines"] == 1
    tps = data["pairs"][ok1["pair"]]["tokens_per_s"]
    assert tps[1] == pytest.approx(tps[0] * 0.5)
    md = files.markdown.read_text()
    assert "night-1" in md and "night-2" in md and "![trend](trend.png)" in md
    assert f"## {ok1['pair']}" in md and "1 unreadable history line(s) skipped" in md

    import matplotlib.image as mpimg

    image = mpimg.imread(files.png)
    assert image.shape[0] > 300 and image.shape[1] > 300
    rgb = image[..., :3]
    coloured = np.abs(rgb - rgb.mean(axis=-1, keepdims=True)).sum(axis=-1) > 0.1
    assert coloured.mean() > 0.001, "no coloured pair lines in the trend plot"


def test_cli_record_and_trend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = tmp_path / "h.jsonl"
    for i in (1, 2):
        assert (
            main(["record", str(_report(tmp_path, f"r{i}")), str(history), "--night", f"n{i}"]) == 0
        )
    assert len(read_history(history).records) == 6
    assert main(["trend", str(history), "--out", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "trend.png").stat().st_size > 10_000
    assert main(["record", str(tmp_path / "missing.json"), str(history)]) == 2
    assert "missing.json" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trend", str(empty), "--out", str(tmp_path / "t2")]) == 2


PASSING, FAILING, ERRORED = "::fsdp2-tp2", "::fsdp2-pp2", "::fsdp2-cp2"
NIGHTS = ("20240301T200000Z-11", "20240302T200000Z-12", "20240303T200000Z-13")
"""Night names as the sbatch script makes them: a UTC stamp, then the Slurm job id."""


def _pair_id(records: list[dict[str, Any]], suffix: str) -> str:
    return next(r["pair"] for r in records if r["pair"].endswith(suffix))


def _section(markdown: str, pair: str) -> str:
    """The markdown of one pair's table (up to the next heading or the closing notes)."""
    start = markdown.index(f"## {pair}\n")
    rest = markdown[start + 3 :]
    end = min(i for i in (rest.find("\n## "), rest.find("\nStep time and")) if i >= 0)
    return rest[:end]


def _three_nights(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Night 1 all pairs; night 2 without the failing pair; night 3 all, the passing pair
    now failing (the verdict as the report says it) and the control's loss 0.125 higher."""
    history = tmp_path / "history.jsonl"
    reports = [
        _report(tmp_path, "n1"),
        _report(tmp_path, "n2", drop=FAILING, loss_shift=0.25),
        _report(tmp_path, "n3", status={PASSING: "failed"}, control_shift=0.125),
    ]
    first: list[dict[str, Any]] = []
    for night, report in zip(NIGHTS, reports, strict=True):
        records = append_history(report, history, night=night, pytest_status=1)
        first = first or records
    ids = {suffix: _pair_id(first, suffix) for suffix in (PASSING, FAILING, ERRORED)}
    return history, ids


def test_control_final_loss_and_step_times_are_recorded(tmp_path: Path) -> None:
    report = _report(tmp_path, "n", control_shift=0.5)
    doc = json.loads(report.read_text())
    records = history_records(doc, night="n")
    for pair, record in zip(doc["pairs"], records, strict=True):
        control = pair["curves"]["control"]["loss"]
        assert record["control_final_step"] == control["steps"][-1] == ex.STEPS
        # the control's own last logged loss, not the delta and not the test's
        assert record["control_final_loss"] == pytest.approx(control["values"][-1])
        assert record["control_final_loss"] > 2.5  # shifted by 0.5 above the ~2.1 it ends at
    passing = next(r for r in records if r["pair"].endswith(PASSING))
    errored = next(r for r in records if r["pair"].endswith(ERRORED))
    assert errored["final_loss_delta"] is None and errored["control_final_loss"] is not None

    # No tokens per step in the examples' run meta: wall time / steps, marked "wall"
    # (passing_pair: test 14.2 s over 40 logged steps; cached control 11.0 s over 40 steps).
    assert passing["step_time_s"]["test"] == pytest.approx(14.2 / ex.STEPS)
    assert passing["step_time_s"]["control"] == pytest.approx(11.0 / ex.STEPS)
    assert passing["step_time_from"] == {"control": "wall", "test": "wall"}
    assert errored["step_time_s"]["test"] is None and errored["step_time_from"]["test"] is None

    # The report's own median step time (tokens per step / tokens/s) wins when it has one.
    doc2 = json.loads(_report(tmp_path, "n2", step_time={"control": 0.2, "test": 0.3}).read_text())
    passing2 = next(r for r in history_records(doc2, night="n2") if r["pair"].endswith(PASSING))
    assert passing2["step_time_s"] == {"control": 0.2, "test": 0.3, "ratio": pytest.approx(1.5)}
    assert passing2["step_time_from"] == {"control": "tokens_per_s", "test": "tokens_per_s"}


OLD_LINE = {  # a history line as version 1 wrote it: no control loss, no step time
    "history_version": 1,
    "night": "old-night",
    "generated_at": "2024-02-01T20:00:00+00:00",
    "slurm_job_id": "7",
    "pytest_status": 0,
    "pair": "converging.toml::fsdp2-tp2",
    "status": "passed",
    "verdicts": {"loss": True},
    "final_step": 40,
    "final_loss_delta": 1e-8,
    "max_abs_loss_delta": 2e-8,
    "tokens_per_s": {"control": 1000.0, "test": 930.0, "ratio": 0.93},
    "peak_mem_mib": {"control": 512.0, "test": 300.0, "ratio": 0.59},
    "wall_s": 14.9,
}


def test_old_format_history_lines_load(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    history.write_text(json.dumps(OLD_LINE) + "\n")
    append_history(_report(tmp_path, "n"), history, night="new-night")
    old, *new = read_history(history).entries()
    assert old.night == "old-night" and old.status == "passed" and old.passed == 1.0
    assert old.final_loss_delta == 1e-8 and old.tokens_per_s == 930.0
    assert old.control_tokens_per_s == 1000.0
    assert old.control_final_loss is None and old.step_time_s is None
    assert old.control_step_time_s is None and old.step_time_from == {}
    assert old.night_time() == dt.datetime(2024, 2, 1, 20, tzinfo=dt.timezone.utc).timestamp()
    assert all(r.control_final_loss is not None for r in new)

    files = write_trend(history, tmp_path / "trend")
    pair = json.loads(files.json.read_text())["pairs"][OLD_LINE["pair"]]
    assert pair["control_final_loss"][0] is None and pair["control_final_loss"][1] > 2.0
    assert pair["step_time_s"][0] is None and pair["step_time_s"][1] is not None
    section = _section(files.markdown.read_text(), OLD_LINE["pair"])
    row = next(line for line in section.splitlines() if line.startswith("| old-night |"))
    assert row.split(" | ")[1:4] == ["passed", "1.00e-08", "–"]  # no control loss then
    failing = _pair_id(list(read_history(history).records), FAILING)
    assert "| old-night | absent |" in _section(files.markdown.read_text(), failing)


def test_three_nights_with_a_pair_missing_the_middle_night(tmp_path: Path) -> None:
    history, ids = _three_nights(tmp_path)
    files = write_trend(history, tmp_path / "trend")
    data = json.loads(files.json.read_text())
    assert data["nights"] == list(NIGHTS)
    assert data["night_times"][0] == "2024-03-01T20:00:00+00:00"

    failing = data["pairs"][ids[FAILING]]
    assert failing["status"] == ["failed", None, "failed"]
    assert failing["passed"] == [0.0, None, 0.0]
    for metric in ("final_loss_delta", "control_final_loss", "step_time_s", "tokens_per_s"):
        assert failing[metric][1] is None, metric
        assert failing[metric][0] is not None and failing[metric][2] is not None, metric
    assert runs(failing["final_loss_delta"]) == [[0], [2]]  # no line across night 2
    # failing_pair: test 16.0 s, control 10.5 s over 40 steps; tokens/s ~1100 vs ~1000
    assert failing["step_time_s"][0] == pytest.approx(16.0 / ex.STEPS)
    assert failing["control_step_time_s"][2] == pytest.approx(10.5 / ex.STEPS)
    assert failing["tokens_per_s"][0] == pytest.approx(1100, rel=0.01)
    assert failing["control_tokens_per_s"][0] == pytest.approx(1000, rel=0.01)

    # pass/fail per night: the verdict as each night's report says it
    passing = data["pairs"][ids[PASSING]]
    assert passing["status"] == ["passed", "passed", "failed"]
    assert passing["passed"] == [1.0, 1.0, 0.0]
    assert passing["final_loss_delta"][1] == pytest.approx(passing["final_loss_delta"][0] + 0.25)
    control = passing["control_final_loss"]
    assert control[0] == pytest.approx(control[1]) and control[2] == pytest.approx(
        control[0] + 0.125
    )
    errored = data["pairs"][ids[ERRORED]]
    assert errored["status"] == ["error"] * 3 and errored["passed"] == [0.0] * 3
    assert errored["final_loss_delta"] == [None] * 3 and None not in errored["control_final_loss"]

    md = files.markdown.read_text()
    failing_rows = _section(md, ids[FAILING]).splitlines()
    assert f"| {NIGHTS[1]} | absent | – | – | – | – |" in failing_rows
    assert [r.split(" | ")[1] for r in failing_rows if r.startswith("| 2024")] == [
        "failed",
        "absent",
        "failed",
    ]
    passing_rows = [r for r in _section(md, ids[PASSING]).splitlines() if r.startswith("| 2024")]
    assert [r.split(" | ")[1] for r in passing_rows] == ["passed", "passed", "failed"]
    assert f"| {ids[FAILING]} | 2/3 | 0 | 2 | 0 | failed | `✗·✗` |" in md
    assert f"| {ids[PASSING]} | 3/3 | 2 | 1 | 0 | failed | `✓✓✗` |" in md
    assert (
        "| night | verdict | final loss Δ | control final loss | step time (s) | tokens/s |" in md
    )

    # every PNG is written and listed in trend.md; trend.png holds verdict markers
    assert (
        [p.name for p in files.pngs]
        == data["plots"]
        == ["trend.png", "trend_control_loss.png", "trend_step_time.png", "trend_tokens_per_s.png"]
    )
    for png in files.pngs:
        assert png.stat().st_size > 10_000 and f"]({png.name})" in md
    import matplotlib.image as mpimg

    rgb = mpimg.imread(files.png)[..., :3]
    for colour in ((0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28)):  # passed green, failed red
        near = np.abs(rgb - np.array(colour) / 255.0).max(axis=-1) < 0.05
        assert near.sum() > 20, f"no {colour} verdict markers in trend.png"


def test_tensorboard_export_reads_back_per_night(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    history, ids = _three_nights(tmp_path)
    out = tmp_path / "trend"
    write_trend(history, out)
    files = write_trend(history, out)  # rewritten after the next night: no duplicate events
    series = json.loads(files.json.read_text())["pairs"]
    assert set(files.tensorboard) == set(ids.values())
    for pair, folder in files.tensorboard.items():
        assert folder.parent == out / "tensorboard" and "::" not in folder.name
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
        for metric in (
            "final_loss_delta",
            "control_final_loss",
            "step_time_s",
            "control_step_time_s",
            "tokens_per_s",
            "control_tokens_per_s",
            "passed",
        ):
            expected = [(i, v) for i, v in enumerate(series[pair][metric]) if v is not None]
            curves = read_tensorboard(folder, tag_map={f"nightly/{metric}": "loss"})
            if not expected:
                assert "loss" not in curves, (pair, metric)
                continue
            curve = curves["loss"]
            assert curve.steps.tolist() == [i for i, _ in expected], (pair, metric)
            assert curve.values.tolist() == [v for _, v in expected], (pair, metric)  # exact

    failing = read_tensorboard(
        files.tensorboard[ids[FAILING]], tag_map={"nightly/final_loss_delta": "loss"}
    )["loss"]
    assert failing.steps.tolist() == [0, 2]  # the night it did not run is not there
    passed = read_tensorboard(files.tensorboard[ids[PASSING]], tag_map={"nightly/passed": "loss"})[
        "loss"
    ]
    assert passed.steps.tolist() == [0, 1, 2] and passed.values.tolist() == [1.0, 1.0, 0.0]

    # the wall time of each point is its night's, parsed from the night's name
    events = next(files.tensorboard[ids[FAILING]].glob("events.out.tfevents.*"))
    times = {
        e.step: e.wall_time
        for e in EventFileLoader(str(events)).Load()
        if any(v.tag == "nightly/final_loss_delta" for v in e.summary.value)
    }
    expected_times = {
        i: dt.datetime.strptime(NIGHTS[i][:16], "%Y%m%dT%H%M%SZ")
        .replace(tzinfo=dt.timezone.utc)
        .timestamp()
        for i in (0, 2)
    }
    assert times == expected_times


def test_tensorboard_run_names_are_folders_and_unique() -> None:
    names = run_names(["exp/a.toml::x y", "exp_a.toml_x_y", "::"])
    assert names["exp/a.toml::x y"] == "exp_a.toml_x_y"
    assert names["exp_a.toml_x_y"].startswith("exp_a.toml_x_y-")  # the clash gets a hash
    assert names["::"] == "pair" and len(set(names.values())) == 3


FAKE_PYTHON = """#!/bin/bash
# Stand-in for the allocation's python: `-m pytest` writes a prepared report.json where
# --convergence-report points (the real pytest step needs GPUs and Slurm) and exits 1 (a pair
# failed); `convergence.cli calibrate` (jobs for minutes) says what it was asked; everything
# else -- `convergence.cli record` and `trend` -- runs for real.
if [ "$3" = "calibrate" ]; then echo "calibrate $*" >&2; exit 0; fi
if [ "$2" = "pytest" ]; then
    while [ $# -gt 0 ]; do
        if [ "$1" = "--convergence-report" ]; then mkdir -p "$2"; cp "$REPORT_JSON" "$2/"; fi
        shift
    done
    exit 1
fi
exec {python} "$@"
"""


def test_the_sbatch_script_records_each_night_and_writes_the_trend(tmp_path: Path) -> None:
    """The generated script itself, run twice by bash: each night is recorded in the history,
    the trend is rewritten from it, and the script exits with the night's pytest status."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    settings = NightlySettings(
        experiments=("experiments",),
        out=str(tmp_path / "nightly"),
        rootdir=str(ROOT),
        python=str(fake),
    )
    script = tmp_path / "nightly.sbatch"
    script.write_text(render_sbatch(settings))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REPORT_JSON": str(_report(tmp_path, "night"))}
    for job_id in ("101", "102"):
        done = subprocess.run(
            ["bash", str(script)],
            env={**env, "SLURM_JOB_ID": job_id},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 1, done.stderr  # pytest's status: a pair failed
    history = read_history(tmp_path / "nightly" / "history.jsonl")
    assert len(history.nights()) == 2
    trend = tmp_path / "nightly" / "trend"
    data = json.loads((trend / "trend.json").read_text())
    assert len(data["nights"]) == 2 and all(n.endswith(("-101", "-102")) for n in data["nights"])
    assert (trend / "trend.png").stat().st_size > 0 and (trend / "trend.md").is_file()


def test_nightly_sizes_nodes_from_the_largest_pair(tmp_path: Path) -> None:
    from convergence.nightly.sizing import largest_job, nodes_for

    folder = tmp_path / "experiments"
    folder.mkdir()
    builtin_pair(
        folder,
        file="small.toml",
        steps=None,
        train_config="debug",
        control={"name": "c", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "t", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )
    builtin_pair(
        folder,
        file="big.toml",
        steps=None,
        train_config="debug",
        control={"name": "c", "parallelism": {"dp_shard": 4}},
        tests=[
            {"name": "t16", "parallelism": {"dp_shard": 4, "tp": 2, "pp": 2}, "tier": "nightly"}
        ],
    )
    write_toml(folder / "not_ours.toml", {"job": {"name": "torchtitan config"}})
    largest = largest_job([folder], rootdir=ROOT)
    assert largest is not None and largest.world_size == 16 and "big.toml::t16" in largest.where
    assert nodes_for(largest.world_size, 8) == 2
    assert largest_job([folder], rootdir=ROOT, max_tier="quick").world_size == 4  # type: ignore[union-attr]
    out = tmp_path / "out"
    assert (
        main(
            [
                "nightly",
                "--experiments",
                str(folder),
                "--out",
                str(out),
                "--rootdir",
                str(ROOT),
                "--gpus-per-node",
                "8",
            ]
        )
        == 0
    )
    assert "#SBATCH --nodes=2" in (out / "nightly.sbatch").read_text()


def test_a_night_named_like_a_stamp_that_is_no_date_falls_back_to_the_report_time(
    tmp_path: Path,
) -> None:
    history = tmp_path / "history.jsonl"
    line = {**OLD_LINE, "night": "20241399T259999Z-retry"}  # month 13, hour 25
    history.write_text(json.dumps(line) + "\n")
    (entry,) = read_history(history).entries()
    assert entry.night_time() == dt.datetime(2024, 2, 1, 20, tzinfo=dt.timezone.utc).timestamp()
    files = write_trend(history, tmp_path / "trend")  # raised ValueError before
    assert "20241399T259999Z-retry" in files.markdown.read_text()


def test_out_naming_a_script_is_refused_before_making_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: `--out nightly.sbatch` made a folder named nightly.sbatch/."""
    script = tmp_path / "nightly.sbatch"
    assert main(["nightly", "--experiments", "experiments", "--out", str(script)]) == 2
    assert not script.exists()
    assert "--script" in capsys.readouterr().err


def test_a_failing_setup_step_ends_the_night(tmp_path: Path) -> None:
    """set -e for the set-up: a `cd` into a missing checkout stops the script there (it used
    to go on and run pytest in whatever folder Slurm started it)."""
    out = tmp_path / "out"
    settings = dataclasses.replace(EXAMPLE, rootdir=str(tmp_path / "missing"), out=str(out))
    script = tmp_path / "night.sbatch"
    script.write_text(render_sbatch(settings))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert not out.exists()  # mkdir -p "$NIGHT_DIR" was never reached


def test_the_repository_script_runs_in_the_folder_it_is_submitted_from() -> None:
    text = (ROOT / "scripts" / "nightly.sbatch").read_text()
    assert "/path/to" not in text
    assert 'cd "${SLURM_SUBMIT_DIR:?' in text


def test_calibration_goes_to_the_sessions_workdir() -> None:
    """With --convergence-workdir on shared storage, calibrate writes where the session
    looks (it used to write to <rootdir>/.convergence)."""
    for args in (("--convergence-workdir", "/shared/wd"), ("--convergence-workdir=/shared/wd",)):
        text = render_sbatch(dataclasses.replace(EXAMPLE, pytest_args=args))
        assert "calibrate --if-missing --workdir /shared/wd debug" in text
    assert "calibrate --if-missing debug" in render_sbatch(EXAMPLE)


@pytest.mark.parametrize(
    "argv",
    [
        ["--pytest-args", "--convergence-workdir=/shared/wd"],
        ["--pytest-args", "--convergence-workdir /shared/wd -x"],
        ["--pytest-args=--convergence-workdir=/shared/wd"],
    ],
)
def test_pytest_args_may_start_with_a_dash(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 52: `convergence nightly --pytest-args "--convergence-workdir=/x"` was refused by
    argparse ("expected one argument"); the script passes the workdir on and calibrates there."""
    from convergence.cli import main

    out = tmp_path / "nightly"
    rc = main(
        ["nightly", "--experiments", "experiments", "--out", str(out), "--stdout", *argv]
        + ["--decide-args", "--notify always"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "calibrate --if-missing --workdir /shared/wd debug" in captured.out, captured.out
    assert "--convergence-workdir" in captured.out and "--notify always" in captured.out
