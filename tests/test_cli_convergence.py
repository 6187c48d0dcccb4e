"""The ``convergence`` console script: report rebuilding, run-file errors, compare."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_plugin_reporting import make_outcome  # synthetic outcomes, no training

from convergence.cli import main
from convergence.report import REPORT_JSON_SCHEMA, outcome_to_json
from experiments import write_experiment


def _save(folder: Path, outcomes: list) -> Path:  # type: ignore[type-arg]
    folder.mkdir(parents=True, exist_ok=True)
    for o in outcomes:
        name = o.pair.name
        (folder / f"{name}.outcome.json").write_text(json.dumps(outcome_to_json(o)))
    return folder


def test_console_script_is_installed() -> None:
    exe = shutil.which("convergence")
    argv = [exe] if exe else [sys.executable, "-m", "convergence.cli"]
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("run", "compare", "report", "export-golden"):
        assert command in done.stdout


def test_report_rebuilds_reports_from_saved_outcomes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import jsonschema

    source = _save(
        tmp_path / "session", [make_outcome("fsdp2-tp2"), make_outcome("fsdp2-pp2", passed=False)]
    )
    code = main(["report", "--from", str(source), "--out", str(tmp_path / "out")])
    assert code == 1  # one pair failed
    out = capsys.readouterr().out
    assert "fsdp2-tp2" in out and "FAIL" in out and "report.json" in out
    assert "by dimension" in out  # the same summary as the plugin's: matrix, then dimensions
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    assert {p["id"] for p in report["pairs"]} == {
        "synthetic.toml::fsdp2-tp2",
        "synthetic.toml::fsdp2-pp2",
    }
    assert (tmp_path / "out" / "report.html").is_file()


def test_report_appends_to_the_ci_step_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As pytest does: with $GITHUB_STEP_SUMMARY set, the rebuilt report.md is appended."""
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    source = _save(tmp_path / "session", [make_outcome("fsdp2-tp2")])
    assert main(["report", "--from", str(source), "--out", str(tmp_path / "out")]) == 0
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "fsdp2-tp2" in text and "Convergence" in text


def test_report_from_a_folder_without_outcomes_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["report", "--from", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "no saved outcomes" in err and "fix:" in err
    assert not (tmp_path / "out").exists()


def test_run_rejects_an_invalid_experiment_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = write_experiment(
        tmp_path,
        file="bad.toml",
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "t", "tensor_paralel": 2}],
    )
    code = main(["run", str(exp), "--workdir", str(tmp_path / "wd")])
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "tensor_paralel" in err and "fix:" in err
    assert not (tmp_path / "wd").exists()


def _write_run(folder: Path, losses: list[float]) -> Path:
    folder.mkdir(parents=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.0}) + "\n")
    return folder


def test_compare_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    losses = [5.0 - 0.01 * math.sqrt(s) for s in range(1, 41)]
    a = _write_run(tmp_path / "a", losses)
    b = _write_run(tmp_path / "b", losses)
    bug = _write_run(tmp_path / "bug", losses[:20] + [x + 0.05 for x in losses[20:]])
    assert main(["compare", str(a), str(b)]) == 0
    assert "loss" in capsys.readouterr().out
    assert main(["compare", str(a), str(bug), "--metric", "loss"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "first divergent step 21" in out
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # A frozen golden curve stands in for the control run.
    golden = tmp_path / "golden.json"
    assert main(["export-golden", str(a), str(golden)]) == 0
    assert main(["compare", str(golden), str(b), "--metric", "loss", "--metric", "grad_norm"]) == 0
    assert main(["compare", str(golden), str(bug)]) == 1
    capsys.readouterr()
    golden.write_text("{}")
    assert main(["compare", str(golden), str(b)]) == 2
    assert "not a golden file" in capsys.readouterr().err
