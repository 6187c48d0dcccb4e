"""Test-suite setup shared by the project's tests (the plugin itself needs none of this)."""

from __future__ import annotations

import sys
from pathlib import Path

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
