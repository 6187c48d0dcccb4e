"""Helpers shared by the comparison methods: aligning curves and building verdicts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats.types import Check, MetricVerdict, Tolerance
from convergence.stats.types import Floats as Floats
from convergence.stats.types import Ints as Ints


@dataclass(frozen=True, kw_only=True)
class Aligned:
    """Test and control values at the steps both logged."""

    steps: Ints
    test: Floats
    control: Floats


def align(control: Curve, test: Curve) -> Aligned:
    steps, ci, ti = np.intersect1d(
        control.steps, test.steps, assume_unique=True, return_indices=True
    )
    return Aligned(steps=steps.astype(np.int64), test=test.values[ti], control=control.values[ci])


def incomplete(controls: Sequence[Curve], test: Curve) -> str | None:
    """Why the test cannot pass on coverage alone (None when it covers the controls).

    A pass needs the whole run: a test that stopped (or crashed) before the control's last
    logged step is not equivalent, however well its first steps agree.
    """
    if not controls or not any(len(c) for c in controls):
        return "the control has no values"
    if len(test) == 0:
        return "the test has no values"
    control_end = min(int(c.steps[-1]) for c in controls if len(c))
    test_end = int(test.steps[-1])
    if test_end < control_end:
        return f"the test ends at step {test_end}, the control at step {control_end}"
    return None


def failed(
    rule: ComparisonRule, method: Method, message: str, *, steps_compared: int = 0, **extra: Any
) -> MetricVerdict:
    """A verdict that could not be computed, or failed before any per-step check."""
    return MetricVerdict(
        metric=rule.metric,
        method=method,
        passed=False,
        gate=rule.gate,
        steps_compared=steps_compared,
        message=f"{rule.metric}: {message}",
        **extra,
    )


def uncompared(
    rule: ComparisonRule, message: str, *, passed: bool, gate: bool, not_compared: bool
) -> MetricVerdict:
    """A verdict on no compared step: the metric is missing from a side, or not logged by
    both (``message`` says which, and the fix)."""
    return MetricVerdict(
        metric=rule.metric,
        method=rule.method,
        passed=passed,
        gate=gate,
        steps_compared=0,
        not_compared=not_compared,
        message=message,
    )


def worst(deviation: Floats, steps: Ints) -> tuple[float, int | None, int | None]:
    """(max deviation, its step, its index); NaN counts as the worst."""
    if deviation.size == 0:
        return 0.0, None, None
    nan = np.isnan(deviation)
    index = int(np.argmax(nan)) if nan.any() else int(np.argmax(deviation))
    return float(deviation[index]), int(steps[index]), index


def first_true(mask: npt.NDArray[np.bool_], steps: Ints) -> int | None:
    return int(steps[int(np.argmax(mask))]) if mask.any() else None


class _Tolerance(Protocol):
    def at(self, steps: Ints, control: Floats) -> Floats: ...


def tolerance_at(tol: _Tolerance) -> Callable[[int, float], float]:
    """A vectorised tolerance at one step: what the early-stop checks ask step by step."""
    return lambda step, ref: float(tol.at(np.array([step], dtype=np.int64), np.array([ref]))[0])


def point_check(control: Curve, tolerance: Callable[[int, float], float]) -> Check:
    """|test - control| against ``tolerance(step, control value)`` at the control's steps."""
    reference = dict(zip(control.steps.tolist(), control.values.tolist(), strict=True))

    def check(step: int, value: float) -> tuple[float, float] | None:
        ref = reference.get(step)
        return None if ref is None else (abs(value - ref), tolerance(step, ref))

    return check


class ComparisonDefaults:
    """What a comparison method is unless it says otherwise (the attributes of the
    :class:`~convergence.stats.types.Comparison` protocol): judged on the control's curve
    alone, with its own fixed parameters, no ``alpha``, no one-step tolerance."""

    all_controls = False
    calibrated = False
    takes_alpha = False
    anchored_twins = False

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        """None: a method that judges a window of the run (seed band, regression), not one
        step, stays out of the anchored check."""
        return None
