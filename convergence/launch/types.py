"""What a launcher is asked to do and what it returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

#: Final states of a job.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1"})
"""Rendezvous hosts of a one-node job: its stores are bound to 127.0.0.1 (loopback_torchrun)."""

STATUSES = ("ok", "failed", "timeout", "hung", "stopped_early", "nan", "killed", "interrupted")


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """One job to run under torchrun: ``torchrun [launcher opts] <entry>``."""

    name: str
    """Job name, used in messages and progress lines."""
    entry: Sequence[str]
    """What follows torchrun's own options, e.g. ``["-m", "convergence.trainer", "--config", ...]``
    (an argv list, never a shell string)."""
    nproc: int
    """Processes (ranks) on this node."""
    log_dir: Path
    """Per-job folder: launcher log and one log per rank are written here."""
    metrics_path: Path | None = None
    """What is read live for progress, the watchdog and early stopping: the JSONL file the
    trainer appends a line to per step, or (``metrics_format`` "tensorboard") the folder of its
    TensorBoard event files (convergence.metrics.tb_tail)."""
    metrics_format: str = "jsonl"
    """``jsonl`` or ``tensorboard``: how ``metrics_path`` is read."""
    stop_file: Path | None = None
    """Touching this file asks the trainer to stop cleanly at the next step; None: the trainer
    has no such request, and an early stop ends its processes."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment (e.g. CUDA_VISIBLE_DEVICES from the device pool)."""
    cwd: Path | None = None
    wall_limit_s: float = 3600.0
    """Hard wall-clock limit for the whole job."""
    idle_limit_s: float = 600.0
    """No-progress watchdog: end the job when no new metrics line came for this long."""
    total_steps: int | None = None
    """For progress and ETA."""
    direct: bool = False
    """Run ``entry`` as a plain command (no torchrun), e.g. a seed-checkpoint step."""
    forkable: bool = False
    """A direct command that may start forked from the warm-start server (the local launcher's
    warm start, launch/forkserver.py): one of ours that runs in one process, the seed
    checkpoint. Other direct commands (a trainer that starts its own ranks) start as fresh
    processes: what they set before importing torch must still take effect."""
    warm_imports: tuple[str, ...] = ()
    """Modules the job's ranks import beyond the warm server's own (forkserver.WARM_MODULES),
    imported once by a server of their own (Capabilities.warm_imports: torchtitan's stack costs
    each rank ~3.5 CPU s more than ours). Ignored by a torchrun start."""
    hosts: tuple[str, ...] = ()
    """Nodes the device pool placed the job on (a Slurm allocation); empty: the launcher
    chooses (one machine, or the first nodes of the allocation)."""


@dataclass(frozen=True, kw_only=True)
class FailureInfo:
    """Why a job did not finish normally."""

    message: str
    """One line for the terminal: what happened and, if known, on which rank."""
    rank: int | None = None
    signal: str | None = None
    traceback: str = ""
    """The failing rank's traceback (torchelastic error file or rank log tail)."""
    step: int | None = None
    """Step at which it happened (e.g. the first NaN loss)."""
    node: str | None = None
    """Host the failing rank ran on (torchrun's report; the Slurm launcher names it)."""


@dataclass(frozen=True, kw_only=True)
class JobResult:
    name: str
    status: str
    """One of :data:`STATUSES`."""
    returncode: int | None
    wall_s: float
    log_dir: Path
    metrics_path: Path | None = None
    failure: FailureInfo | None = None
    """Why it did not finish normally; on an ``ok`` result, a rank that died in teardown after
    the last step was logged (the run is complete: see ``launch.failure.finished_then_aborted``).
    """
    last_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "stopped_early")


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A live progress event: the latest metrics line of a running job."""

    name: str
    step: int
    total_steps: int | None
    loss: float | None
    elapsed_s: float
    pace_s: float | None = None
    """Seconds per step over the job's recent steps (:class:`~convergence.launch.watch.JobWatch`
    keeps the window); None until enough steps were seen for it to mean something."""
    note: str = ""
    """A one-off event instead of a step (e.g. ``starting (4 ranks, local launcher)``)."""

    @property
    def eta_s(self) -> float | None:
        """Remaining steps x the recent pace: None without a pace (no guess from step 1)."""
        if not self.total_steps or self.step <= 0:
            return None
        remaining = max(self.total_steps - self.step, 0)
        if remaining == 0:
            return 0.0
        return None if self.pace_s is None else self.pace_s * remaining


#: Called with each new metrics record of a running job; returning True asks it to stop early.
OnMetrics = Callable[[dict[str, float]], bool]
OnProgress = Callable[[Progress], None]


class Launcher(Protocol):
    """Runs one job to completion (or until stopped) and never leaves a process behind."""

    name: str

    def launch(
        self,
        request: LaunchRequest,
        *,
        on_metrics: OnMetrics | None = None,
        on_progress: OnProgress | None = None,
    ) -> JobResult: ...
