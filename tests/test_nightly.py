"""Nightly: the sbatch script, report.json -> history JSONL, and the trend report with its PNG.

The reports are real report.json documents (convergence.report.build_report on the example
outcomes of tests/report_examples.py), with a second night's numbers changed by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convergence.cli import main
from convergence.nightly import (NightlySettings, append_history, final_loss_delta,
                                 read_history, render_sbatch, write_trend)
from convergence.report.schema import build_report
from convergence.spec.errors import SpecError

sys.path.insert(0, str(Path(__file__).parent))
import report_examples as ex  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = NightlySettings(experiments=("experiments",), out="/shared/convergence-nightly",
                          rootdir="/path/to/pytest-convergence", python="python3",
                          gpus_per_node=8)
"""The settings scripts/nightly.sbatch was rendered from (kept in sync by a test)."""


def _report(tmp_path: Path, name: str, *, tps_scale: float = 1.0,
            loss_shift: float = 0.0) -> Path:
    doc = build_report([ex.passing_pair(), ex.failing_pair(), ex.errored_pair()],
                       environment={}, started_at=None, wall_s=10.0)
    for pair in doc["pairs"]:
        res = pair["resources"]["tokens_per_s"]
        if isinstance(res["test"], float):
            res["test"] *= tps_scale
        curve = pair.get("curves", {}).get("test", {}).get("loss")
        if curve:
            curve["values"] = [v + loss_shift for v in curve["values"]]
    path = tmp_path / name / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return path


def test_example_script_is_the_rendered_template() -> None:
    text = (ROOT / "scripts" / "nightly.sbatch").read_text()
    assert text == render_sbatch(EXAMPLE, script_name="scripts/nightly.sbatch"), \
        "regenerate scripts/nightly.sbatch from convergence.nightly.render_sbatch(EXAMPLE)"


def test_script_runs_pytest_then_records(tmp_path: Path) -> None:
    out = tmp_path / "n"
    assert main(["nightly", "--experiments", "experiments/a.toml", "experiments/b dir",
                 "--out", str(out), "--partition", "gpu", "--gpus-per-node", "4",
                 "--nodes", "2", "--sbatch-option=--account=ml",
                 "--pytest-args", "-n 2 --convergence-refresh"]) == 0
    text = (out / "nightly.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "nightly.sbatch")]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --account=ml", "#SBATCH --exclusive",
                 f"#SBATCH --output={out.resolve()}/slurm-%j.out"):
        assert line in text
    pytest_line = text[text.index('"$PYTHON" -m pytest'):text.index("status=$?")]
    for part in ("-m convergence", "--convergence-tier nightly", "--convergence-launcher slurm",
                 '--junitxml "$NIGHT_DIR/junit.xml"', '--convergence-report "$NIGHT_DIR/report"',
                 "-n 2 --convergence-refresh", "experiments/a.toml", "'experiments/b dir'"):
        assert part in pytest_line, part
    assert text.index("status=$?") < text.index("convergence.cli record")
    assert text.rstrip().endswith("exit $status")


def test_no_experiments_is_an_error() -> None:
    with pytest.raises(SpecError, match="--experiments"):
        NightlySettings(experiments=(), out="x")


def test_final_loss_delta_uses_last_common_step() -> None:
    pair: dict[str, Any] = {"curves": {
        "control": {"loss": {"steps": [1, 2, 3], "values": [3.0, 2.0, 1.0]}},
        "test": {"loss": {"steps": [1, 2], "values": [3.0, 2.5]}}}}
    assert final_loss_delta(pair) == (2, 0.5)
    assert final_loss_delta({"curves": {}}) == (None, None)


def test_two_nights_to_history_to_trend(tmp_path: Path) -> None:
    history = tmp_path / "hist" / "history.jsonl"
    first = append_history(_report(tmp_path, "n1"), history, night="night-1", pytest_status=1)
    second = append_history(_report(tmp_path, "n2", tps_scale=0.5, loss_shift=0.25), history,
                            night="night-2", pytest_status=1)
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
        assert main(["record", str(_report(tmp_path, f"r{i}")), str(history),
                     "--night", f"n{i}"]) == 0
    assert len(read_history(history).records) == 6
    assert main(["trend", str(history), "--out", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "trend.png").stat().st_size > 10_000
    assert main(["record", str(tmp_path / "missing.json"), str(history)]) == 2
    assert "missing.json" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["trend", str(empty), "--out", str(tmp_path / "t2")]) == 2


FAKE_PYTHON = """#!/bin/bash
# Stand-in for the allocation's python: `-m pytest` writes a prepared report.json where
# --convergence-report points (the real pytest step needs GPUs and Slurm) and exits 1 (a pair
# failed); everything else -- `convergence.cli record` and `trend` -- runs for real.
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
    settings = NightlySettings(experiments=("experiments",), out=str(tmp_path / "nightly"),
                               rootdir=str(ROOT), python=str(fake))
    script = tmp_path / "nightly.sbatch"
    script.write_text(render_sbatch(settings))
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "REPORT_JSON": str(_report(tmp_path, "night"))}
    for job_id in ("101", "102"):
        done = subprocess.run(["bash", str(script)], env={**env, "SLURM_JOB_ID": job_id},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr  # pytest's status: a pair failed
    history = read_history(tmp_path / "nightly" / "history.jsonl")
    assert len(history.nights()) == 2
    trend = tmp_path / "nightly" / "trend"
    data = json.loads((trend / "trend.json").read_text())
    assert len(data["nights"]) == 2 and all(n.endswith(("-101", "-102")) for n in data["nights"])
    assert (trend / "trend.png").stat().st_size > 0 and (trend / "trend.md").is_file()
