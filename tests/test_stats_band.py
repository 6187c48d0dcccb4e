"""Every verdict carries its band (the exact range the test had to stay in, per compared step),
and the reports draw from it instead of re-deriving tolerances."""

from __future__ import annotations

import json

import numpy as np
import pytest
from report_examples import failing_pair, seed_pair
from simulate import NoiseModel, simulate_case

from convergence.metrics.curve import Curve
from convergence.report.data.curves import reference_curve, replicate_band
from convergence.report.data.serialize import outcome_from_json, outcome_to_json
from convergence.report.formats.plots import tolerance_envelope
from convergence.spec.pair import ComparisonRule
from convergence.stats.allclose import AllClose
from convergence.stats.paired_band import PairedBand
from convergence.stats.regression import WARMUP_STEPS, Regression
from convergence.stats.seed_band import SeedBand, seed_band
from convergence.stats.types import Band, Comparison, MetricVerdict

STEPS = np.arange(1, 61, dtype=np.int64)


def _loss(offset: float | np.ndarray = 0.0) -> Curve:
    return Curve("loss", STEPS, 2.0 + 8.0 * np.exp(-STEPS / 30.0) + offset)


def _outside(verdict: MetricVerdict, test: Curve) -> list[int]:
    """Steps where the test left its verdict's band, recomputed from the band alone."""
    assert verdict.band is not None
    lookup = dict(zip(test.steps.tolist(), test.values.tolist(), strict=True))
    return [
        s
        for s, lo, hi in zip(
            verdict.band.steps, verdict.band.lower, verdict.band.upper, strict=True
        )
        if not lo <= lookup[s] <= hi
    ]


@pytest.mark.parametrize(
    ("comparison", "params"),
    [(PairedBand(), {}), (AllClose(), {"atol": 1e-4, "rtol": 1e-5})],
    ids=["paired", "allclose"],
)
def test_pointwise_band_is_the_range_the_verdict_checked(
    comparison: Comparison, params: dict[str, float]
) -> None:
    rule = ComparisonRule(metric="loss", method=comparison.method, **params)  # type: ignore[arg-type]
    shift = np.where(STEPS >= 20, 5e-3, 1e-7)
    test = _loss(shift)
    verdict = comparison.compare(rule, [_loss()], test)
    assert verdict.band is not None and verdict.band.steps == tuple(STEPS.tolist())
    outside = _outside(verdict, test)
    assert not verdict.passed and outside[0] == verdict.first_divergent_step == 20
    assert len(outside) == verdict.details["steps_outside"] == 41
    # The band is centred on the control, its half-width the tolerance in force.
    step = verdict.max_deviation_step
    assert step is not None and verdict.tolerance_at_max is not None
    i = verdict.band.steps.index(step)
    half = (verdict.band.upper[i] - verdict.band.lower[i]) / 2
    assert half == pytest.approx(verdict.tolerance_at_max, rel=1e-9)
    assert comparison.compare(rule, [_loss()], _loss(1e-7)).passed


def test_seed_band_is_the_band_the_verdict_checked() -> None:
    rng = np.random.default_rng(8)
    model = NoiseModel()
    controls, test = simulate_case(rng, model, 4, shift=5 * model.sigma_step, shift_from=120)
    rule = ComparisonRule(metric="loss", method="seed")
    verdict = SeedBand().compare(rule, controls, test)
    assert verdict.band is not None and len(verdict.band.steps) == verdict.steps_compared
    outside = _outside(verdict, test)
    assert outside[0] == verdict.first_divergent_step
    assert len(outside) == verdict.details["steps_outside"]
    full = seed_band(controls)
    np.testing.assert_allclose(
        np.add(verdict.band.lower, verdict.band.upper) / 2, full.center, rtol=1e-14
    )


def test_regression_band_is_the_limit_on_the_median() -> None:
    steps = np.arange(1, 21, dtype=np.int64)
    control = Curve("tokens_per_s", steps, np.full(20, 1000.0))
    rule = ComparisonRule(
        metric="tokens_per_s", method="regression", max_regression=0.2, gate=False
    )
    slow = Regression().compare(rule, [control], Curve("tokens_per_s", steps, np.full(20, 790.0)))
    assert not slow.passed and slow.band is not None
    assert slow.band.steps == tuple(range(WARMUP_STEPS + 1, 21))
    assert slow.band.lower == pytest.approx([800.0] * 17) and set(slow.band.upper) == {np.inf}
    memory = Regression().compare(
        ComparisonRule(metric="peak_mem_mib", method="regression"),
        [Curve("peak_mem_mib", steps, np.full(20, 100.0))],
        Curve("peak_mem_mib", steps, np.full(20, 105.0)),
    )
    assert memory.passed and memory.band is not None
    assert set(memory.band.lower) == {-np.inf}
    assert memory.band.upper == pytest.approx([110.0] * 17)


@pytest.mark.parametrize("method", ["paired", "allclose", "seed"])
def test_a_test_that_stopped_early_still_gets_the_whole_band(method: str) -> None:
    rule = ComparisonRule(metric="loss", method=method)
    controls = [_loss(0.01 * k) for k in range(3 if method == "seed" else 1)]
    verdict = {"paired": PairedBand(), "allclose": AllClose(), "seed": SeedBand()}[method].compare(
        rule, controls, _loss().upto(20)
    )
    assert not verdict.passed and "ends at step 20" in verdict.message
    assert verdict.band is not None and verdict.band.steps == tuple(STEPS.tolist())


def test_band_needs_one_entry_per_step() -> None:
    with pytest.raises(ValueError, match="one entry per step"):
        Band((1, 2), (0.0,), (1.0, 2.0))


def test_band_survives_the_outcome_round_trip_and_old_outcomes_still_load() -> None:
    outcome = failing_pair()
    data = json.loads(json.dumps(outcome_to_json(outcome), allow_nan=False))
    back = outcome_from_json(data)
    assert back.verdicts == outcome.verdicts and all(v.band for v in back.verdicts)
    for verdict in data["verdicts"]:
        del verdict["band"]  # saved before verdicts carried their band
    old = outcome_from_json(data)
    assert [v.band for v in old.verdicts] == [None] * len(old.verdicts)
    assert old.verdicts[0].message == outcome.verdicts[0].message


def test_plots_and_curves_read_the_verdict_band() -> None:
    outcome = failing_pair()
    verdict = outcome.verdict("loss")
    assert verdict is not None and verdict.band is not None and outcome.control is not None
    control = outcome.control.metrics["loss"]
    envelope = tolerance_envelope(verdict, control.steps, control.values)
    assert envelope is not None
    lower, upper = envelope
    np.testing.assert_allclose(upper - lower, np.subtract(verdict.band.upper, verdict.band.lower))
    assert replicate_band(outcome, "loss") is None  # paired: the reference is the control
    # Seed regime: the reference curve is the centre of the band the verdict held the test to.
    seed = seed_pair()
    seed_verdict = seed.verdict("loss")
    band = replicate_band(seed, "loss")
    ref = reference_curve(seed, "loss")
    assert seed_verdict is not None and seed_verdict.band is not None
    assert band is not None and ref is not None and band.num_replicates == 3
    assert ref.values.tolist() == band.center.tolist()
    assert band.steps.tolist() == list(seed_verdict.band.steps)
