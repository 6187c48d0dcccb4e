"""The comparison rules every regime shares (pure data: ComparisonRule values), and the view of
the regimes the experiment parser is given. Each regime's default rules live in its module
(convergence/regimes/); the comparisons that implement each method in
``convergence.stats.registry``."""

from __future__ import annotations

from typing import Protocol

from convergence.spec.job import JobSpec
from convergence.spec.pair import ComparisonRule

#: Performance metrics: compared one-sided and reported, not gating, by default.
PERFORMANCE_RULES: tuple[ComparisonRule, ...] = (
    ComparisonRule(metric="tokens_per_s", method="regression", gate=False),
    ComparisonRule(metric="peak_mem_mib", method="regression", gate=False),
)

#: The data each step read, compared exactly and first: a data bug is named as one before any
#: numerics (stats/fingerprint.py, whose METRIC is this name). The pair builder moves it first
#: (so its verdict is the first line of a failure) and drops it when the seeds (= sample
#: orders) differ.
DATA_RULE = ComparisonRule(metric="data_fingerprint", method="exact", gate=True)


class RegimeTable(Protocol):
    """What the experiment parser needs to know of the regimes (convergence.regimes.REGISTRY
    is one): spec/ is the bottom layer and imports nothing above it, so the parser is handed
    this view by its caller (convergence.preflight)."""

    def names(self) -> tuple[str, ...]:
        """The regimes ``regime = "..."`` may name."""
        ...

    def default_for(self, control: JobSpec, test: JobSpec) -> str:
        """The regime of a pair whose experiment names none."""
        ...

    def default_rules(self, name: str) -> tuple[ComparisonRule, ...]:
        """The rules of a pair of regime ``name`` before its ``compare`` table."""
        ...
