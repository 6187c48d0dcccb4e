"""The one place a pair's status is settled from its verdicts: every front end (the Runner,
``convergence compare``, ``convergence ab``) builds its outcome here, so the same verdicts get
the same status and error wherever they were made (tests/test_one_judge.py).

The rules, in the order they apply:

1. a test that logged a non-finite loss has *failed* (its launcher stopped it: the verdicts
   stop at the last finite step), and the error names the job;
2. otherwise the gating verdicts decide (:func:`status_of`): passed, failed, inconclusive;
3. a failure only past the step where the control group stopped being one trajectory
   (stats/health.py ``unreliable_from``: a twin split from the control, a grad-norm spike) is
   the reference's: *error* "reference unreliable after step N", not a failed test -- except
   for a golden control, whose curves are all there is;
4. a gating metric that a run did not log (the experiment named it) is an *error*: nothing to
   judge it by, and a pass would hide it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from convergence.launch.types import JobResult
from convergence.metrics.curve import RunMetrics
from convergence.run.outcome import PairStatus
from convergence.spec.pair import PairSpec
from convergence.stats.health import unreliable_from, unreliable_reference
from convergence.stats.types import MetricVerdict


@dataclass(frozen=True)
class Settled:
    status: PairStatus
    error: str | None = None
    """Why the pair is an error, or why a failed test failed without a verdict (NaN)."""


def status_of(verdicts: Sequence[MetricVerdict]) -> PairStatus:
    """passed when every gating verdict passed; failed when one failed outright; else (the
    rest are inconclusive: stats/noninferiority.py) inconclusive -- a failure outweighs it."""
    gating = [v for v in verdicts if v.gate]
    if all(v.passed for v in gating):
        return "passed"
    if any(not v.passed and not v.inconclusive for v in gating):
        return "failed"
    return "inconclusive"


def settle(
    pair: PairSpec,
    verdicts: Sequence[MetricVerdict],
    control: RunMetrics | None,
    *,
    twins: Sequence[RunMetrics] = (),
    test_result: JobResult | None = None,
) -> Settled:
    """The status of ``pair`` judged to ``verdicts``. ``control``: the control's curves,
    ``twins``: its twins' where the twin regime ran them (a seed band's replicates differ by
    design: they are no twins); ``test_result``: the test job's launch result where it ran
    here (None: its curves were read from disk)."""
    error = None
    if test_result is not None and test_result.status == "nan":
        status: PairStatus = "failed"
        if test_result.failure:
            error = f"test job {pair.test.name!r}: {test_result.failure.message}"
    else:
        status = status_of(verdicts)
    if status == "failed" and error is None and not pair.golden:
        unreliable = unreliable_reference(verdicts, reference_unreliable_from(control, twins))
        if unreliable is not None:
            status, error = "error", f"control job {pair.control.name!r}: {unreliable}"
    asked = [v.message for v in verdicts if v.not_compared and v.gate]
    if asked and error is None:
        status, error = "error", "not compared: " + "; ".join(asked)
    return Settled(status, error)


def reference_unreliable_from(
    control: RunMetrics | None, twins: Sequence[RunMetrics] = ()
) -> tuple[int, str] | None:
    """From which step the control and its twins stop being one reference (stats/health.py)."""
    if control is None:
        return None
    curves = [run["grad_norm"] for run in twins if "grad_norm" in run]
    return unreliable_from(control.get("grad_norm"), curves)
