"""Specs: frozen dataclasses for layouts, techniques, jobs and pairs, plus TOML loading."""

from __future__ import annotations

from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import PP_SCHEDULES, Layout, ParallelLayout, Techniques
from convergence.spec.pair import ComparisonRule, PairSpec

__all__ = [
    "PP_SCHEDULES",
    "ComparisonRule",
    "JobSpec",
    "Layout",
    "PairSpec",
    "ParallelLayout",
    "RunFailed",
    "SpecError",
    "Techniques",
]
