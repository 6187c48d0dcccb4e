"""Naming the hung rank (convergence/launch/hang.py): real gloo ranks, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from convergence.launch.hang import describe_hang
from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "fixtures" / "hang" / "worker.py"


def test_the_rank_stuck_outside_a_collective_is_named_with_its_line(tmp_path: Path) -> None:
    """Rank 1 loops in its own code while rank 0 waits in all_reduce: the hung message names
    rank 1 and the function it is stuck in, and says rank 0 waits in a collective."""
    metrics = tmp_path / "metrics.jsonl"
    # The idle limit counts from the ranks' start (a warm start: forked with torch imported).
    request = LaunchRequest(
        name="hang",
        entry=[str(WORKER), str(metrics)],
        nproc=2,
        log_dir=tmp_path / "logs",
        metrics_path=metrics,
        total_steps=3,
        idle_limit_s=20.0,
        env={"PYTHONPATH": str(REPO)},
    )
    result = LocalLauncher(kill_grace_s=2.0).launch(request)
    assert result.status == "hung", result
    assert result.failure is not None
    message = result.failure.message
    if result.last_step is None:  # torchrun did not even reach step 1 within the limit
        return
    assert "rank 1 is not in a collective" in message, message
    assert "worker.py" in message and "stuck_in_user_code" in message, message
    assert "rank 0 waits in a collective" in message, message


def test_a_stopped_rank_is_named(tmp_path: Path) -> None:
    """A rank stopped by SIGSTOP (or a debugger) is named by its process state alone."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "RANK": "3", "LOCAL_RANK": "1"},
    )
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        ps = psutil.Process(proc.pid)
        # The state turns to "stopped" only when the child is next scheduled: on a loaded
        # 2-core box that can take a while, so really wait (psutil.wait_procs([]) returns at
        # once and made this loop 100 instant reads: the CI flake of run 879a958).
        deadline = time.monotonic() + 30
        while ps.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ps.status() == psutil.STATUS_STOPPED, "the child never stopped"
        text = describe_hang([ps], tmp_path)
        assert text == f"rank 3 (pid {proc.pid}) is stopped (SIGSTOP or a debugger)"
    finally:
        proc.kill()
        proc.wait()


def test_a_process_without_the_dump_handler_is_not_signalled(tmp_path: Path) -> None:
    """SIGUSR1 kills a process that does not catch it: such ranks are left alone, and nothing
    is claimed about them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "RANK": "0", "LOCAL_RANK": "0"},
    )
    try:
        assert describe_hang([psutil.Process(proc.pid)], tmp_path) == ""
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
