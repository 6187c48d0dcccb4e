"""Every kind of job starts warm, and a pair's control-side jobs run at once (issue 39).

- The seed checkpoint (a direct, one-process job) is forked from the fork server as the
  training jobs are, and holds the very weights a fresh process writes.
- The probe jobs and the two jobs of a resuming side start warm too (each job's
  ``launcher.log`` says so in the agent's own words).
- A bf16 twin pair's control, noise twin and forward twin (8 ranks in all) run at once on the
  default 8-slot pool, one after another with ``concurrent_controls`` off; the verdicts and
  every curve are the same both ways.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from convergence.launch.types import Progress
from convergence.preflight import load_checked
from convergence.run.jobs import JobRunner, RunSettings
from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]
WARM_AGENT = "# warm agent: "
"""The first words the warm agent itself writes into a job's launcher.log (launch/warm_agent.py):
proof the job's processes were forked from the fork server, not merely that it was asked."""


def _launcher_logs(work: Path) -> dict[str, str]:
    return {
        str(path.relative_to(work)): path.read_text(errors="replace")
        for path in sorted(work.rglob("logs/launcher.log"))
    }


def _job_logs(work: Path) -> list[str]:
    """The jobs' logs in their run folders (a cached run's folder is copied into the cache, the
    seed checkpoint's build folder moved there)."""
    return [name for name in _launcher_logs(work) if name.startswith("runs/")]


def _cold_logs(work: Path) -> list[str]:
    return [name for name, text in _launcher_logs(work).items() if WARM_AGENT not in text]


def test_the_seed_checkpoint_starts_warm_and_holds_a_fresh_processs_weights(
    tmp_path: Path,
) -> None:
    path = builtin_pair(tmp_path, steps=2, seed=7)
    pair = load_checked(path, rootdir=tmp_path).pairs[0]
    runner = JobRunner(RunSettings(work_dir=tmp_path / "work"))
    seed_dir = runner.prepare(pair.control).seed_dir
    assert seed_dir is not None
    log = (seed_dir.parent / "logs" / "launcher.log").read_text()
    assert "# warm start: 1 process forked" in log and WARM_AGENT in log, log

    fresh = tmp_path / "fresh"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.trainer",
            "--config",
            str(ROOT / "train_configs" / "debug.toml"),
            "--training.seed=7",
            "--checkpoint.create_seed_checkpoint=true",
            f"--checkpoint.seed_checkpoint={fresh}",
            f"--metrics.dump_folder={tmp_path / 'creator'}",
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    warm_sha = (seed_dir / "sha256.txt").read_text()
    assert warm_sha == (fresh / "sha256.txt").read_text()  # the state dict's content hash


def test_probe_and_resume_jobs_start_warm(tmp_path: Path) -> None:
    path = builtin_pair(
        tmp_path,
        steps=4,
        seed=5,
        early_stop=False,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {"name": "probed", "parallelism": {"dp_replicate": 2}, "probe": "always"},
            {"name": "resumed", "parallelism": {"dp_shard": 2}, "resume": {"at_step": 2}},
        ],
    )
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=180, wall_limit_s=600))
    for pair in load_checked(path, rootdir=tmp_path).pairs:
        outcome = runner.run_pair(pair)
        assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    jobs = _job_logs(tmp_path / "work")
    assert len([name for name in jobs if "/probe" in name]) == 2, jobs  # one per side
    # control (run once, then cached), probed test, 2 probes, 2 resume phases
    assert len(jobs) == 6, jobs
    assert _cold_logs(tmp_path / "work") == []  # and the seed checkpoint's, in the cache


# -- a twin pair's control-side jobs at once ---------------------------------------------------


class _Intervals:
    """When each job started and last reported, from the launcher's progress events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: dict[str, list[float]] = {}

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        with self._lock:
            span = self.spans.setdefault(progress.name, [now, now])
            span[1] = now

    def control_side(self) -> dict[str, tuple[float, float]]:
        return {
            name: (span[0], span[1])
            for name, span in self.spans.items()
            if name.endswith(" control")
        }


def _overlaps(spans: dict[str, tuple[float, float]]) -> list[tuple[str, str]]:
    names = sorted(spans)
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    ]


def _twin_pair(tmp_path: Path) -> Path:
    return builtin_pair(
        tmp_path,
        file="twin.toml",
        steps=3,
        seed=42,
        early_stop=False,
        probe="off",
        techniques={"param_dtype": "bfloat16"},
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-again", "parallelism": {"dp_shard": 2}}],
    )


def _run_twin(tmp_path: Path, work: str, *, together: bool) -> tuple[PairOutcome, _Intervals]:
    pair = load_checked(_twin_pair(tmp_path), rootdir=tmp_path).pairs[0]
    assert pair.regime == "twin"
    intervals = _Intervals()
    settings = RunSettings(
        work_dir=tmp_path / work,
        idle_limit_s=300,
        wall_limit_s=900,
        concurrent_controls=together,
        on_progress=intervals,
    )
    runner = Runner(settings)
    assert runner.jobs.pool.size == 8  # the default CPU pool: room for 2 + 4 + 2 ranks at once
    outcome = runner.run_pair(pair)
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    return outcome, intervals


TIMINGS = frozenset({"wall_s", "tokens_per_s", "peak_mem_mib"})
"""Logged values that measure the run rather than result from it."""


def _curves(outcome: PairOutcome) -> dict[str, dict[str, list[float]]]:
    assert outcome.control is not None and outcome.test is not None
    runs = {"control": outcome.control.metrics, "test": outcome.test.metrics}
    runs |= {f"twin{i}": twin for i, twin in enumerate(outcome.control.twins)}
    return {
        side: {
            name: np.asarray(curve.values).tolist()
            for name, curve in metrics.items()
            if name not in TIMINGS
        }
        for side, metrics in runs.items()
    }


def test_a_twin_pairs_control_jobs_run_at_once_with_the_same_verdict(tmp_path: Path) -> None:
    together, spans_together = _run_twin(tmp_path, "together", together=True)
    apart, spans_apart = _run_twin(tmp_path, "apart", together=False)

    # control, noise twin (FSDP over 4, half the local batch), forward-noise twin
    assert len(spans_together.control_side()) == len(spans_apart.control_side()) == 3
    assert _overlaps(spans_together.control_side()), spans_together.control_side()
    assert _overlaps(spans_apart.control_side()) == [], spans_apart.control_side()

    assert len(together.control.twins) == 2  # type: ignore[union-attr]
    assert _curves(together) == _curves(apart)  # bitwise: every logged value of every job
    assert [(v.metric, v.passed, v.message) for v in together.verdicts if v.gate] == [
        (v.metric, v.passed, v.message) for v in apart.verdicts if v.gate
    ]
    for work in ("together", "apart"):  # 3 control-side jobs, test, seed: all forked warm
        assert len(_job_logs(tmp_path / work)) == 4
        assert _cold_logs(tmp_path / work) == []


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_job_of_a_group_is_raised_after_the_others_ended(
    tmp_path: Path, failing: int
) -> None:
    from convergence.run.together import run_together

    ended: list[int] = []

    def call(i: int) -> int:
        time.sleep(0.2 * (1 - i))  # the first call ends last
        ended.append(i)
        if i == failing:
            raise ValueError(f"job {i} failed")
        return i

    with pytest.raises(ValueError, match=f"job {failing} failed"):
        run_together([lambda i=i: call(i) for i in range(2)])
    assert sorted(ended) == [0, 1]  # the other job was not abandoned
    assert run_together([lambda i=i: i * 10 for i in range(3)]) == [0, 10, 20]
