"""Session state of the plugin, kept in ``config.stash`` under a typed key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from convergence.launch.devices import session_devices
from convergence.launch.pool import DeviceSet
from convergence.run.jobs import RunSettings
from convergence.run.outcome import PairOutcome
from convergence.run.session import SessionRunner
from pytest_convergence.options import Options


@dataclass(kw_only=True)
class SessionState:
    """Mutable per-session state (one per pytest process: controller or xdist worker)."""

    options: Options
    settings: RunSettings
    """Run settings shared by every pair of the session (``on_progress`` is set per item)."""
    runner: SessionRunner
    """The process's one Runner (built at its first pair): every pair of this controller or
    xdist worker reuses its device pool, run cache and launcher."""
    share_dir: Path | None = None
    """xdist: folder where workers drop each outcome as JSON for the controller."""
    is_worker: bool = False
    distributed: bool = False
    """xdist controller: tests run in workers, outcomes come back through ``share_dir``."""
    outcomes: list[PairOutcome] = field(default_factory=list)
    """Outcomes of the pairs run in this process."""
    deselected_by_tier: dict[str, int] = field(default_factory=dict)
    """Tier -> number of items deselected because it is above ``--convergence-tier``."""
    report_paths: dict[str, Path] = field(default_factory=dict)
    report_error: str | None = None
    all_outcomes: list[PairOutcome] = field(default_factory=list)
    """Controller, at session finish: every outcome of the session (all workers)."""
    started_at: float = field(default_factory=time.time)
    progress_relay: Any = None
    """xdist controller: the thread printing the workers' progress lines (progress_relay.py)."""
    plots: Any = None
    """With a report: the background thread drawing each pair's plot as its verdict comes in
    (convergence.report.formats.prerender.PlotPrerenderer), built at the first outcome."""
    _devices: DeviceSet | None = None

    @property
    def plot_cache(self) -> Path:
        """Where this session's pair plots are drawn ahead of the report (shared by workers)."""
        return self.settings.work_dir / "plot-cache"

    def device_set(self) -> DeviceSet:
        """The devices of the session (this machine's, or the Slurm allocation's nodes x
        devices; capped by --convergence-devices), for checks at collection. Detected once,
        lazily: importing torch costs seconds, so only sessions with convergence items pay
        it. Raises SlurmError (a SpecError) under the slurm launcher outside an allocation."""
        if self._devices is None:
            self._devices = session_devices(self.options["launcher"], self.options["devices"])
        return self._devices

    def available_devices(self) -> int:
        """How many devices the session's pool holds."""
        return len(self.device_set().devices)


STATE_KEY = pytest.StashKey[SessionState]()


def get_state(config: pytest.Config) -> SessionState:
    return config.stash[STATE_KEY]
