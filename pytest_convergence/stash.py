"""Session state of the plugin, kept in ``config.stash`` under a typed key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from convergence.launch.pool import detect_devices
from convergence.run.outcome import PairOutcome
from convergence.run.runner import RunSettings
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
    _devices: int | None = None
    _devices_known: bool = False

    def available_devices(self) -> int | None:
        """Devices a single job may use, for checks at collection (detected once, lazily:
        importing torch costs seconds, so only sessions with convergence items pay it)."""
        if not self._devices_known:

            self._devices = len(detect_devices(self.options.devices).devices)
            self._devices_known = True
        return self._devices


STATE_KEY = pytest.StashKey[SessionState]()


def get_state(config: pytest.Config) -> SessionState:
    return config.stash[STATE_KEY]
