"""A torchtitan pytester session (``pytest -m convergence`` on experiment files, in a
subprocess, the planted-bug hooks importable) and torchtitan's own console step lines from its
run folders, printed into CI's log (a report section titled ``SHOWN_SECTION``: the project's
conftest.py prints it for passed tests too, also from an xdist worker)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from experiments import write_toml

HOOKS = Path(__file__).resolve().parent / "fixtures" / "hooks"
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


def run_experiments(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    experiments: dict[str, dict[str, Any]],
    *,
    timeout: float,
) -> tuple[pytest.RunResult, list[str], Path]:
    """Write ``experiments`` (file name -> experiment document) under experiments/, run the
    convergence session on them (work folder ``work/``), show torchtitan's step lines in this
    test's report; returns the result, those lines and the work folder."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p),
    )
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makeini("[pytest]\n")
    for name, doc in experiments.items():
        write_toml(pytester.path / "experiments" / name, doc)
    work = pytester.path / "work"
    result = pytester.runpytest_subprocess(
        "-m",
        "convergence",
        "-p",
        "no:cacheprovider",
        f"--convergence-workdir={work}",
        *(f"experiments/{name}" for name in experiments),
        timeout=timeout,
    )
    return result, show_step_lines(request, work / "runs"), work
