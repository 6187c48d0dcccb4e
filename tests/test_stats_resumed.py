"""The ``resumed`` verdict on synthetic curves with known answers: after a resume at K, a twin
rule is judged against twins resumed from the test's checkpoint, whose gap to the control
restarts near zero. A layout broken from K+1 that the twins' grown envelope lets pass fails it
at K+1; a correct one passes; only twin-sized rules with resumed twins take part."""

from __future__ import annotations

import numpy as np

from convergence.metrics.curve import Curve, RunMetrics
from convergence.spec.pair import ComparisonRule
from convergence.stats.registry import get_comparison
from convergence.stats.resumed import GAP_MIN_STEPS, RESUMED, resumed_verdict
from convergence.stats.types import MetricVerdict

STEPS = np.arange(1, 21, dtype=np.int64)
AT = 10
AFTER = STEPS > AT
CONTROL = 2.0 + 3.0 * np.exp(-STEPS / 10.0)
TWIN = ComparisonRule(metric="loss", method="twin")


def run(values: np.ndarray, steps: np.ndarray = STEPS) -> RunMetrics:
    return {"loss": Curve("loss", steps.copy(), np.asarray(values, dtype=np.float64))}


#: The twins from step 1: their gap grows 10x by the resume (chaos) and stays there.
GROWN = 1e-3 * np.minimum(STEPS, AT) / AT
TWINS = [run(CONTROL + GROWN), run(CONTROL - GROWN)]
#: The twins resumed from the test's checkpoint: their gap restarts at 1e-5 and grows slowly.
SINCE = (STEPS[AFTER] - AT).astype(np.float64)
RESUMED_TWINS = [
    run(CONTROL[AFTER] + 1e-5 * SINCE, STEPS[AFTER]),
    run(CONTROL[AFTER] - 1e-5 * SINCE, STEPS[AFTER]),
]


def verdict(test: RunMetrics, rules: list[ComparisonRule] | None = None) -> MetricVerdict | None:
    return resumed_verdict(
        rules or [TWIN], [run(CONTROL), *TWINS], test, at_step=AT, resumed_twins=RESUMED_TWINS
    )


def test_a_layout_broken_after_the_resume_fails_at_the_first_step_after_it() -> None:
    # 5e-4 from K+1: inside 3 x the grown envelope (~6e-3), far outside the resumed one.
    test = run(np.where(AFTER, CONTROL + 5e-4, CONTROL))
    whole = get_comparison("twin").compare(
        TWIN, [run(CONTROL)["loss"], *(t["loss"] for t in TWINS)], test["loss"]
    )
    assert whole.passed  # the twins from step 1 let it pass
    after = verdict(test)
    assert after is not None and not after.passed and after.metric == RESUMED
    assert after.first_divergent_step == AT + 1
    assert f"after the checkpoint at step {AT}" in after.message
    assert "allow at step 11 (1 after the resume): loss |diff| 0.0005 > tol" in after.message


def test_a_correct_layout_passes_with_the_room_it_used() -> None:
    after = verdict(run(np.where(AFTER, CONTROL + 2e-5, CONTROL)))
    assert after is not None and after.passed, after
    assert 0 < after.details["max_ratio_by_metric"]["loss"] < 1


def test_only_twin_sized_rules_and_only_with_resumed_twins() -> None:
    test = run(CONTROL + 1.0)
    paired = ComparisonRule(metric="loss", method="paired")
    assert verdict(test, [paired]) is None
    assert resumed_verdict([TWIN], [run(CONTROL)], test, at_step=AT, resumed_twins=()) is None


def test_a_gap_inside_the_envelope_that_stays_up_fails_the_gap_level() -> None:
    """Two resumed twins 1e-4 (relative) from the control at every step: the envelope is
    3 x their summed running max, 6e-4. A test 5e-4 away at every step stays inside it, but the
    level of its gap -- mean and median -- is 2.27x the twins' summed (with the fp32 floor):
    outside 1.5x on the per-part grad norm once the level is judged, inside the loss's 3x."""
    usual = 1e-4 * CONTROL[AFTER]
    twins = [run(CONTROL[AFTER] + usual, STEPS[AFTER]), run(CONTROL[AFTER] - usual, STEPS[AFTER])]
    test = run(np.where(AFTER, CONTROL * (1 + 5e-4), CONTROL))
    rule_verdict = get_comparison("twin").compare(
        TWIN, [run(CONTROL)["loss"].after(AT), *(t["loss"] for t in twins)], test["loss"].after(AT)
    )
    assert rule_verdict.passed  # inside the resumed twins' envelope

    def parts(r: RunMetrics) -> RunMetrics:
        return {"grad_norm_parts": Curve("grad_norm_parts", r["loss"].steps, r["loss"].values)}

    rules = [ComparisonRule(metric="grad_norm_parts", method="twin")]
    after = resumed_verdict(
        rules,
        [parts(run(CONTROL))],
        parts(test),
        at_step=AT,
        resumed_twins=[parts(t) for t in twins],
    )
    assert after is not None and not after.passed
    assert after.first_divergent_step == AT + GAP_MIN_STEPS
    assert f"grad_norm_parts |diff| over steps 11-{AT + GAP_MIN_STEPS} 2.27x" in after.message
    assert "by mean and median (limit 1.5x)" in after.message
    loss = resumed_verdict([TWIN], [run(CONTROL)], test, at_step=AT, resumed_twins=twins)
    assert loss is not None and loss.passed  # the loss is held to 3x
    # One spike in an otherwise twin-sized gap lifts the mean, not the median: it passes.
    spiky = run(np.where(AFTER, CONTROL * (1 + np.where(STEPS == AT + 2, 5e-3, 1e-4)), CONTROL))
    spiked = resumed_verdict(
        rules,
        [parts(run(CONTROL))],
        parts(spiky),
        at_step=AT,
        resumed_twins=[parts(t) for t in twins],
    )
    assert spiked is not None and spiked.details["first_step_by_check"]["gap_level"] is None
