"""A job never outlives the pytest that launched it: SIGTERM (scancel, CI timeouts, kill) is
handled like Ctrl-C with a report, and SIGKILL leaves no orphan thanks to the parent-death
signal. Real pytest sessions in subprocesses, real torchrun jobs on gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from convergence.process_lifetime import sigterm_as_interrupt
from experiments import builtin_pair


# A pair whose test trains (practically) forever, so the signal always lands mid-job.
def write_experiment(project: Path) -> None:
    builtin_pair(
        project / "experiments",
        file="forever.toml",
        train_config="debug",
        steps=100000,
        seed=3,
        control={"name": "ddp2", "parallelism": {"dp_replicate": 2}, "steps": 2},
        tests=[{"name": "fsdp2-long", "parallelism": {"dp_shard": 2}, "early_stop": False}],
    )


def _spawn_pytest(project: Path, *args: str) -> subprocess.Popen[str]:
    """``pytest -m convergence *args`` in a subprocess of its own session, output to
    project/out.txt."""
    with open(project / "out.txt", "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "convergence", *args],
            cwd=project,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def _await_training(
    project: Path, proc: subprocess.Popen[str], jobs: str, count: int, never: str
) -> list[Path]:
    """Wait until ``count`` jobs matching ``jobs`` (a run folder glob) have logged a training
    step (read from their metrics files: xdist workers print no progress); kill the session
    and fail with ``never`` if they do not within 10 minutes."""
    deadline = time.monotonic() + 600
    training: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None and len(training) < count:
        training = [
            p
            for p in project.glob(f".convergence/runs/*/{jobs}/dump/metrics.jsonl")
            if p.stat().st_size
        ]
        time.sleep(0.5)
    if len(training) < count:
        proc.kill()
        raise AssertionError(f"{never}:\n" + _output(project))
    return training


def _start(project: Path, *extra: str) -> subprocess.Popen[str]:
    """pytest in a subprocess (output to project/out.txt); returns once the long job has
    logged a training step."""
    write_experiment(project)
    proc = _spawn_pytest(project, "--convergence-report", "report", *extra)
    _await_training(project, proc, "test-*", 1, "the long job never logged a step")
    return proc


def _output(project: Path) -> str:
    return (project / "out.txt").read_text()[-3000:]


def _job_processes(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    children = psutil.Process(proc.pid).children(recursive=True)
    # torchrun's processes, or the warm start's (forked from convergence.launch.forkserver)
    assert any(
        "torch" in " ".join(p.cmdline()) or "forkserver" in " ".join(p.cmdline()) for p in children
    ), children
    return children


def _survivors(processes: list[psutil.Process], timeout: float = 15.0) -> list[str]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:  # never leave them to the next test
        p.kill()
    return [" ".join(p.cmdline())[:120] for p in left]


@pytest.fixture
def project(pytester: pytest.Pytester) -> Path:
    pytester.makeini("[pytest]\n")
    return pytester.path


def test_sigterm_ends_jobs_and_writes_an_interrupted_report(project: Path) -> None:
    proc = _start(project)
    jobs = _job_processes(proc)
    proc.send_signal(signal.SIGTERM)  # to pytest alone, as a CI runner's timeout does
    assert proc.wait(timeout=120) == pytest.ExitCode.INTERRUPTED, _output(project)
    assert _survivors(jobs) == [], _output(project)
    out = _output(project)
    report = json.loads((project / "report" / "report.json").read_text())
    assert report["environment"]["interrupted"] is True
    assert "received SIGTERM" in out
    # The pair in flight is listed (as an error that says so), not silently dropped; its
    # finished control is in the run cache for the next session.
    (pair,) = report["pairs"]
    assert pair["status"] == "error" and "interrupted (received SIGTERM)" in pair["error"]
    assert list(project.glob(".convergence/cache/??/*/manifest.json"))


def test_sigkill_of_pytest_leaves_no_job_behind(project: Path) -> None:
    proc = _start(project)
    jobs = _job_processes(proc)
    proc.kill()  # no handler runs: only the kernel's parent-death signal can end the job
    proc.wait(timeout=60)
    assert _survivors(jobs) == []


def test_sigterm_under_xdist_ends_workers_and_jobs(project: Path) -> None:
    pytest.importorskip("xdist")
    proc = _start(project, "-n", "2")
    jobs = _job_processes(proc)
    os.kill(proc.pid, signal.SIGTERM)  # the controller only; its workers are its children
    proc.wait(timeout=180)
    assert _survivors(jobs, timeout=30) == [], _output(project)
    report = json.loads((project / "report" / "report.json").read_text())
    assert report["environment"]["interrupted"] is True


def test_the_cli_block_turns_sigterm_into_ctrl_c_and_puts_the_default_back() -> None:
    """``convergence ab`` / ``bisect`` run inside sigterm_as_interrupt: a SIGTERM raises
    KeyboardInterrupt there (so worktrees are removed), and the default action is back after."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this session's plugin has one
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"), sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_while_control_jobs_run_at_once_leaves_none(project: Path) -> None:
    """A bf16 twin pair's control, twin and forward twin train together (each supervised by
    its own thread: convergence/run/together.py); SIGTERM reaches pytest's main thread only,
    and every job thread still ends its job's tree."""
    builtin_pair(
        project / "experiments",
        file="forever.toml",
        train_config="debug",
        steps=100000,
        seed=3,
        techniques={"param_dtype": "bfloat16"},
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-again", "parallelism": {"dp_shard": 2}}],
    )
    proc = _spawn_pytest(project)
    training = _await_training(
        project, proc, "control-*", 2, "two control-side jobs never trained at once"
    )
    jobs = _job_processes(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == pytest.ExitCode.INTERRUPTED, _output(project)
    assert _survivors(jobs) == [], _output(project)
    # Each was ended by its own thread (launch/cancel.py), not merely killed with the fork
    # server as pytest exited (that, too, would leave nothing, but a minute later).
    for metrics in training:
        log = (metrics.parent.parent / "logs" / "launcher.log").read_text()
        assert "the job was ended (JobCancelled: " in log, log[-2000:]
