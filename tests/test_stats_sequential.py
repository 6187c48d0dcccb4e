"""Early stopping: decides broken runs by a small step, never good ones, NaN at once."""

from __future__ import annotations

import numpy as np
from simulate import NoiseModel, simulate_run

from convergence.metrics.curve import Curve, RunMetrics
from convergence.regimes import default_rules
from convergence.spec.pair import ComparisonRule
from convergence.stats.sequential import SequentialMonitor

STEPS = np.arange(1, 201, dtype=np.int64)


def paired_run(grad_scale: float = 1.0, noise: float = 0.0) -> RunMetrics:
    loss = 2.0 + 8.0 * np.exp(-STEPS / 30.0) + noise * np.sin(STEPS)
    return {
        "loss": Curve("loss", STEPS, loss),
        "grad_norm": Curve("grad_norm", STEPS, grad_scale * (1 + np.exp(-STEPS / 50.0))),
        "tokens_per_s": Curve("tokens_per_s", STEPS, np.full(200, 1000.0)),
    }


def feed(monitor: SequentialMonitor, run: RunMetrics) -> int | None:
    """Step at which the monitor decided (None: never)."""
    for i, step in enumerate(STEPS.tolist()):
        record = {name: float(curve.values[i]) for name, curve in run.items()}
        record["step"] = step
        if monitor.update(step, record).decided:
            return step
    return None


def test_paired_good_run_never_decides() -> None:
    monitor = SequentialMonitor(default_rules("paired"), [paired_run()])
    assert feed(monitor, paired_run(noise=1e-6)) is None
    assert not monitor.decision.decided


def test_paired_broken_run_decides_early() -> None:
    monitor = SequentialMonitor(default_rules("paired"), [paired_run()], min_step=5, patience=3)
    step = feed(monitor, paired_run(grad_scale=2.0))
    assert step == 7  # steps 5, 6, 7 clearly outside
    assert monitor.decision.failed and monitor.decision.metric == "grad_norm"
    assert "3 consecutive" in monitor.decision.reason


def test_past_last_step_only_a_nan_stops_the_test() -> None:
    """Where a check judges the steps past ``last_step`` (the anchored check's horizon), a
    trajectory's excursion there does not stop the test; a NaN loss still does."""
    broken = paired_run(grad_scale=2.0)
    monitor = SequentialMonitor(
        default_rules("paired"), [paired_run()], min_step=5, patience=3, last_step=6
    )
    assert feed(monitor, broken) is None  # outside from step 5, but only 2 steps by step 6
    monitor = SequentialMonitor(default_rules("paired"), [paired_run()], last_step=6)
    assert not monitor.update(50, {"step": 50, "loss": 1.0}).decided
    assert monitor.update(51, {"step": 51, "loss": float("inf")}).decided


def test_nan_loss_decides_at_once() -> None:
    monitor = SequentialMonitor(default_rules("paired"), [paired_run()])
    assert not monitor.update(1, {"step": 1, "loss": 10.0}).decided
    decision = monitor.update(2, {"step": 2, "loss": float("nan")})
    assert decision.decided and decision.metric == "loss" and decision.step == 2
    assert monitor.update(3, {"step": 3, "loss": 1.0}).decided  # stays decided


def test_isolated_excursions_reset_the_streak() -> None:
    monitor = SequentialMonitor(
        [ComparisonRule(metric="loss", method="paired")], [paired_run()], min_step=1, patience=3
    )
    control = paired_run()["loss"].values
    for step in range(1, 60):
        bump = 1.0 if step % 3 == 0 else 0.0  # outside every third step only
        value = float(control[step - 1] + bump)
        assert not monitor.update(step, {"step": step, "loss": value}).decided


def test_non_gating_and_regression_rules_never_stop() -> None:
    rules = [
        ComparisonRule(metric="grad_norm", method="paired", gate=False),
        ComparisonRule(metric="tokens_per_s", method="regression", gate=True),
    ]
    slow = paired_run(grad_scale=5.0)
    slow["tokens_per_s"] = Curve("tokens_per_s", STEPS, np.full(200, 1.0))
    assert feed(SequentialMonitor(rules, [paired_run()]), slow) is None


def test_key_map_reads_the_trainers_own_names() -> None:
    monitor = SequentialMonitor(
        default_rules("paired"), [paired_run()], key_map={"train_loss": "loss"}
    )
    assert monitor.update(1, {"step": 1, "train_loss": float("inf")}).decided


def test_seed_band_good_runs_never_decide_broken_runs_do() -> None:
    model = NoiseModel()
    rng = np.random.default_rng(11)
    rules = default_rules("seed")[:1]
    for _ in range(20):
        controls = [{"loss": simulate_run(rng, model)} for _ in range(3)]
        good = {"loss": simulate_run(rng, model)}
        assert feed(SequentialMonitor(rules, controls), good) is None
    controls = [{"loss": simulate_run(rng, model)} for _ in range(3)]
    broken = {"loss": simulate_run(rng, model, shift=0.5, shift_from=40)}
    step = feed(SequentialMonitor(rules, controls), broken)
    assert step is not None and 40 <= step <= 45
