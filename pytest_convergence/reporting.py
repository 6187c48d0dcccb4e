"""End of session: gather every outcome (all xdist workers), write the report files once
(controller only; also after Ctrl-C, as a partial report), print the matrix."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from convergence.run.outcome import PairOutcome
from pytest_convergence.execute import OUTCOME_SUFFIX, load_outcomes
from pytest_convergence.stash import get_state

KEEP_SESSIONS = 20
"""Session folders (outcome JSON, input of ``convergence report --from``) kept in the workdir."""


def environment(config: pytest.Config, *, interrupted: bool) -> dict[str, Any]:
    from convergence.report.data.schema import default_environment  # lazy: plugin start-up

    state = get_state(config)
    return {
        **default_environment(),
        "pytest": pytest.__version__,
        "args": list(config.invocation_params.args),
        "launcher": state.options["launcher"],
        "devices_option": state.options["devices"],
        "tier": state.options["tier"],
        "xdist_workers": os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
        "interrupted": interrupted,
    }


def gather_outcomes(config: pytest.Config) -> list[PairOutcome]:
    """This process's outcomes, or (xdist controller) the ones the workers saved."""
    state = get_state(config)
    if state.distributed and state.share_dir is not None and state.share_dir.is_dir():
        return load_outcomes(state.share_dir)
    return list(state.outcomes)


def _prune_sessions(current: Path | None) -> None:
    if current is None or not current.parent.is_dir():
        return
    sessions = sorted(
        (p for p in current.parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    for old in sessions[:-KEEP_SESSIONS]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def session_finish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    config = session.config
    state = get_state(config)
    if state.plots is not None:  # a worker's plots must be drawn before the controller reports
        state.plots.wait()
    if state.is_worker:
        return
    state.all_outcomes = gather_outcomes(config)
    if state.share_dir is not None and any(state.share_dir.glob(f"*{OUTCOME_SUFFIX}")):
        _prune_sessions(state.share_dir)
    report_dir = state.options["report"]
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
    # An interrupted session writes its report even with no pair finished: the record that it
    # was interrupted (SIGTERM from scancel or a CI timeout, Ctrl-C) is what a reviewer needs.
    if report_dir is None or not (state.all_outcomes or interrupted):
        return
    try:
        _write(config, report_dir, interrupted=interrupted)
    except Exception as exc:  # noqa: BLE001 - a broken report must not hide the test results
        state.report_error = f"{type(exc).__name__}: {exc}"


def _write(config: pytest.Config, report_dir: Path, *, interrupted: bool) -> None:
    from convergence.report import write_reports, write_step_summary  # lazy: plugin start-up

    state = get_state(config)
    state.report_paths = dict(
        write_reports(
            state.all_outcomes,
            report_dir,
            environment=environment(config, interrupted=interrupted),
            started_at=state.started_at,
            wall_s=time.time() - state.started_at,
            plot_cache=state.plot_cache,
        )
    )
    _prune_plot_cache(state.plot_cache, state.all_outcomes)
    markdown = state.report_paths.get("markdown")
    if markdown is not None:
        summary = write_step_summary(markdown.read_text(encoding="utf-8"))
        if summary is not None:
            state.report_paths["step summary"] = summary


def _prune_plot_cache(folder: Path, used: list[PairOutcome], keep_s: float = 86400.0) -> None:
    """Plots drawn ahead of a report are copied into it: drop the ones this report used, and
    any older than a day (left by a session that wrote no report; another session sharing the
    workdir that misses one only draws it again)."""
    from convergence.report.formats.plot_cache import cached_plot  # lazy: plugin start-up

    for outcome in used:
        path = cached_plot(folder, outcome)
        if path is not None:
            path.unlink(missing_ok=True)
    cutoff = time.time() - keep_s
    for png in folder.glob("*.png"):
        try:
            if png.stat().st_mtime < cutoff:
                png.unlink()
        except OSError:
            pass


def terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = get_state(config)
    if state.is_worker or not state.all_outcomes:
        return
    from convergence.report.formats.terminal import (  # lazy: plugin start-up
        not_compared_lines,
        render_summary,
    )

    tr = terminalreporter
    count = len(state.all_outcomes)
    tr.write_sep("=", f"convergence matrix ({count} pair{'' if count == 1 else 's'})")
    for line in render_summary(state.all_outcomes, not_compared=False).rstrip("\n").splitlines():
        tr.write_line(line)
    for line in not_compared_lines(state.all_outcomes):
        tr.write_line(line, yellow=True)
    if state.report_error:
        tr.write_line(f"convergence: writing the reports failed: {state.report_error}", red=True)
    if state.report_paths:
        tr.write_line("reports:")
        for kind, path in sorted(state.report_paths.items()):
            tr.write_line(f"  {kind}: {path}")
    if state.share_dir is not None and state.share_dir.is_dir():
        tr.write_line(
            f"outcomes saved in {state.share_dir} "
            f"(rebuild reports: convergence report --from {state.share_dir} --out DIR)"
        )
