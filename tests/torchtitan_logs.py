"""torchtitan's own console step lines from a pytester session's run folders, for the tests
that print them into CI's log (a report section titled ``SHOWN_SECTION``: the project's
conftest.py prints it for passed tests too, also from an xdist worker)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: The report section that conftest.py prints at the end of every session (passed or not).
SHOWN_SECTION = "shown: torchtitan's own step lines"


def step_lines(runs: Path) -> list[str]:
    """torchtitan's console step lines (rank 0 of each job), colours removed."""
    lines = []
    for log in sorted(runs.rglob("ranks/*/attempt_*/0/std*.log")):  # torchrun's per-rank logs
        job = log.parents[5].name  # runs/<pair>/<job>/logs/ranks/.../0/std*.log
        for raw in log.read_text(errors="replace").splitlines():
            line = ANSI.sub("", raw).strip()
            if re.search(r"\bstep:\s+\d+\s+loss:", line):
                lines.append(f"{job}: {line}")
    return lines


def show_step_lines(request: pytest.FixtureRequest, runs: Path) -> list[str]:
    """Attach the step lines under ``runs`` to this test's report (CI's log shows them)."""
    lines = step_lines(runs)
    request.node.add_report_section(
        "call", SHOWN_SECTION, "\n".join(f"[torchtitan on CPU] {line}" for line in lines)
    )
    return lines
