"""Live progress of running jobs on the terminal reporter.

    [fsdp2-tp2 test] step 37/200 loss 3.214 ETA 0:41

On a terminal: one line per running job, redrawn in place (throttled) and erased when the pair
ends. Otherwise (CI logs, pytester): one line per job each ~10% of its steps. The text and
the log throttle are the library's (convergence.launch.progress_text), shared with the CLI.
Under xdist the workers' lines reach the controller's terminal through files
(progress_relay.py). Rank logs never come here; they stay in the run folders.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from convergence.launch.progress_text import LogThrottle, format_progress
from convergence.launch.types import Progress

REDRAW_INTERVAL_S = 0.25


class ProgressPrinter:
    """The ``on_progress`` callback of one pytest item (thread-safe; launchers may call it
    from watcher threads)."""

    def __init__(self, config: pytest.Config) -> None:
        self._reporter: Any = config.pluginmanager.get_plugin("terminalreporter")
        self._capman: Any = config.pluginmanager.get_plugin("capturemanager")
        self._tty = bool(
            self._reporter is not None and self._reporter.isatty() and self._reporter._tw.hasmarkup
        )
        self._lock = threading.Lock()
        self._lines: dict[str, str] = {}
        self._drawn = 0
        self._last_draw = 0.0
        self._throttle = LogThrottle()
        self._column = 0

    @contextlib.contextmanager
    def _uncaptured(self) -> Iterator[None]:
        # Live output must bypass pytest's output capture, as live logging does.
        if self._capman is None:
            yield
            return
        with self._capman.global_and_fixture_disabled():
            yield

    def __call__(self, progress: Progress) -> None:
        if self._reporter is None:
            return
        with self._lock:
            if self._tty:
                self._on_tty(progress)
            else:
                self._on_log(progress)

    def _on_log(self, p: Progress) -> None:
        line = self._throttle.line(p)
        if line is not None:
            self._write_line(line)

    def _write_line(self, line: str) -> None:
        with self._uncaptured():
            if self._reporter.verbosity > 0:
                # -v: pytest then writes the result with its test id again
                # ("experiments/x.toml::fsdp2-tp2 PASSED"): a bare "PASSED" under progress
                # lines would not say which pair it is.
                self._reporter.write_line(line)
                return
            # Default verbosity: reporter.write_line would make pytest forget which file's
            # results the current line holds, so piped output repeated "experiments/x.toml"
            # before every pair. Written under pytest's line, the next "." starts a new line.
            tw = self._reporter._tw
            if tw.width_of_current_line:
                tw.line()
            tw.line(line)

    def _on_tty(self, p: Progress) -> None:
        if p.total_steps and p.step >= p.total_steps:
            self._lines.pop(p.name, None)
        else:
            self._lines[p.name] = format_progress(p)
        now = time.monotonic()
        if now - self._last_draw < REDRAW_INTERVAL_S:
            return
        self._last_draw = now
        with self._uncaptured():
            self._draw()

    def _raw(self, text: str) -> None:
        # Straight to the terminal file: pytest's writer keeps believing the cursor is at the
        # end of its own line, which is where finish() puts it back.
        tw = self._reporter._tw
        file = getattr(tw, "_file", None)
        if file is None:
            tw.write_raw(text, flush=True)
            return
        file.write(text)
        file.flush()

    def _draw(self) -> None:
        tw = self._reporter._tw
        width = max(20, tw.fullwidth - 1)
        out = []
        if self._drawn == 0:
            self._column = tw.width_of_current_line
            out.append("\n")
        elif self._drawn > 1:
            out.append(f"\x1b[{self._drawn - 1}A")
        out.append("\r\x1b[J")
        lines = list(self._lines.values()) or [""]
        out.append("\n".join(line[:width] for line in lines))
        self._drawn = len(lines)
        self._raw("".join(out))

    def finish(self) -> None:
        """Erase the live lines (tty) and put the cursor back at the end of pytest's line."""
        with self._lock:
            if not self._tty or self._drawn == 0:
                return
            right = f"\x1b[{self._column}C" if self._column else ""
            with self._uncaptured():
                self._raw(f"\x1b[{self._drawn}A\r{right}\x1b[J")
            self._drawn = 0
            self._lines.clear()
