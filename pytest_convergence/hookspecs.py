"""Hooks that pytest-convergence calls, for other plugins and conftest.py files.

Registered with ``pluginmanager.add_hookspecs`` (plugin.py's ``pytest_addhooks``), as
pytest-xdist registers its ``newhooks.py``. Implement them in a conftest.py or a plugin:

    def pytest_convergence_modify_pair(config, pair):
        # e.g. every pair of this lab runs 50 steps: return a changed PairSpec (None: as is)
        return dataclasses.replace(pair, test=dataclasses.replace(pair.test, steps=50))

    def pytest_convergence_pair_verdict(config, outcome):
        post_to_dashboard(outcome.pair.pair_id, outcome.status, outcome.verdicts)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from convergence.run.outcome import PairOutcome
    from convergence.spec.pair import PairSpec


@pytest.hookspec(firstresult=True)
def pytest_convergence_modify_pair(config: pytest.Config, pair: PairSpec) -> PairSpec | None:
    """Called before a pair runs (TOML item or ``convergence_pair`` fixture): return the
    pair to run instead (a ``dataclasses.replace`` of it), or None to leave it as it is. The
    first implementation that returns a pair wins. Raise ``pytest.skip.Exception`` (call
    ``pytest.skip(reason)``) to veto the pair: it is reported as skipped, nothing runs."""


@pytest.hookspec
def pytest_convergence_pair_verdict(config: pytest.Config, outcome: PairOutcome) -> None:
    """Called when a pair's verdict is in (passed, failed or error; also for a pair
    interrupted by Ctrl-C), with its outcome: status, per-metric verdicts, both sides'
    curves (convergence.run.outcome.PairOutcome). In the process that ran it (an xdist
    worker under ``-n``)."""
