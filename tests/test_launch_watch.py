"""JobWatch bookkeeping with a real JSONL file and an explicit clock (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convergence.launch.progress_text import format_progress
from convergence.launch.types import LaunchRequest, Progress
from convergence.launch.watch import JobWatch


def setup(tmp_path: Path, **kw: Any) -> tuple[LaunchRequest, Path]:
    metrics = tmp_path / "m.jsonl"
    req = LaunchRequest(
        name="w", entry=[], nproc=1, log_dir=tmp_path, metrics_path=metrics, total_steps=10, **kw
    )
    return req, metrics


def append(path: Path, *records: dict[str, Any]) -> None:
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_progress_is_throttled_and_events_are_not_steps(tmp_path: Path) -> None:
    req, metrics = setup(tmp_path)
    seen: list[Progress] = []
    watch = JobWatch(req, start=0.0, on_progress=seen.append, progress_interval_s=1.0)
    append(metrics, {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0})
    assert watch.poll(0.1) is None
    append(metrics, {"step": 3, "loss": 1.5}, {"event": "restart"})
    assert watch.poll(0.5) is None  # within 1 s of the last progress event
    assert [p.step for p in seen] == [2]
    assert watch.last_step == 3
    assert watch.poll(1.2) is None
    assert [p.step for p in seen] == [2, 3] and seen[-1].loss == 1.5
    assert seen[-1].eta_s is None  # two steps after the first: too few for an ETA


def test_non_finite_torchtitan_loss_is_nan_verdict_with_step(tmp_path: Path) -> None:
    req, metrics = setup(tmp_path)
    watch = JobWatch(req, start=0.0)
    append(metrics, {"step": 1, "loss_metrics/global_avg_loss": 2.0})
    append(metrics, {"step": 2, "loss_metrics/global_avg_loss": float("inf")})  # "Infinity"
    verdict = watch.poll(0.1)
    assert verdict is not None and verdict.status == "nan"
    assert verdict.failure is not None and verdict.failure.step == 2
    assert "inf" in verdict.failure.message


def test_idle_counts_from_start_and_from_each_line(tmp_path: Path) -> None:
    req, metrics = setup(tmp_path, idle_limit_s=5.0, wall_limit_s=100.0)
    watch = JobWatch(req, start=0.0)
    assert watch.poll(4.9) is None
    append(metrics, {"step": 1, "loss": 1.0})
    assert watch.poll(5.1) is None  # a line just came
    hung = watch.poll(10.2)
    assert hung is not None and hung.status == "hung" and "last step 1" in hung.failure.message


def test_no_metrics_file_means_only_the_wall_limit(tmp_path: Path) -> None:
    req = LaunchRequest(
        name="seed", entry=[], nproc=1, log_dir=tmp_path, idle_limit_s=1.0, wall_limit_s=10.0
    )
    watch = JobWatch(req, start=0.0)
    assert watch.poll(5.0) is None
    late = watch.poll(10.5)
    assert late is not None and late.status == "timeout"


def test_on_metrics_true_asks_to_stop_once(tmp_path: Path) -> None:
    req, metrics = setup(tmp_path)
    calls: list[int] = []

    def decide(record: dict[str, float]) -> bool:
        calls.append(int(record["step"]))
        return record["step"] >= 2

    watch = JobWatch(req, start=0.0, on_metrics=decide)
    append(metrics, *({"step": s, "loss": 1.0} for s in (1, 2, 3)))
    verdict = watch.poll(0.1)
    assert verdict is not None and verdict.status == "stopped_early"
    assert calls == [1, 2] and watch.last_step == 3


def test_a_job_idle_after_its_last_step_is_complete_not_hung(tmp_path: Path) -> None:
    """Every step logged, then no exit (a stopped torchrun agent): the run is kept."""
    req, metrics = setup(tmp_path, idle_limit_s=5.0, wall_limit_s=100.0)
    watch = JobWatch(req, start=0.0)
    append(metrics, *({"step": k, "loss": 1.0 / k} for k in range(1, 11)))
    assert watch.poll(1.0) is None
    verdict = watch.poll(7.0)
    assert verdict is not None and verdict.status == "ok"
    assert verdict.failure is not None and "logged all 10 steps" in verdict.failure.message


def paced(tmp_path: Path, arrivals: list[tuple[float, list[int]]]) -> list[Progress]:
    """Drive a JobWatch with an explicit clock: at each time, the steps that arrived then
    (every arrival is reported: progress_interval_s 0)."""
    metrics = tmp_path / "m.jsonl"
    req = LaunchRequest(
        name="j", entry=[], nproc=1, log_dir=tmp_path, metrics_path=metrics, total_steps=100
    )
    seen: list[Progress] = []
    watch = JobWatch(req, start=0.0, on_progress=seen.append, progress_interval_s=0.0)
    for at, steps in arrivals:
        append(metrics, *({"step": s, "loss": 1.0} for s in steps))
        watch.poll(at)
    return seen


def test_no_eta_until_three_steps_after_the_first_and_never_from_launch(tmp_path: Path) -> None:
    """torchrun's start-up (here 30 s before step 1) must not inflate the ETA, and no ETA is
    guessed from the first steps (the line then shows none, not "ETA ?")."""
    seen = paced(tmp_path, [(30.0 + 0.5 * k, [k + 1]) for k in range(4)])
    assert [p.eta_s for p in seen[:3]] == [None, None, None]
    assert seen[3].step == 4 and seen[3].eta_s == 0.5 * 96  # 0.5 s per step, 96 to go
    assert "ETA" not in format_progress(seen[0])
    assert format_progress(seen[3]).endswith("step 4/100 loss 1 ETA 0:48")


def test_eta_follows_the_recent_pace_not_the_first_slow_steps(tmp_path: Path) -> None:
    """Five 4 s warm-up steps, then 0.5 s steps: once the window holds only fast steps the
    ETA is 0.5 s x the steps left (a pace since step 1 would still say ~1.5 s)."""
    times, t = [], 10.0
    for step in range(1, 31):
        t += 4.0 if step <= 5 else 0.5
        times.append((t, [step]))
    seen = paced(tmp_path, times)
    assert seen[-1].step == 30 and seen[-1].eta_s == 0.5 * 70
    assert seen[-1].pace_s == 0.5


def test_steps_read_in_one_poll_share_a_time_not_a_zero_pace(tmp_path: Path) -> None:
    """Fast steps arrive several per poll: the pace is per poll, never 0 s per step."""
    seen = paced(tmp_path, [(1.0, [1, 2, 3]), (2.0, [4, 5, 6]), (3.0, [7, 8, 9])])
    assert seen[-1].step == 9 and seen[-1].pace_s == 2.0 / 6
    (tmp_path / "one").mkdir()
    assert paced(tmp_path / "one", [(1.0, list(range(1, 20)))])[-1].eta_s is None


def test_launch_announces_the_job_before_torchrun_starts(tmp_path: Path) -> None:
    from convergence.launch.torchrun import LocalLauncher

    script = tmp_path / "quiet.py"
    script.write_text("print('done')\n")
    seen: list[Progress] = []
    req = LaunchRequest(
        name="seed", entry=[str(script)], nproc=1, log_dir=tmp_path / "l", direct=True
    )
    assert LocalLauncher().launch(req, on_progress=seen.append).ok
    assert seen and seen[0].note == "starting (1 process, local launcher)"


def test_the_progress_line_names_the_launcher_chosen(tmp_path: Path) -> None:
    """Issue 52: with `--convergence-launcher torchrun` the line said "local launcher"."""
    from convergence.launch.torchrun import LocalLauncher
    from convergence.run.jobs import _make_launcher

    script = tmp_path / "quiet.py"
    script.write_text("print('done')\n")
    seen: list[Progress] = []
    req = LaunchRequest(
        name="seed", entry=[str(script)], nproc=1, log_dir=tmp_path / "l", direct=True
    )
    launcher = _make_launcher("torchrun")
    assert isinstance(launcher, LocalLauncher)
    assert launcher.launch(req, on_progress=seen.append).ok
    assert seen and seen[0].note == "starting (1 process, torchrun launcher)", seen[0]
