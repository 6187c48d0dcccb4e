"""One Runner per session: ``SessionRunner`` builds it at the first pair and reuses it (device
pool, run cache, launcher) for every later pair; each pair's progress goes to its own sink; a
cache that cannot be opened is an error outcome per pair, as it was when each pair built its
own Runner. A fake launcher writes the curves, so no process is started."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from convergence.launch.types import JobResult, LaunchRequest, Progress
from convergence.preflight import load_checked
from convergence.run import session as session_module
from convergence.run.jobs import JobRunner
from convergence.run.runner import Runner, RunSettings
from convergence.run.session import SessionRunner
from convergence.spec.errors import RunFailed
from convergence.spec.pair import PairSpec
from experiments import command_pair

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


class FakeLauncher:
    """Writes a falling loss curve where the backend reads it; remembers each request."""

    def __init__(self) -> None:
        self.requests: list[LaunchRequest] = []

    def launch(
        self,
        request: LaunchRequest,
        *,
        on_metrics: Callable[[dict[str, float]], bool] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> JobResult:
        self.requests.append(request)
        assert request.metrics_path is not None
        request.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with request.metrics_path.open("w") as log:
            for step in range(1, STEPS + 1):
                log.write(
                    json.dumps({"step": step, "train_loss": 4.0 / step, "gnorm": 1.0 / step}) + "\n"
                )
        if on_progress is not None:
            on_progress(
                Progress(name=request.name, step=STEPS, total_steps=STEPS, loss=1.0, elapsed_s=0.1)
            )
        return JobResult(
            name=request.name,
            status="ok",
            returncode=0,
            wall_s=0.1,
            log_dir=request.log_dir,
            metrics_path=request.metrics_path,
        )


def _pairs(folder: Path) -> list[PairSpec]:
    path = command_pair(
        folder,
        command="true {dump_dir}",
        steps=STEPS,
        tests=[{"name": "a", "early_stop": False}, {"name": "b", "early_stop": False}],
    )
    return list(load_checked(path, rootdir=ROOT).pairs)


def test_one_runner_serves_every_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Runner] = []

    class CountingRunner(Runner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(session_module, "Runner", CountingRunner)
    launcher = FakeLauncher()
    runs = SessionRunner(RunSettings(work_dir=tmp_path / "work", devices=1), launcher=launcher)
    assert not built  # nothing is set up before the first pair
    seen: dict[str, list[str]] = {"a": [], "b": []}
    outcomes = [
        runs.run_pair(pair, on_progress=lambda p, n=pair.test.name: seen[n].append(p.name))
        for pair in _pairs(tmp_path)
    ]
    assert [o.status for o in outcomes] == ["passed", "passed"], [o.error for o in outcomes]
    assert len(built) == 1 and runs.runner() is built[0]
    # The control ran once (the second pair took it from the cache); each test ran once, and
    # each pair's progress reached its own sink only.
    assert [r.name for r in launcher.requests] == ["ddp1 control", "a test", "b test"]
    assert outcomes[1].control is not None and outcomes[1].control.cached
    assert seen == {"a": ["ddp1 control", "a test"], "b": ["b test"]}
    assert built[0].settings.on_progress is None


def test_a_cache_that_cannot_open_is_an_error_per_pair(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache needs a folder")
    runs = SessionRunner(
        RunSettings(work_dir=tmp_path / "work", cache_dir=blocker, devices=1),
        launcher=FakeLauncher(),
    )
    pairs = _pairs(tmp_path)
    first = runs.run_pair(pairs[0])
    assert first.status == "error" and first.error and "is a file" in first.error
    blocker.unlink()  # fixed between pairs: the next pair builds the Runner
    assert runs.run_pair(pairs[1]).status == "passed"


def test_a_bug_inside_the_runner_is_an_error_outcome_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception (a bug of ours, not a job failure) must not drop the pair from
    the session's outcomes and report: it becomes an error that says so, traceback kept."""

    def broken(self: Runner, pair: PairSpec, jobs: JobRunner) -> Any:
        raise TypeError("planted bug")

    monkeypatch.setattr(Runner, "_run_pair", broken)
    runner = Runner(RunSettings(work_dir=tmp_path / "work", devices=1), launcher=FakeLauncher())
    outcome = runner.run_pair(_pairs(tmp_path)[0])
    assert outcome.status == "error" and outcome.error is not None
    assert "internal error in pytest-convergence" in outcome.error
    assert "TypeError: planted bug" in outcome.error
    saved = next((tmp_path / "work" / "runs").glob("*/internal_error.txt"))
    assert "raise TypeError" in saved.read_text() and str(saved) in outcome.error


def test_a_run_failure_past_the_runner_is_an_error_with_its_message_not_a_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RunFailed (the run failed, the input was fine) is the pair's error in its own words:
    not an internal error, no traceback file."""

    def failing(self: Runner, pair: PairSpec, jobs: JobRunner) -> Any:
        raise RunFailed("the trainer wrote no metrics file at /somewhere/metrics.jsonl")

    monkeypatch.setattr(Runner, "_run_pair", failing)
    runner = Runner(RunSettings(work_dir=tmp_path / "work", devices=1), launcher=FakeLauncher())
    outcome = runner.run_pair(_pairs(tmp_path)[0])
    assert outcome.status == "error"
    assert outcome.error == "the trainer wrote no metrics file at /somewhere/metrics.jsonl"
    assert not list((tmp_path / "work").glob("runs/*/internal_error.txt"))


def test_a_job_larger_than_the_pool_is_an_error_that_names_the_fix_not_a_bug(
    tmp_path: Path,
) -> None:
    """A library caller (no plugin preflight in front) whose test needs more devices than
    the pool has gets the pool's own message -- how many, and --convergence-devices -- as
    the pair's error, not "internal error ... please report it"."""
    path = command_pair(
        tmp_path,
        command="true {dump_dir}",
        steps=STEPS,
        tests=[{"name": "wide", "early_stop": False, "parallelism": {"tp": 2}}],
    )
    pair = load_checked(path, rootdir=ROOT).pairs[0]
    runner = Runner(RunSettings(work_dir=tmp_path / "work", devices=1), launcher=FakeLauncher())
    outcome = runner.run_pair(pair)
    assert outcome.status == "error" and outcome.error is not None
    assert "internal error" not in outcome.error
    assert "needs 2" in outcome.error and "--convergence-devices 2" in outcome.error
    assert not list((tmp_path / "work").glob("runs/*/internal_error.txt"))
