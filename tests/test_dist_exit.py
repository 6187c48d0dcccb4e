"""The shared clean exit of distributed processes (convergence.dist_exit) and how the launcher
reports a rank that finished all its steps and then aborted in teardown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fixtures" / "teardown_worker.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from teardown_loop import ABORT_TEXT, run_loop  # noqa: E402


def _run_python(body: str) -> subprocess.CompletedProcess[str]:
    code = f"from convergence.dist_exit import run_and_exit\n{body}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("run_and_exit(lambda: None)", 0),
        ("run_and_exit(lambda: 3)", 3),
        ("def f():\n    raise SystemExit(4)\nrun_and_exit(f)", 4),
        ("def f():\n    raise SystemExit('bad input')\nrun_and_exit(f)", 1),
        ("def f():\n    raise ValueError('boom')\nrun_and_exit(f)", 1),
        ("def f():\n    raise KeyboardInterrupt\nrun_and_exit(f)", 130),
    ],
)
def test_exit_codes_follow_sys_exit(body: str, code: int) -> None:
    proc = _run_python(body)
    assert proc.returncode == code, proc.stderr


def test_exception_traceback_and_buffered_output_are_not_lost() -> None:
    # stdout is a pipe here, so block-buffered: os._exit would drop it without the flush.
    proc = _run_python(
        "import sys\ndef f():\n    print('written before')\n"
        "    print('to stderr', file=sys.stderr)\n    raise ValueError('boom')\n"
        "run_and_exit(f)"
    )
    assert proc.returncode == 1
    assert "written before" in proc.stdout
    assert "Traceback (most recent call last):" in proc.stderr
    assert "ValueError: boom" in proc.stderr


def test_short_gloo_jobs_leave_without_abort() -> None:
    result = run_loop("helper", jobs=2, nproc=4)
    assert (result.aborted, result.failed) == (0, 0), result.first_abort


@pytest.mark.slow
def test_tight_loop_of_gloo_jobs_never_aborts() -> None:
    """30 jobs x 4 ranks (issue: every process that joins a group leaves the same way)."""
    result = run_loop("helper", jobs=30, nproc=4)
    assert (result.aborted, result.failed) == (0, 0), result.first_abort


def _request(tmp_path: Path, *extra: str, steps: int = 3) -> LaunchRequest:
    metrics = tmp_path / "metrics.jsonl"
    return LaunchRequest(
        name="teardown",
        nproc=2,
        log_dir=tmp_path / "logs",
        entry=[str(WORKER), "--steps", str(steps), "--out", str(metrics), *extra],
        metrics_path=metrics,
        total_steps=steps,
    )


def test_abort_after_the_last_step_is_kept_and_named(tmp_path: Path) -> None:
    req = _request(tmp_path, "--abort-after-finish", "--abort-rank", "1")
    result = LocalLauncher(progress_interval_s=0.0).launch(req)
    assert result.status == "ok", result
    assert result.last_step == 3
    assert result.failure is not None
    assert result.failure.signal == "SIGABRT" and result.failure.rank == 1
    assert "after all 3 steps" in result.failure.message
    assert "teardown abort" in (req.log_dir / "launcher.log").read_text()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]


def test_abort_before_the_last_step_is_still_a_crash(tmp_path: Path) -> None:
    # The job is told to expect 5 steps but logs 3, then a rank aborts: not a teardown.
    req = _request(tmp_path, "--abort-after-finish", "--abort-rank", "1")
    req = LaunchRequest(**{**req.__dict__, "total_steps": 5})
    result = LocalLauncher(progress_interval_s=0.0).launch(req)
    assert result.status == "killed", result
    assert result.failure is not None and result.failure.signal == "SIGABRT"
    assert ABORT_TEXT not in result.failure.message
