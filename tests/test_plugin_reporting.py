"""Failure text, live progress lines, and the session plumbing (xdist workers -> controller,
matrix, report files) on synthetic outcomes: fast, no training jobs. The same paths run on real
jobs in test_plugin_e2e.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  (in-process pytester runs must not re-import torch)

REPO = Path(__file__).resolve().parents[1]

# Written into pytester folders as synth.py, and exec'd here for direct use.
SYNTH = f"""
from pathlib import Path

import numpy as np

from convergence.metrics.curve import Curve
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.spec import ComparisonRule, JobSpec, PairSpec, ParallelLayout
from convergence.stats.types import MetricVerdict

CONFIG = Path({str(REPO / "train_configs" / "debug.toml")!r})


def make_outcome(name, *, passed=True, diverge_at=5, steps=10, run_root=Path("runs")):
    control = JobSpec(name="fsdp2", train_config=CONFIG, layout=ParallelLayout(dp_shard=2),
                      steps=steps)
    test = JobSpec(name=name, train_config=CONFIG, layout=ParallelLayout(dp_shard=2, tp=2),
                   steps=steps)
    rules = (ComparisonRule(metric="loss", method="paired"),)
    pair = PairSpec(pair_id="synthetic.toml::" + name, control=control, test=test,
                    rules=rules, source="synthetic.toml")
    s = np.arange(1, steps + 1, dtype=np.int64)
    ctrl = 5.0 - 0.1 * s
    tst = ctrl.copy()
    if not passed:
        tst[diverge_at - 1:] += 0.25 * (s[diverge_at - 1:] - diverge_at + 1)
    delta = np.abs(tst - ctrl)
    worst = int(s[int(np.argmax(delta))])
    verdict = MetricVerdict(
        metric="loss", method="paired", passed=passed, gate=True, steps_compared=steps,
        first_divergent_step=None if passed else diverge_at,
        max_deviation=float(delta.max()), max_deviation_step=worst,
        tolerance="atol 5e-07*(1+0.1*sqrt(step))", tolerance_at_max=6e-7,
        message="within tolerance" if passed else "outside tolerance from step %d" % diverge_at)
    side = lambda job, values, cached: SideOutcome(
        job=job, metrics={{"loss": Curve("loss", s, values)}}, cached=cached,
        run_dir=run_root / job.name, wall_s=2.0)
    return PairOutcome(pair=pair, status="passed" if passed else "failed",
                       control=side(control, ctrl, True), test=side(test, tst, False),
                       verdicts=(verdict,), wall_s=4.0)
"""

_ns: dict[str, Any] = {}
exec(compile(SYNTH, "synth.py", "exec"), _ns)
make_outcome = _ns["make_outcome"]


def test_failure_text_names_the_divergence() -> None:
    from pytest_convergence.failure_section import render_outcome

    text = render_outcome(make_outcome("fsdp2-tp2", passed=False, diverge_at=5))
    assert text.splitlines()[0] == (
        "synthetic.toml::fsdp2-tp2: loss diverges from step 5 (max |Δ| 1.5)"
    )
    assert "FAILED: test fsdp2-tp2 [fsdp2-tp2] vs control fsdp2 [fsdp2]" in text
    assert "first divergent step 5" in text
    assert "max |Δ| 1.5 at step 10" in text
    # The table: three steps either side of step 5, control/test/Δ.
    rows = [
        line.split()
        for line in text.splitlines()
        if line.startswith("    ") and line.split()[0].isdigit()
    ]
    assert [int(r[0]) for r in rows] == [2, 3, 4, 5, 6, 7, 8]
    step5 = rows[3]
    assert float(step5[1]) == pytest.approx(4.5) and float(step5[2]) == pytest.approx(4.75)
    assert step5[3] == "+2.500e-01"
    assert "control run: runs/fsdp2 (from cache)" in text


def test_error_text_shows_the_job_and_traceback_head() -> None:
    import dataclasses

    from pytest_convergence.failure_section import TRACEBACK_HEAD_LINES, render_outcome

    tb = "\n".join(f"  frame {i}" for i in range(100))
    outcome = dataclasses.replace(
        make_outcome("x"),
        status="error",
        verdicts=(),
        error=f"test job 'x' (fsdp2-tp2) failed on rank 1: exit code 1\n{tb}\n  logs: /tmp/l",
    )
    text = render_outcome(outcome)
    assert "ERROR" in text and "rank 1" in text and "frame 0" in text
    assert f"frame {TRACEBACK_HEAD_LINES + 5}" not in text and "more lines in the logs" in text


def test_progress_lines_when_not_a_tty(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        from convergence.launch.types import Progress
        from pytest_convergence.progress import ProgressPrinter

        def test_progress(request):
            printer = ProgressPrinter(request.config)
            for step in range(1, 201):
                printer(Progress(name="fsdp2-tp2 test", step=step, total_steps=200,
                                 loss=3.2141 - step / 1000, elapsed_s=step * 0.2,
                                 pace_s=0.2 if step > 3 else None))
            printer.finish()
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    lines = [l for l in result.stdout.lines if l.startswith("[fsdp2-tp2 test]")]
    # One line per ~10% of the steps (plus the first), not one per step.
    assert 10 <= len(lines) <= 12
    assert lines[0] == "[fsdp2-tp2 test] step 1/200 loss 3.213"  # no pace yet: no ETA
    assert lines[1] == "[fsdp2-tp2 test] step 20/200 loss 3.194 ETA 0:36"
    assert lines[-1].startswith("[fsdp2-tp2 test] step 200/200 loss 3.014 ETA 0:00")


SESSION_TEST = """
import pytest
from synth import make_outcome
from pytest_convergence.execute import check_outcome, record_outcome

@pytest.mark.convergence
@pytest.mark.parametrize("name,passed", [("fsdp2-tp2", True), ("fsdp2-pp2", False)])
def test_pair(request, name, passed, tmp_path):
    outcome = make_outcome(name, passed=passed, run_root=tmp_path)
    record_outcome(request.config, outcome, request.node.user_properties)
    check_outcome(outcome)
"""


@pytest.mark.parametrize("workers", [None, "2"], ids=["single", "xdist"])
def test_session_gathers_outcomes_and_prints_the_matrix(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: str | None
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the short summary line is cut to the width
    pytester.makepyfile(synth=SYNTH, test_session=SESSION_TEST)
    pytester.makeini("[pytest]\n")
    summary = pytester.path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    args = [
        "-p",
        "no:cacheprovider",
        "-m",
        "convergence",
        "--convergence-report",
        "report",
        "--junitxml",
        "junit.xml",
    ]
    if workers:
        args += ["-n", workers]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "convergence matrix (2 pairs)" in out
    assert "first divergent step 5" in out
    result.stdout.fnmatch_lines(
        [
            "FAILED *fsdp2-pp2* - ConvergenceFailure: synthetic.toml::"
            "fsdp2-pp2: loss diverges from step 5*"
        ]
    )
    matrix = out.split("convergence matrix (2 pairs)")[1]
    assert "fsdp2-tp2" in matrix and "fsdp2-pp2" in matrix and "FAIL" in matrix
    sessions = list((pytester.path / ".convergence" / "sessions").iterdir())
    assert len(sessions) == 1
    saved = sorted(sessions[0].glob("*.outcome.json"))
    assert len(saved) == 2
    assert {json.loads(p.read_text())["pair"]["pair_id"] for p in saved} == {
        "synthetic.toml::fsdp2-tp2",
        "synthetic.toml::fsdp2-pp2",
    }
    # Report files, written once by the controller.
    import jsonschema

    from convergence.report import REPORT_JSON_SCHEMA

    report_dir = pytester.path / "report"
    report = json.loads((report_dir / "report.json").read_text())
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    assert len(report["pairs"]) == 2
    assert (report_dir / "report.md").is_file() and (report_dir / "report.html").is_file()
    assert len(list((report_dir / "plots").glob("*.png"))) >= 3  # 2 pairs + heatmap
    assert "fsdp2-pp2" in summary.read_text()
    assert "report.json" in out
    # JUnit properties per pair (set in the worker, written by the controller).
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="convergence.status" value="failed"' in junit
    assert 'name="convergence.loss.first_divergent_step" value="5"' in junit


def test_piped_progress_does_not_repeat_the_file_header(pytester: pytest.Pytester) -> None:
    """Not a tty (CI logs): progress lines between two results of one file do not make pytest
    print the file's name again before the next result."""
    pytester.makepyfile(
        test_two_pairs="""
        from convergence.launch.types import Progress
        from pytest_convergence.progress import ProgressPrinter

        def _job(request, name):
            printer = ProgressPrinter(request.config)
            printer(Progress(name=name, step=0, total_steps=2, loss=None, elapsed_s=0.0,
                             note="starting (2 ranks, local launcher)"))
            printer(Progress(name=name, step=2, total_steps=2, loss=3.0, elapsed_s=1.0))
            printer.finish()

        def test_first(request):
            _job(request, "first test")

        def test_second(request):
            _job(request, "second test")
    """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["[[]first test[]] starting *", "[[]second test[]] step 2/2 *"])
    headers = [line for line in result.outlines if line.startswith("test_two_pairs.py")]
    assert len(headers) == 1, result.stdout.str()
    # -v: each result still carries its test id after the progress lines (CI logs are read
    # by test id; a bare "PASSED" would not say which pair passed).
    verbose = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-v")
    verbose.stdout.fnmatch_lines(
        [
            "[[]first test[]] step 2/2 *",
            "test_two_pairs.py::test_first PASSED*",
            "[[]second test[]] step 2/2 *",
            "test_two_pairs.py::test_second PASSED*",
        ]
    )


def test_xdist_workers_progress_reaches_the_controller(pytester: pytest.Pytester) -> None:
    """Under -n 2 the jobs run in workers, whose output the user never sees: their progress
    lines are relayed by the controller, prefixed with the worker's id."""
    pytest.importorskip("xdist")
    pytester.makepyfile(
        test_workers="""
        import pytest
        from convergence.launch.types import Progress
        from pytest_convergence.progress_relay import WorkerProgress
        from pytest_convergence.stash import get_state

        @pytest.mark.parametrize("name", ["first", "second"])
        def test_job(request, name):
            progress = WorkerProgress(get_state(request.config).share_dir)
            progress(Progress(name=f"{name} test", step=0, total_steps=4, loss=None,
                              elapsed_s=0.0, note="starting (2 ranks, local launcher)"))
            for step in range(1, 5):
                progress(Progress(name=f"{name} test", step=step, total_steps=4, loss=2.5,
                                  elapsed_s=float(step)))
    """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    for name in ("first", "second"):
        assert re.search(rf"\[gw\d\] \[{name} test\] starting \(2 ranks", out), out
        assert re.search(rf"\[gw\d\] \[{name} test\] step 4/4 loss 2.5", out), out


def test_progress_redraws_in_place_on_a_terminal(pytester: pytest.Pytester) -> None:
    """On a tty: lines redrawn in place (cursor moves), erased at the end, pytest's own
    result written after them on its line."""
    import os
    import pty
    import subprocess
    import sys

    pytester.makepyfile("""
        import time
        from convergence.launch.types import Progress
        from pytest_convergence.progress import ProgressPrinter

        def test_progress(request):
            printer = ProgressPrinter(request.config)
            for step in range(1, 5):
                for name in ("fsdp2 control", "fsdp2-tp2 test"):
                    printer(Progress(name=name, step=step, total_steps=8, loss=3.0,
                                     elapsed_s=step, pace_s=1.0))
                time.sleep(0.3)
            printer.finish()
    """)
    main, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "TERM": "xterm", "PY_COLORS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-p", "no:xdist"],
        cwd=pytester.path,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(main)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert "[fsdp2 control] step 1/8 loss 3 ETA 0:07" in out
    assert "[fsdp2-tp2 test] step 2/8" in out
    assert "\x1b[1A" in out  # the two lines were redrawn in place
    tail = out.split("[fsdp2-tp2 test] step")[-1]
    assert "\x1b[J" in tail and "PASSED" in tail  # erased, then pytest's result
