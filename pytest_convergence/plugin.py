"""pytest-convergence: the pytest plugin (entry point ``pytest11: convergence``).

Hooks only translate pytest concepts into library calls; the work lives in ``convergence``.
Split by role: options, collection (TOML pairs), fixtures (Python API), progress (live lines),
reporting (matrix, JUnit properties, report files), xdist (workers), stash (session state).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from convergence.options import run_settings
from convergence.rank.rounding_draw import ROUNDING_DRAW_ENV, RoundingDrawError, rounding_draw
from convergence.run.session import SessionRunner
from pytest_convergence.collection import (
    MARKER_HELP,
    ConvergenceItem,
    ExperimentFile,
    add_convergence_paths,
    collect_file,
    mark_and_deselect,
    tier_note,
)
from pytest_convergence.fixtures import convergence_pair
from pytest_convergence.options import add_options, read_options
from pytest_convergence.progress_relay import ProgressRelay
from pytest_convergence.reporting import session_finish, terminal_summary
from pytest_convergence.signals import interrupt_on_sigterm, restore_sigterm
from pytest_convergence.stash import STATE_KEY, SessionState
from pytest_convergence.xdist import (
    is_distributing,
    is_worker,
    pytest_configure_node,
    pytest_xdist_auto_num_workers,
    worker_share_dir,
)

__all__ = [
    "ConvergenceItem",
    "ExperimentFile",
    "convergence_pair",
    "pytest_configure_node",
    "pytest_xdist_auto_num_workers",
]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_convergence import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    add_convergence_paths(config)  # -m convergence must see convergence_paths (testpaths)
    interrupt_on_sigterm(forward_to_workers=is_distributing(config))
    options = read_options(config)
    session_rounding_draw()  # a bad value is a usage error before anything runs
    worker = is_worker(config)
    share_dir = (
        worker_share_dir(config)
        if worker
        else (options["workdir"] / "sessions" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    )
    settings = run_settings(options.values, work_dir=options["workdir"])
    config.stash[STATE_KEY] = SessionState(
        options=options,
        settings=settings,
        runner=SessionRunner(settings),
        share_dir=share_dir,
        is_worker=worker,
        distributed=is_distributing(config),
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    options = config.stash[STATE_KEY].options
    lines = [f"convergence: run state in {options['workdir']}"]
    if options["report"] is not None:
        lines.append(f"convergence: report to {options['report']}")
    if draw := session_rounding_draw():
        lines.append(
            f"convergence: rounding draw {draw} ({ROUNDING_DRAW_ENV}): every job rounds as another machine would"
        )
    return lines


def pytest_unconfigure(config: pytest.Config) -> None:
    restore_sigterm()
    state = config.stash.get(STATE_KEY, None)
    if state is not None:
        state.runner.close()  # the session's fork servers end with it


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    return collect_file(file_path, parent)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: fixture users must carry the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_and_deselect(config, items)


def pytest_report_collectionfinish(
    config: pytest.Config, start_path: Path, items: list[pytest.Item]
) -> list[str]:
    note = tier_note(config)
    return [note] if note else []


def pytest_sessionstart(session: pytest.Session) -> None:
    state = session.config.stash[STATE_KEY]
    if state.distributed and state.share_dir is not None:
        state.progress_relay = ProgressRelay(session.config, state.share_dir)
        state.progress_relay.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    relay = session.config.stash[STATE_KEY].progress_relay
    if relay is not None:
        relay.stop()
    session_finish(session, exitstatus)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    terminal_summary(terminalreporter, config)


def session_rounding_draw() -> int:
    """The session's emulated rounding draw (convergence/rank/rounding_draw.py)."""
    try:
        return rounding_draw()
    except RoundingDrawError as exc:
        raise pytest.UsageError(str(exc)) from None
