"""The default comparison rules per regime: pure data (ComparisonRule values), so the pair
builder in spec/ needs nothing from ``convergence.stats``; the comparisons that implement each
method live in ``convergence.stats.registry``."""

from __future__ import annotations

from convergence.spec.pair import REGIMES, ComparisonRule

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


def default_rules(regime: str) -> tuple[ComparisonRule, ...]:
    """Loss and grad norm judged by the regime's method (a wrongly scaled gradient can leave
    an Adam loss almost unchanged but doubles the grad norm), the per-part grad norm (a bug in
    one kind of weight -- queries and keys under a position bug -- hides in the total), the
    data fingerprint, plus throughput and memory."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; use one of {', '.join(REGIMES)}")
    return (ComparisonRule(metric="loss", method=regime),
            ComparisonRule(metric="grad_norm", method=regime),
            ComparisonRule(metric="grad_norm_parts", method=regime),
            DATA_RULE) + PERFORMANCE_RULES
