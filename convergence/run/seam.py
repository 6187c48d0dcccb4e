"""The job floor's seam: what the numerics probe (and any other user of cached, pooled
launches) needs of the session's Runner, as a Protocol. Typing against it instead of the Runner
keeps run/probe.py below run/runner.py, which calls the probe (no import cycle, not even one
for typing)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from convergence.backends import Backend
from convergence.launch.types import JobResult, LaunchRequest
from convergence.run.outcome import SideOutcome
from convergence.spec.job import JobSpec

T = TypeVar("T")


class JobSeam(Protocol):
    """convergence.run.runner.Runner's public job methods (see their docstrings there)."""

    @property
    def session_id(self) -> str:
        """Identifies the session (a run-cache entry made by it is reused under --refresh)."""
        ...

    def launch_request(
        self,
        name: str,
        entry: Sequence[str],
        *,
        nproc: int,
        log_dir: Path,
        watch_idle: bool = True,
        in_job_context: bool = False,
        metrics_path: Path | None = None,
        metrics_format: str = "jsonl",
        stop_file: Path | None = None,
        total_steps: int | None = None,
        direct: bool = False,
    ) -> LaunchRequest: ...

    def launch(
        self,
        request: LaunchRequest,
        world_size: int,
        on_metrics: Callable[[dict[str, float]], bool] | None = None,
    ) -> JobResult: ...

    def seed_checkpoint(self, job: JobSpec, backend: Backend) -> Path | None: ...

    def job_key(self, job: JobSpec, backend: Backend, seed_dir: Path | None) -> str: ...

    def run_job(
        self,
        side: str,
        job: JobSpec,
        *,
        pair_dir: Path,
        cacheable: bool,
        on_metrics: Callable[[dict[str, float]], bool] | None = None,
    ) -> SideOutcome: ...

    def cached_run(
        self,
        key: str,
        produce: Callable[[], Path],
        *,
        usable: Callable[[Path], bool],
        read: Callable[[Path, bool], T],
    ) -> T: ...
