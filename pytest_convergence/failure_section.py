"""How a failed or broken pair reads in pytest's failure section (shared by TOML items and the
``convergence_pair`` fixture). The text itself is the library's
(:mod:`convergence.report.formats.failure_text`), so ``convergence compare`` prints the same words."""

from __future__ import annotations

from pathlib import Path

import pytest

from convergence.report.formats.failure_text import (
    TABLE_AROUND,
    TRACEBACK_HEAD_LINES,
    headline,
    render_outcome,
)
from convergence.run.outcome import PairOutcome

__all__ = [
    "TABLE_AROUND",
    "TRACEBACK_HEAD_LINES",
    "ConvergenceFailure",
    "headline",
    "render_outcome",
]


class ConvergenceFailure(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """Raised by a test whose pair did not pass; carries the outcome for ``repr_failure``.

    A ``pytest.fail`` exception without traceback: the failure section is the rendered
    verdict, not our plumbing's stack.
    """

    __module__ = "builtins"  # short summary reads "ConvergenceFailure: ...", as pytest's Failed

    def __init__(self, outcome: PairOutcome, *, report_dir: Path | None = None) -> None:
        self.outcome = outcome
        super().__init__(render_outcome(outcome, report_dir=report_dir), pytrace=False)
