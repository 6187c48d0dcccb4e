"""Where a pair runs the anchored check, it judges "same function" past the first steps
(stats/anchored.py judged_from_anchors): a trajectory that leaves the paired band only after
TRAJECTORY_HORIZON -- a correct layout whose rounding a chaotic run amplified -- is reported,
not gated, while the one-step checks from the control's states pass; a trajectory failure
within the horizon, a data-fingerprint failure, and a metric the anchored check did not judge
still fail the pair; an anchored failure fails it."""

from __future__ import annotations

import numpy as np

from convergence.metrics.curve import Curve
from convergence.run.settle import status_of
from convergence.spec.pair import ComparisonRule
from convergence.stats.anchored import TRAJECTORY_HORIZON, anchored_verdict, judged_from_anchors
from convergence.stats.registry import compare_all

STEPS = np.arange(1, 61, dtype=np.int64)
CONTROL = 2.0 + 3.0 * np.exp(-STEPS / 20.0)
EVERY = 10
LOSS = ComparisonRule(metric="loss", method="paired")


def run(values: np.ndarray, steps: np.ndarray = STEPS) -> dict[str, Curve]:
    return {"loss": Curve("loss", steps.copy(), np.asarray(values, dtype=np.float64))}


def drifting(from_step: int) -> np.ndarray:
    """The control's curve plus a gap growing exponentially from ``from_step`` (chaos): far
    outside the paired band a few steps later."""
    return CONTROL + np.where(STEPS >= from_step, 1e-6 * np.exp(0.5 * (STEPS - from_step)), 0.0)


ANCHOR_STEPS = np.arange(EVERY, 60, EVERY, dtype=np.int64) + 1  # 11, 21, ..., 51


def anchored(gap: float) -> dict[str, Curve]:
    """One step from each anchor: the control's own value there, plus ``gap`` (relative)."""
    return run(CONTROL[ANCHOR_STEPS - 1] * (1 + gap), ANCHOR_STEPS)


def judged(test: np.ndarray, anchored_gap: float, rules=(LOSS,)):
    verdicts = compare_all(list(rules), [run(CONTROL)], run(test))
    one = anchored_verdict(list(rules), [run(CONTROL)], anchored(anchored_gap), every=EVERY)
    return verdicts, one, (*judged_from_anchors(verdicts, one), one)


def test_a_late_trajectory_departure_is_shown_not_gated_when_every_anchor_passes() -> None:
    verdicts, one, out = judged(drifting(TRAJECTORY_HORIZON + 15), anchored_gap=0.0)
    assert status_of(verdicts) == "failed"  # the trajectory alone fails the pair
    assert one.passed
    loss = next(v for v in out if v.metric == "loss")
    assert not loss.passed and not loss.gate  # still reported as outside, not gating
    assert loss.details["judged_by_anchors"]
    assert status_of(out) == "passed"


def test_a_departure_within_the_horizon_still_fails() -> None:
    _, _, out = judged(drifting(3), anchored_gap=0.0)
    loss = next(v for v in out if v.metric == "loss")
    assert loss.first_divergent_step is not None
    assert loss.first_divergent_step <= TRAJECTORY_HORIZON
    assert loss.gate and status_of(out) == "failed"


def test_a_failing_anchor_fails_the_pair() -> None:
    _, one, out = judged(drifting(TRAJECTORY_HORIZON + 15), anchored_gap=1e-3)
    assert not one.passed
    assert status_of(out) == "failed"


def test_a_metric_the_anchored_check_did_not_judge_keeps_gating() -> None:
    verdicts = compare_all([LOSS], [run(CONTROL)], run(drifting(TRAJECTORY_HORIZON + 15)))
    # an anchored verdict over another metric only (its run logged no loss)
    other = ComparisonRule(metric="grad_norm", method="paired")
    gn = {"grad_norm": Curve("grad_norm", ANCHOR_STEPS.copy(), np.ones(ANCHOR_STEPS.size))}
    one = anchored_verdict([other], [gn], gn, every=EVERY)
    assert one.passed
    out = judged_from_anchors(verdicts, one)
    assert status_of(out) == "failed"
