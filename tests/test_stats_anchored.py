"""The anchored verdict on synthetic one-step gaps with known answers: a twin rule fails an
anchor outside k x the anchored twin envelope, and also a *persistent* gap -- the same metric
outside 3/4 of it at two consecutive anchors -- naming the first anchor of the run; an
isolated gap that size passes (a correct layout's large gaps are isolated draws). Paired rules
(fp32) have no persistence rule. In the twin regime each part's grad norm (grad_norm/<part>)
is judged too, against the same part of the anchored twins at PART_K_FACTOR x the rule's k,
with no persistence rule. Where the anchored jobs logged a confirming step K+2 (the twin
regime: one step from the control's state K+1, a confirming anchor), an outright miss at K+1
that K+2 does not repeat passes and is said; K+2 alone never fails; the twins' K+2 size the
envelope."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats.anchored import (
    ONE_STEP_K,
    PART_K_FACTOR,
    PERSISTENT_FRACTION,
    AnchoredTwinTolerance,
    anchored_verdict,
    one_step_tolerance,
    persistent_runs,
)
from convergence.stats.types import MetricVerdict

EVERY = 25
ANCHORS = np.arange(EVERY, 500, EVERY, dtype=np.int64)  # 25 .. 475: 19 anchors
STEPS = ANCHORS + 1  # the one step trained from each
CONTROL = 2.0 + 3.0 * np.exp(-STEPS / 100.0)
#: Each twin's relative one-step gap: small at every anchor but one, where it is 1e-3.
TWIN_GAPS = (
    np.where(ANCHORS == 100, 1e-3, 2e-4) * np.cos(STEPS),
    np.where(ANCHORS == 350, 1e-3, 3e-4) * np.sin(STEPS),
)


def curve(values: np.ndarray) -> Curve:
    return Curve("loss", STEPS.copy(), np.asarray(values, dtype=np.float64))


def verdict(method: Method, test_gap_in_tolerances: np.ndarray) -> MetricVerdict:
    """The verdict of a test whose gap at each anchor is the given multiple of the rule's
    one-step tolerance there."""
    rule = ComparisonRule(metric="loss", method=method)
    control = curve(CONTROL)
    twins = [curve(CONTROL * (1 + gap)) for gap in TWIN_GAPS]
    tol = one_step_tolerance(rule, [control], twins if method == "twin" else [])
    assert tol is not None
    limit = tol.at(np.ones_like(STEPS), CONTROL)
    test = curve(CONTROL + test_gap_in_tolerances * limit)
    return anchored_verdict(
        [rule],
        [{"loss": control}],
        {"loss": test},
        every=EVERY,
        anchored_twins=[{"loss": t} for t in twins] if method == "twin" else (),
    )


def gaps(**at_anchor: float) -> np.ndarray:
    """0.1 of the tolerance everywhere, except the given anchors ("a300": 0.7 -> 0.7x)."""
    out = np.full(ANCHORS.shape, 0.1)
    for name, value in at_anchor.items():
        out[ANCHORS == int(name[1:])] = value
    return out


def test_an_isolated_gap_below_the_envelope_passes_even_above_half_of_it() -> None:
    result = verdict("twin", gaps(a350=0.9))
    assert result.passed, result.message
    assert 0.85 < float(str(result.details["max_ratio"])) < 0.95
    # Above 3/4 of the envelope at two anchors that are not consecutive: still isolated.
    assert verdict("twin", gaps(a300=0.85, a350=0.85)).passed


def test_a_persistent_gap_above_3_4_of_the_envelope_fails_at_the_first_anchor_of_its_run() -> None:
    assert 0.5 < PERSISTENT_FRACTION < 0.8
    result = verdict("twin", gaps(a300=0.85, a325=0.85, a350=0.8))
    assert not result.passed
    assert result.details["anchor_step"] == 300
    assert result.details["anchors_failing"] == [300, 325, 350]
    assert result.first_divergent_step == 301
    assert "from the control's state at step 300 the test layout differs" in result.message
    assert "again at the next anchor (step 325): a persistent gap" in result.message
    # Today's rule still fails a single anchor outside the whole envelope, and names it.
    single = verdict("twin", gaps(a400=1.2))
    assert not single.passed and single.details["anchors_failing"] == [400]
    assert "persistent" not in single.message
    # A correct TP2 against its twin (forward_noise.py rounds as TP2 does): its gap is the
    # twin's, at most half the k = 2 envelope, at anchor after anchor -- not a persistent gap.
    assert verdict("twin", gaps(a300=0.5, a325=0.5, a350=0.5, a375=0.5)).passed


def test_a_paired_rule_has_no_persistence_rule() -> None:
    # fp32: the paired floor is already one step of rounding; its verdict is unchanged.
    assert verdict("paired", gaps(a300=0.7, a325=0.7, a350=0.7)).passed
    assert not verdict("paired", gaps(a300=1.2)).passed


def test_runs_need_consecutive_anchors_every_apart() -> None:
    steps = np.array([26, 51, 76, 126, 151, 176], dtype=np.int64)  # anchor 100 missing
    outside = np.array([True, True, False, True, True, True])
    assert persistent_runs(steps, outside, EVERY) == [[0, 1], [3, 4, 5]]
    gap = np.array([False, True, False, True, False, True])
    assert persistent_runs(steps, gap, EVERY) == []
    # A missing anchor breaks a run: 76 and 126 are not consecutive anchors.
    assert persistent_runs(steps, np.array([False, False, True, True, False, False]), 25) == []


# -- each part's grad norm (grad_norm/<part>), judged in the twin regime -------------------

WQ, W1 = "grad_norm/attention.wq", "grad_norm/feed_forward.w1"


def part_runs(
    method: Method, wq_gap_in_part_tolerances: np.ndarray, *, twins_log_w1: bool = True
) -> tuple[list[ComparisonRule], dict[str, Curve], dict[str, Curve], list[dict[str, Curve]]]:
    """Rules, control, anchored test and anchored twins: grad_norm_parts and two parts, the
    test equal to the control but for attention.wq's gap (multiples of its part tolerance)."""
    rule = ComparisonRule(metric="grad_norm_parts", method=method)
    base = {"grad_norm_parts": CONTROL * 0.01, WQ: CONTROL * 1e-3, W1: CONTROL * 0.05}
    control = {name: Curve(name, STEPS.copy(), values) for name, values in base.items()}
    twins = [
        {
            name: Curve(name, STEPS.copy(), values * (1 + gap))
            for name, values in base.items()
            if twins_log_w1 or name != W1
        }
        for gap in TWIN_GAPS
    ]
    part_rule = dataclasses.replace(rule, z=PART_K_FACTOR * ONE_STEP_K)
    tol = one_step_tolerance(part_rule, [control[WQ]], [t[WQ] for t in twins])
    assert tol is not None
    limit = tol.at(np.ones_like(STEPS), base[WQ])
    test = {**control, WQ: Curve(WQ, STEPS.copy(), base[WQ] + wq_gap_in_part_tolerances * limit)}
    return [rule], control, test, twins if method == "twin" else []


def part_verdict(
    method: Method, wq_gap_in_part_tolerances: np.ndarray, *, twins_log_w1: bool = True
) -> MetricVerdict:
    rules, control, test, twins = part_runs(
        method, wq_gap_in_part_tolerances, twins_log_w1=twins_log_w1
    )
    return anchored_verdict(rules, [control], test, every=EVERY, anchored_twins=twins)


def test_a_part_outside_its_own_envelope_fails_the_anchor_and_is_named() -> None:
    # The bf16 CP-rope bug from step 300: attention.wq's norm moves, the mean over parts
    # (grad_norm_parts, here equal to the control's) barely does.
    result = part_verdict("twin", gaps(a300=1.5))
    assert not result.passed
    assert result.details["anchor_step"] == 300 and result.first_divergent_step == 301
    assert result.details["anchors_failing"] == [300]
    assert f"differs after one step: {WQ} |diff|" in result.message, result.message
    ratios = result.details["max_ratio_by_metric"]
    assert isinstance(ratios, dict) and 1.4 < ratios[WQ] < 1.6 and ratios[W1] == 0.0
    assert any("grad_norm/<part>" in t for t in result.details["tolerances"])


def test_a_part_inside_its_envelope_passes_and_parts_have_no_persistence_rule() -> None:
    assert part_verdict("twin", gaps(a300=0.9)).passed
    # Above 3/4 of its envelope at consecutive anchors: a scalar would fail, a part does not.
    assert part_verdict("twin", gaps(a300=0.85, a325=0.85, a350=0.85)).passed


def test_a_part_is_held_to_part_k_factor_times_the_rules_k() -> None:
    # 1.5x the rule's own (k = 2) one-step tolerance at anchor 300: outside it for the scalar
    # grad_norm_parts, inside k = 2.5 x 2 = 5 for a part.
    assert PART_K_FACTOR * ONE_STEP_K == 5.0
    rules, control, test, twins = part_runs("twin", gaps())
    at_300 = np.where(ANCHORS == 300, 1.5, 0.0)
    for name in ("grad_norm_parts", WQ):
        tol = one_step_tolerance(rules[0], [control[name]], [t[name] for t in twins])
        assert tol is not None
        gap = at_300 * tol.at(np.ones_like(STEPS), control[name].values)
        moved = {**test, name: Curve(name, STEPS.copy(), control[name].values + gap)}
        result = anchored_verdict(rules, [control], moved, every=EVERY, anchored_twins=twins)
        assert result.passed == (name == WQ), result.message


def test_parts_are_judged_only_where_twins_size_them() -> None:
    # fp32 (paired): the paired floor is sized for the mean over parts; parts stay out.
    assert part_verdict("paired", gaps(a300=50.0)).passed
    # A part some anchored twin did not log has no envelope: not judged (never a failure).
    rules, control, test, twins = part_runs("twin", gaps())
    test[W1] = Curve(W1, STEPS.copy(), control[W1].values * 2)
    judged = anchored_verdict(rules, [control], test, every=EVERY, anchored_twins=twins)
    assert not judged.passed and W1 in judged.message
    twins = [{k: v for k, v in t.items() if k != W1} for t in twins]
    assert anchored_verdict(rules, [control], test, every=EVERY, anchored_twins=twins).passed


# -- the twin regime's confirming step (K+2: stats/anchored.py CONFIRMING_STEP) -------------

ALL_STEPS = np.arange(1, 501, dtype=np.int64)
ALL_CONTROL = 2.0 + 3.0 * np.exp(-ALL_STEPS / 100.0)
# One step from each anchor K and from its confirming anchor K+1: steps K+1 and K+2.
TWO = np.sort(np.concatenate([ANCHORS + 1, ANCHORS + 2]))


def two_step_verdict(test_gap: dict[int, float], *, logged: np.ndarray = TWO) -> MetricVerdict:
    """The twin verdict of anchored jobs with confirming anchors: the twins' relative gap 2e-4 at every step,
    the test's ``test_gap`` (step -> multiple of the tolerance) where given, 0 elsewhere."""
    rule = ComparisonRule(metric="loss", method="twin")
    control = Curve("loss", ALL_STEPS.copy(), ALL_CONTROL.copy())
    at = ALL_CONTROL[logged - 1]
    twins = [Curve("loss", logged.copy(), at * (1 + 2e-4 * np.cos(logged)))]
    tol = one_step_tolerance(rule, [control], twins)
    assert tol is not None
    limit = tol.at(np.ones_like(logged), at)
    gaps = np.asarray([test_gap.get(int(s), 0.0) for s in logged])
    test = Curve("loss", logged.copy(), at + gaps * limit)
    return anchored_verdict(
        [rule],
        [{"loss": control}],
        {"loss": test},
        every=EVERY,
        anchored_twins=[{"loss": twins[0]}],
    )


def test_a_lone_spike_that_the_confirming_step_does_not_repeat_passes_and_is_said() -> None:
    v = two_step_verdict({301: 3.0})  # 3x the tolerance one step from anchor 300; K+2 inside
    assert v.passed, v.message
    assert v.details["spikes_not_repeated"] == [300]
    assert v.details["max_ratio"] == pytest.approx(3.0, rel=1e-6)
    assert "not repeated at the confirming step" in v.message and "anchor 300" in v.message
    assert v.steps_compared == ANCHORS.size  # the confirming steps are not anchors of their own
    assert f"{ANCHORS.size} confirming states beside them" in v.message


def test_a_miss_that_the_confirming_step_repeats_fails_at_its_anchor() -> None:
    v = two_step_verdict({301: 3.0, 302: 1.5})
    assert not v.passed
    assert v.details["anchor_step"] == 300 and v.first_divergent_step == 301
    assert v.details["spikes_not_repeated"] == []


def test_a_confirming_step_outside_alone_is_no_failure() -> None:
    # K+2 (from the confirming anchor K+1) only confirms a miss at K+1.
    v = two_step_verdict({302: 5.0})
    assert v.passed, v.message


def test_without_a_confirming_step_an_outright_miss_stands() -> None:
    v = two_step_verdict({301: 3.0}, logged=ANCHORS + 1)  # no confirming anchors (paired)
    assert not v.passed and v.details["anchor_step"] == 300
    assert v.details["confirming_steps"] == 0


def test_a_persistent_gap_fails_whatever_its_confirming_steps_say() -> None:
    v = two_step_verdict({301: 0.9, 326: 0.9})  # 0.9 > 3/4 at two consecutive anchors
    assert not v.passed and v.details["anchor_step"] == 300


def test_the_twins_confirming_steps_size_the_tolerance_beside_their_first() -> None:
    rule = ComparisonRule(metric="loss", method="twin")
    control = Curve("loss", ALL_STEPS.copy(), ALL_CONTROL.copy())
    gaps = np.where(TWO % EVERY == 2, 1e-3, 1e-4)  # the twin's K+2 draws are the larger ones
    twin = Curve("loss", TWO.copy(), ALL_CONTROL[TWO - 1] * (1 + gaps))
    tol = one_step_tolerance(rule, [control], [twin])
    assert isinstance(tol, AnchoredTwinTolerance)
    assert tol.relative_noise == pytest.approx(1e-3, rel=1e-6)
