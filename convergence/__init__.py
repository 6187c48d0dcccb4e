"""pytest-convergence: loss-convergence tests for distributed LLM training.

The library (this package) never imports pytest; the plugin lives in ``pytest_convergence``.
"""

from __future__ import annotations

__version__ = "0.1.0"
