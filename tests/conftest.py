"""Test-suite setup shared by the project's tests (the plugin itself needs none of this)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Shared helpers (report_examples.py, slurm_cluster.py) are imported by bare module name. pytest's
# default import mode puts this folder on sys.path by itself; --import-mode=importlib does not.
_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Run sharing. CI runs the suite on two xdist workers (`-n 2 --dist loadgroup`), and a
# module-scoped fixture runs once per *worker* that gets one of the module's tests: a module
# whose fixture trains (a pair, a probe, a reference run) would train twice, on a machine where
# the two cores are the bottleneck. Such modules set `pytestmark = xdist_group("<module>")`, so
# one worker runs all their tests and the fixture once. tests/test_suite_sharing.py fails when
# a module with a module-scoped fixture has no group.


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Make `--dist loadgroup` group again under pytest 9. pytest-xdist 3.8 groups by a
    ``@<group>`` suffix that its worker writes into ``item._nodeid``; pytest 9 reads the node id
    from ``item._id``, so the suffix never reached the scheduler and every ``xdist_group`` was
    silently ignored (a module's fixture ran on both workers; the Slurm files ran at once and
    waited on each other's lock). Here, on a worker, the same suffix is written where pytest 9
    reads it; where xdist already wrote it (a fixed xdist), nothing is done.
    tests/test_suite_sharing.py checks that a grouped test's id carries its group."""
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    try:
        from _pytest.nodeid import coerce_node_id  # pytest >= 9.1: ids are read from item._id
    except ImportError:  # older pytest reads item._nodeid, where xdist's suffix already is
        return

    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


@pytest.fixture(autouse=True, scope="module")
def _end_fork_servers() -> Iterator[None]:
    """After each module, end the fork servers its warm starts left in this process: the
    process-wide set of launchers built without a session's (convergence/launch/fork_servers.py;
    tests/trainer_jobs.py's among them). Left running, they are children of the worker when a later
    module on it asserts that no process outlives its jobs (tests/test_runner_e2e.py)."""
    yield
    from convergence.launch.fork_servers import shared_fork_servers

    shared_fork_servers().close()
