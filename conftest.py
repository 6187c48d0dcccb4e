"""Project-wide test configuration (not part of the plugin)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest

# torch-free (the plugin imports it too): the variable a job's ranks read their draw from.
from convergence.rank.rounding_draw import ROUNDING_DRAW_ENV

# The plugin's own tests drive pytest in a temporary folder with `pytester`.
pytest_plugins = ["pytester"]

# Lines that say which rank broke and how: torchrun's root cause, our launcher's diagnosis,
# the C++ runtime's teardown abort, a Python exception's last line.
_TELLING = re.compile(
    r"(rank \d+\b.*(killed|failed|aborted|exitcode)|exitcode\s*:|SIGABRT|SIGSEGV|SIGKILL"
    r"|terminate called|hung:|timed? ?out|^E\s+\w+(Error|Exception)\b)",
    re.IGNORECASE,
)
_MAX_LINES = 4


def _telling_lines(text: str) -> list[str]:
    seen: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and _TELLING.search(line) and line not in seen:
            seen.append(line[:200])
        if len(seen) >= _MAX_LINES:
            break
    return seen


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """A red run read in seconds: per failed test, the lines naming the rank and the abort.

    Printed after pytest's tracebacks and before its short summary and closing line. Before
    that, report sections whose title starts with "shown:" (e.g. torchtitan's own step lines)
    are printed for every test, passed ones included, so that CI's log shows them under xdist.
    """
    for report in terminalreporter.stats.get("passed", ()):
        for title, content in report.sections:
            if "shown:" in title:
                terminalreporter.section(title.split("shown:", 1)[1].strip(), sep="-")
                terminalreporter.write_line(content)
    reports = [*terminalreporter.stats.get("failed", ()), *terminalreporter.stats.get("error", ())]
    if not reports:
        return
    terminalreporter.section("failures at a glance", sep="=", bold=True)
    for report in reports:
        when = "" if report.when == "call" else f" ({report.when})"
        terminalreporter.write_line(f"{report.nodeid}{when}")
        # The assertion/exception lines of the traceback ("E  ..."), not its source lines,
        # then whatever the test printed (a job's failure message, a rank's stderr tail).
        errors = [ln for ln in report.longreprtext.splitlines() if ln.startswith("E ")]
        printed = "\n".join(content for _, content in report.sections)
        lines = _telling_lines("\n".join(errors) + "\n" + printed) or errors[-1:]
        for line in lines or ["(no error line)"]:
            terminalreporter.write_line(f"    {line}")


@pytest.fixture(autouse=True)
def _no_step_summary_of_the_ci_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's tests write many example reports; under GitHub Actions they must not
    append them to the CI job's own summary. A test that checks the summary sets its own."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


#: Set by .ci/run: the tests marked ``rounding`` run under this rounding draw of the machine
#: (convergence/rank/rounding_draw.py) instead of its own rounding. Why: a test tuned on a
#: developer's machine holds for that machine's draw 0; CI's CPU is often the same kind, so its
#: draw 0 re-checks nothing, while a draw no developer ran does. One run per test in the suite
#: itself, not a second phase over the same tests (issue 48: CI time, BENCHMARKS.md "CI time").
ROUNDING_TESTS_DRAW_ENV = "CONVERGENCE_ROUNDING_TESTS_DRAW"


@pytest.fixture(autouse=True)
def _rounding_tests_under_ci_draw(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    draw = os.environ.get(ROUNDING_TESTS_DRAW_ENV, "").strip()
    if draw and request.node.get_closest_marker("rounding") is not None:
        # The jobs a test starts (torchrun, warm ranks, pytester subprocesses) inherit it.
        monkeypatch.setenv(ROUNDING_DRAW_ENV, draw)


# `pytest -m convergence` (the quick start) selects experiment files and marked tests only, but
# `testpaths` would still import every test module here to find out (half the collection time,
# and torch, scipy and matplotlib with them). A module whose code (not its strings: the plugin's
# own tests hold marked tests inside pytester sources) never names the marker or the fixture
# cannot hold a convergence test: skip it unimported. A project-level choice for this
# repository, not plugin behaviour (a user's project may mark tests in ways this cannot see).


def _may_hold_convergence_tests(source: str) -> bool:
    if "convergence" not in source:
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # let pytest import it and report the error
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "convergence"
            and (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
        ):
            return True  # pytest.mark.convergence, in a decorator or a pytestmark
        if isinstance(node, ast.arg) and node.arg == "convergence_pair":
            return True
        if isinstance(node, ast.Constant) and node.value == "convergence_pair":
            return True  # usefixtures("convergence_pair")
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if (config.getoption("markexpr", "") or "").strip() != "convergence":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        source = collection_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return None if _may_hold_convergence_tests(source) else True


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shipped experiments' pairs judged against measured noise (the twin and seed
    regimes: bf16 and other non-bitwise numerics) are rounding-sensitive like the tests marked
    so: .ci/run runs them under other rounding draws too (BENCHMARKS.md "CI time")."""
    for item in items:
        pair = getattr(item, "pair", None)
        if pair is not None and getattr(pair, "regime", "paired") != "paired":
            item.add_marker(pytest.mark.rounding)
