"""Live TensorBoard metrics (convergence.metrics.tb_tail): real event files from the writers
that produce them (torchtitan 0.3.0's TensorBoardLogger, torch's SummaryWriter), read while
the writer is still open, through JobWatch and through a real launched process."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest, Progress
from convergence.launch.watch import JobWatch
from convergence.metrics.tb_tail import TensorBoardTail

pytest.importorskip("tensorboard")
LOSS = "loss_metrics/global_avg_loss"
#: What torchtitan logs per step (a subset of its tags, in its order).
STEP_TAGS = (LOSS, "loss_metrics/global_max_loss", "grad_norm", "lr/AdamW", "throughput(tps)")
WAIT_S = 60.0
"""A deadline for the writer thread to reach the file, not a timing assertion."""


def step_metrics(step: int, loss: float | None = None) -> dict[str, float]:
    loss = 3.0 - step / 100 if loss is None else loss
    return {
        LOSS: loss,
        "loss_metrics/global_max_loss": loss + 0.1,
        "grad_norm": 0.5,
        "lr/AdamW": 8e-4,
        "throughput(tps)": 1000.0,
    }


def poll_until(tail: TensorBoardTail, last_step: int) -> list[dict[str, Any]]:
    """Poll until ``last_step`` was returned (the writer thread appends asynchronously)."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while not seen or seen[-1]["step"] < last_step:
        seen += tail.poll()
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return seen


def test_torchtitans_logger_is_read_while_it_is_open(tmp_path: Path) -> None:
    """torchtitan's TensorBoardLogger (SummaryWriter(max_queue=1000), flush_secs=120) is never
    flushed or closed here, yet each step is on disk and complete for the tail."""
    metrics = pytest.importorskip("torchtitan.components.metrics")
    logger = metrics.TensorBoardLogger(str(tmp_path / "tb" / "20260101-0000"))
    try:
        tail = TensorBoardTail(tmp_path / "tb")
        for step in (1, 2, 3):
            logger.log(step_metrics(step), step)
        seen = poll_until(tail, 3)
        # Step 3 is complete without a step 4: it holds every tag step 2 held.
        assert [r["step"] for r in seen] == [1, 2, 3]
        assert seen[0][LOSS] == pytest.approx(2.99, abs=1e-6)  # float32, as the final read
        assert set(STEP_TAGS) <= seen[2].keys()
        logger.log(step_metrics(4), 4)
        assert [r["step"] for r in poll_until(tail, 4)] == [4]
    finally:
        logger.close()


def write_steps(folder: Path, steps: dict[int, dict[str, float]]) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, values in steps.items():
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    return next(folder.glob("events.out.tfevents.*"))


def test_a_half_written_record_and_a_half_logged_step_wait(tmp_path: Path) -> None:
    source = write_steps(tmp_path / "src", {1: step_metrics(1), 2: step_metrics(2)})
    data = source.read_bytes()
    live = tmp_path / "live" / "events.out.tfevents.1.host"
    live.parent.mkdir()
    cut = len(data) - 10  # inside step 2's last record
    live.write_bytes(data[:cut])
    tail = TensorBoardTail(tmp_path / "live")
    # Step 1 is complete (step 2 began); step 2 lacks a tag step 1 had: it waits.
    assert [r["step"] for r in tail.poll()] == [1]
    assert tail.poll() == []
    with live.open("ab") as f:
        f.write(data[cut:])
    assert [r["step"] for r in tail.poll()] == [2]
    assert tail.drain() == []


def test_the_last_partial_step_comes_with_drain_and_relogged_steps_are_left(tmp_path: Path) -> None:
    write_steps(tmp_path / "tb", {1: step_metrics(1), 2: step_metrics(2), 3: {LOSS: 2.97}})
    tail = TensorBoardTail(tmp_path / "tb")
    assert [r["step"] for r in tail.poll()] == [1, 2]
    last = tail.drain()
    assert [r["step"] for r in last] == [3] and set(last[0]) == {"step", LOSS}


def test_pipeline_placeholder_ranks_are_skipped(tmp_path: Path) -> None:
    """PP: the non-last stages log -1.0 as their loss; the tail follows the real one."""
    run = tmp_path / "tb" / "20260101-0000"
    write_steps(run / "rank_0", {s: step_metrics(s, loss=-1.0) for s in (1, 2, 3)})
    write_steps(run / "rank_1", {s: step_metrics(s) for s in (1, 2, 3)})
    records = TensorBoardTail(tmp_path / "tb").drain()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r[LOSS] > 0 for r in records)
    # Only placeholder ranks so far: nothing, rather than -1.0 as a loss.
    only = tmp_path / "pp0" / "rank_0"
    write_steps(only, {s: step_metrics(s, loss=-1.0) for s in (1, 2)})
    assert TensorBoardTail(tmp_path / "pp0").drain() == []


def test_jobwatch_reads_tensorboard_progress_nan_and_idle(tmp_path: Path) -> None:
    """Progress and the NaN verdict from event files; the idle limit only after step 1."""
    seen: list[Progress] = []
    request = LaunchRequest(
        name="tt",
        entry=[],
        nproc=1,
        log_dir=tmp_path,
        total_steps=10,
        metrics_path=tmp_path / "tb",
        metrics_format="tensorboard",
        idle_limit_s=5.0,
        wall_limit_s=1000.0,
    )
    watch = JobWatch(request, start=0.0, on_progress=seen.append, progress_interval_s=0.0)
    assert watch.poll(100.0) is None  # start-up longer than the idle limit: not hung
    write_steps(
        tmp_path / "tb", {1: step_metrics(1), 2: step_metrics(2), 3: step_metrics(3, loss=math.nan)}
    )
    verdict = watch.poll(101.0)
    assert verdict is not None and verdict.status == "nan" and verdict.failure is not None
    assert verdict.failure.step == 3
    assert [p.step for p in seen] == [3] and seen[0].loss is not None


WRITER = """
import sys, time
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter(sys.argv[1], max_queue=1000)  # torchtitan's settings
for step in range(1, 6):
    for tag, value in (("loss_metrics/global_avg_loss", 3.0 - step / 100), ("grad_norm", 0.5)):
        writer.add_scalar(tag, value, step)
time.sleep(600)  # never ends by itself: only the early stop (or the wall limit) ends it
"""


def test_an_early_stop_ends_a_tensorboard_job_without_a_stop_file(tmp_path: Path) -> None:
    """torchtitan has no stop request: the launcher ends the job's processes at once."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    steps: list[int] = []

    def decide(record: dict[str, Any]) -> bool:
        steps.append(int(record["step"]))
        return record["step"] >= 3

    request = LaunchRequest(
        name="tt",
        entry=[str(script), str(tmp_path / "tb")],
        nproc=1,
        log_dir=tmp_path / "logs",
        metrics_path=tmp_path / "tb",
        metrics_format="tensorboard",
        total_steps=5,
        direct=True,
        wall_limit_s=300.0,
        idle_limit_s=300.0,
    )
    result = LocalLauncher(python=sys.executable).launch(request, on_metrics=decide)
    assert result.status == "stopped_early"
    assert steps[:3] == [1, 2, 3]  # a wall-limit end would read "timeout"
