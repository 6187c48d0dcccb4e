"""Progress under pytest-xdist: workers write lines to files, the controller prints them.

An xdist worker's output never reaches the user's terminal (only test results travel back), so
a session with ``-n 2`` showed nothing but dots for minutes while jobs trained. Each worker
appends its throttled progress lines (the same as a non-tty log shows) to
``<session>/progress/<worker>.log``; a thread in the controller prints every new complete line,
prefixed with the worker's id, and a last pass at session end prints whatever is left.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from convergence.launch.progress_text import LogThrottle
from convergence.launch.types import Progress

PROGRESS_DIR = "progress"
POLL_S = 0.5


class WorkerProgress:
    """``on_progress`` of an item run by an xdist worker: lines into this worker's file."""

    def __init__(self, share_dir: Path) -> None:
        self._worker = os.environ.get("PYTEST_XDIST_WORKER", "worker")
        self._path = share_dir / PROGRESS_DIR / f"{self._worker}.log"
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._throttle = LogThrottle()
        self._lock = threading.Lock()

    def __call__(self, progress: Progress) -> None:
        line = self._throttle.line(progress)
        if line is None:
            return
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(f"[{self._worker}] {line}\n")  # one write: the reader sees whole lines

    def finish(self) -> None:
        """Nothing to erase: a log only grows."""


class ProgressRelay:
    """Controller: print the workers' new progress lines on the terminal."""

    def __init__(self, config: pytest.Config, share_dir: Path) -> None:
        self._reporter: Any = config.pluginmanager.get_plugin("terminalreporter")
        self._folder = share_dir / PROGRESS_DIR
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="convergence-progress", daemon=True)

    def start(self) -> None:
        self._folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and print what is left (lines written just before the end)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.pump()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - progress display only: never end the session
                pass

    def pump(self) -> None:
        with self._lock:
            for path in sorted(self._folder.glob("*.log")) if self._folder.is_dir() else []:
                for line in self._new_lines(path):
                    self._write(line)

    def _new_lines(self, path: Path) -> list[str]:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self._offsets[path] = offset + len(complete)
        return complete.decode("utf-8", errors="replace").splitlines()

    def _write(self, line: str) -> None:
        if self._reporter is None:
            return
        tw = self._reporter._tw
        if tw.width_of_current_line:
            tw.line()
        tw.line(line)
