"""Checks as plug-ins: evidence beside a pair's rules (convergence/checks/base.py)."""

from convergence.checks.base import Check, ExtraJob, ProbeRequest, Ran, SideRun
from convergence.checks.registry import all_checks, as_run, checks_of

__all__ = [
    "Check",
    "ExtraJob",
    "ProbeRequest",
    "Ran",
    "SideRun",
    "all_checks",
    "as_run",
    "checks_of",
]
