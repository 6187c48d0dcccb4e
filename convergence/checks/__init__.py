"""Checks as plug-ins: evidence beside a pair's rules (convergence/checks/base.py)."""

from convergence.checks.base import Check, ExtraJob, ProbeRequest, Ran, SideRun
from convergence.checks.registry import all_checks, checks_of, pair_keys, validate_keys

__all__ = [
    "Check",
    "ExtraJob",
    "ProbeRequest",
    "Ran",
    "SideRun",
    "all_checks",
    "checks_of",
    "pair_keys",
    "validate_keys",
]
