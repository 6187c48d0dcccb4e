"""Early stopping: decide a test run's failure while it is still training.

A broken parallelism usually shows within a few dozen steps; letting it run 1000 more wastes
the machine. The monitor is fed each logged record and says when the verdict is already known:

- a NaN/inf loss fails at once (nothing after it can recover the comparison);
- a gating metric that is *clearly* outside its tolerance -- beyond CLEAR_FACTOR (2x) the
  paired/allclose tolerance, the twin envelope or the seed band's half-width -- for
  ``patience`` consecutive logged steps, counted from ``min_step`` on, fails. Twice the
  tolerance and several steps in a row, because a single step at the edge of the band is what
  noise does; the final verdict still judges the whole run at 1x. The first ``min_step`` steps are skipped: the first
  optimizer steps of a seed ensemble are the noisiest (and least informative).

It never decides "pass" early: a pass needs the whole run (a divergence can start late).
Regression rules (throughput, memory) are judged on a median over the run and never stop a job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from convergence.calibration.select import DEFAULTS, Selection, in_force
from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.tags import JSONL_KEYS, resolve_map
from convergence.regimes.base import DEFAULT_EARLY_STOP
from convergence.spec.pair import ComparisonRule
from convergence.stats.registry import get_comparison
from convergence.stats.types import Check

CLEAR_FACTOR = 2.0
#: Every shipped regime's policy (convergence.regimes.base); the Runner passes the pair's.
DEFAULT_MIN_STEP = DEFAULT_EARLY_STOP.min_step
DEFAULT_PATIENCE = DEFAULT_EARLY_STOP.patience


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the monitor knows after a record. ``decided`` implies the test has failed."""

    decided: bool
    failed: bool = False
    reason: str = ""
    metric: str | None = None
    step: int | None = None


UNDECIDED = Decision(decided=False)


class SequentialMonitor:
    """Feeds on the test's records as they are logged; see the module docstring."""

    def __init__(
        self,
        rules: Sequence[ComparisonRule],
        control_runs: Sequence[RunMetrics],
        *,
        min_step: int = DEFAULT_MIN_STEP,
        patience: int = DEFAULT_PATIENCE,
        key_map: Mapping[str, str] | None = None,
        calibration: Selection = DEFAULTS,
        last_step: int | None = None,
    ) -> None:
        """``calibration``: the one the pair's verdict will use (run/judge.py), so that the
        monitor stops a test only where that verdict would fail it. ``last_step``: past it a
        metric's clear excursion no longer stops the test, because the verdict does not gate
        on the trajectory there (a check judges those steps: the anchored check's horizon);
        a non-finite loss stops it at any step."""
        self.last_step = last_step
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.min_step = min_step
        self.patience = patience
        self._sources = resolve_map(JSONL_KEYS, key_map)
        self._checks: dict[str, Check] = {}
        # The checks take their tolerances when they are built (Comparison.monitor).
        with in_force(calibration):
            for rule in rules:
                check = _check_for(
                    rule, [run[rule.metric] for run in control_runs if rule.metric in run]
                )
                if rule.gate and check is not None:
                    self._checks[rule.metric] = check
        self._streak: dict[str, list[int]] = {metric: [] for metric in self._checks}
        self.decision = UNDECIDED

    def update(self, step: int, record: Mapping[str, object]) -> Decision:
        if self.decision.decided:
            return self.decision
        values = self._values(record)
        loss = values.get("loss")
        if loss is not None and not math.isfinite(loss):
            return self._decide("loss", step, f"loss is {loss} at step {step}")
        if step < self.min_step or (self.last_step is not None and step > self.last_step):
            return self.decision
        for metric, check in self._checks.items():
            value = values.get(metric)
            found = None if value is None else check(step, value)
            if found is None:
                continue  # nothing to compare at this step: neither evidence for nor against
            deviation, tolerance = found
            streak = self._streak[metric]
            if not deviation <= CLEAR_FACTOR * tolerance:  # NaN counts as outside
                streak.append(step)
            else:
                streak.clear()
            if len(streak) >= self.patience:
                return self._decide(
                    metric,
                    step,
                    (
                        f"{metric} outside {CLEAR_FACTOR:g}x its tolerance for {len(streak)} "
                        f"consecutive logged steps ({streak[0]}..{step}); at step {step}: "
                        f"|diff| {deviation:.3g} > {CLEAR_FACTOR:g} x {tolerance:.3g}"
                    ),
                )
        return self.decision

    def decided_by(self, record: Mapping[str, float]) -> bool:
        """:meth:`update` with the record's own ``step``, as the launcher's ``on_metrics``
        callback: True once the test's failure is decided (the launcher then stops the job)."""
        return self.update(int(record["step"]), record).decided

    def _values(self, record: Mapping[str, object]) -> dict[str, float]:
        values: dict[str, float] = {}
        for source, metric in self._sources.items():
            value = record.get(source)
            if (
                metric not in values
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                values[metric] = float(value)
        return values

    def _decide(self, metric: str, step: int, reason: str) -> Decision:
        self.decision = Decision(decided=True, failed=True, reason=reason, metric=metric, step=step)
        return self.decision


def _check_for(rule: ComparisonRule, controls: list[Curve]) -> Check | None:
    """The rule's method says how a step is checked (Comparison.monitor); all take every
    control curve they use (the seed band's replicates, the control and its twin)."""
    if not controls:
        return None
    comparison = get_comparison(rule.method)
    return comparison.monitor(rule, controls if comparison.all_controls else controls[:1])
