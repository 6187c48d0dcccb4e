"""The verdict on one metric, and the Protocol every comparison method implements."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Band:
    """The exact range the test had to stay in: ``lower[i] <= test <= upper[i]`` at ``steps[i]``.

    One entry per compared step (every step the control logged when the test stopped early:
    the range it would have had to keep). A one-sided limit is -inf or +inf. Reports draw this
    instead of re-deriving each method's tolerance, so a new method only has to fill it.
    """

    steps: tuple[int, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(self.steps) == len(self.lower) == len(self.upper):
            raise ValueError(
                f"Band: steps, lower and upper must have one entry per step "
                f"(got {len(self.steps)}, {len(self.lower)}, {len(self.upper)})"
            )

    @classmethod
    def of(cls, steps: Iterable[Any], lower: Iterable[Any], upper: Iterable[Any]) -> Band:
        """From arrays (numpy or lists): plain ints and floats, so it compares and serializes."""
        return cls(
            tuple(int(s) for s in steps),
            tuple(float(v) for v in lower),
            tuple(float(v) for v in upper),
        )

    def to_json(self) -> dict[str, list[Any]]:
        return {"steps": list(self.steps), "lower": list(self.lower), "upper": list(self.upper)}


@dataclass(frozen=True, kw_only=True)
class MetricVerdict:
    """Outcome of comparing one metric of a test run with its control."""

    metric: str
    method: Method
    passed: bool
    gate: bool
    """Whether this verdict decides the pair (False: reported only, e.g. throughput)."""
    steps_compared: int
    first_divergent_step: int | None = None
    """First logged step outside the tolerance/band (None when none is)."""
    max_deviation: float = 0.0
    """Largest |test - control| (or |test - band mean| for the seed regime)."""
    max_deviation_step: int | None = None
    tolerance: str = ""
    """Human description of the tolerance or band used, e.g. ``atol 5e-07*(1+0.1*sqrt(step))``."""
    tolerance_at_max: float | None = None
    """The tolerance in force at ``max_deviation_step``."""
    p_values: dict[str, float] = field(default_factory=dict)
    """Statistical tests only, e.g. ``{"tost_lower": .., "tost_upper": ..}``."""
    message: str = ""
    """One line that says why it passed or failed."""
    details: dict[str, Any] = field(default_factory=dict)
    band: Band | None = None
    """The range the test had to stay in, per compared step (None: exact, not compared, or a
    verdict saved before verdicts carried it)."""
    inconclusive: bool = False
    """Not passed, and not shown worse either: the evidence cannot exclude a difference the
    margin cares about (the margin comparison, stats/noninferiority.py). The pair is then
    inconclusive, never passed; ``message`` says how much more evidence would decide."""
    not_compared: bool = False
    """A gating metric that a run did not log, so it was not compared: reports show it in
    amber with the fix (``message``), never as a silent pass. With ``gate`` it was asked for
    by name in ``compare``, and the pair errors."""

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "method": self.method,
            "passed": self.passed,
            "gate": self.gate,
            "steps_compared": self.steps_compared,
            "first_divergent_step": self.first_divergent_step,
            "max_deviation": self.max_deviation,
            "max_deviation_step": self.max_deviation_step,
            "tolerance": self.tolerance,
            "tolerance_at_max": self.tolerance_at_max,
            "p_values": self.p_values,
            "message": self.message,
            "details": self.details,
            "band": None if self.band is None else self.band.to_json(),
            "not_compared": self.not_compared,
            "inconclusive": self.inconclusive,
        }


#: An early-stop check (convergence.stats.sequential): (step, test value) -> (|deviation|,
#: tolerance), or None when the control has no such step.
Check = Callable[[int, float], "tuple[float, float] | None"]


class Tolerance(Protocol):
    """A per-step tolerance around the control (paired, allclose, twin, exact)."""

    @property
    def atol(self) -> float: ...

    @property
    def growth(self) -> float: ...

    @property
    def rtol(self) -> float: ...

    def at(self, steps: Ints, control: Floats) -> Floats: ...

    def describe(self) -> str: ...


class Comparison(Protocol):
    """A comparison method (exact, allclose, paired band, twin envelope, seed band,
    regression)."""

    method: Method
    all_controls: bool
    """Whether ``compare`` is given every control curve (the seed band's replicates, the
    control and its twin) or only the control's."""
    takes_alpha: bool
    """Whether its rules' ``alpha`` (an equivalence test's level; ``--alpha``) applies."""
    calibrated: bool
    """Whether its parameters come from the calibration in force (calibration/select.py):
    its verdicts then say which one (run/judge.py)."""
    anchored_twins: bool
    """Whether its one-step tolerance is sized from the twins' own steps from each anchor
    (the anchored check runs those control-side jobs only for such a method: checks/anchored.py),
    and whose envelope after a resume is sized from the twins resumed from the test's
    checkpoint (stats/resumed.py judges only such methods' rules there)."""

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        """``controls`` holds one curve (paired methods) or K replicates (seed band)."""
        ...

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        """The per-step check the sequential monitor applies while the test runs (the
        controls have finished); None: this method never stops a job early (it judges the
        whole run, e.g. a median) or the controls do not allow a check."""
        ...

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        """Its tolerance for one step from a state both sides share (the anchored check,
        stats/anchored.py), as at step 1 of a pair; None: the method has no per-step
        tolerance (seed band, regression) and stays out of that check."""
        ...
