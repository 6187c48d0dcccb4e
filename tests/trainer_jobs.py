"""Run the built-in trainer as the suite's own jobs: through the local launcher's warm start
(the ranks forked from a fork server that imported torch and the trainer once), the way a
pair's jobs start by default.

Why not a plain ``torchrun`` per run: on the 2-core CI machine a cold start imports torch in
torchrun's agent and in every rank (~2.5 CPU s each; an 8-rank layout pays ~20 CPU s before its
first step), and these tests start ~60 such jobs (issue 48: CI time). What they assert -- a
layout's numbers against the single-process run -- does not depend on how the ranks started;
torchrun's own start stays covered by the launcher tests (tests/test_launch_local.py,
``--convergence-launcher torchrun``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest

REPO = Path(__file__).resolve().parents[1]

# The process's shared fork servers (launch/fork_servers.py: a launcher built without a
# session's): tests/conftest.py ends them after each module, the next job starts one again.
_launcher = LocalLauncher(python=sys.executable)


def run_job(
    nproc: int,
    entry: Sequence[str],
    log_dir: Path,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> None:
    """``python ENTRY`` (``-m module ...`` or ``script ...``) on ``nproc`` ranks (one OpenMP
    thread each), started warm; ``nproc`` 0: one plain process, no rank environment (the
    single-process run, a seed checkpoint), forked too. Fails the test with the failing rank's
    message and traceback."""
    request = LaunchRequest(
        name=log_dir.name,
        entry=list(entry),
        nproc=max(nproc, 1),
        direct=nproc == 0,
        forkable=nproc == 0,
        log_dir=log_dir,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
        cwd=cwd,
        wall_limit_s=timeout,
        idle_limit_s=timeout,
    )
    result = _launcher.launch(request)
    if not result.ok:
        failure = result.failure
        detail = f"{failure.message}\n{failure.traceback[-6000:]}" if failure else ""
        raise AssertionError(f"job {request.name} ({nproc} ranks) ended {result.status}: {detail}")


def run_trainer_job(
    nproc: int,
    args: Sequence[str],
    log_dir: Path,
    *,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> None:
    """``python -m convergence.trainer ARGS``: :func:`run_job`."""
    run_job(nproc, ["-m", "convergence.trainer", *args], log_dir, timeout=timeout, env=env)


def metrics(dump: Path) -> list[dict[str, float]]:
    """The trainer's metrics.jsonl records under ``dump``."""
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
