"""Test-suite setup shared by the project's tests (the plugin itself needs none of this)."""

from __future__ import annotations

import sys
from pathlib import Path

# Shared helpers (report_examples.py, slurm_cluster.py) are imported by bare module name. pytest's
# default import mode puts this folder on sys.path by itself; --import-mode=importlib does not.
_TESTS = str(Path(__file__).parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
