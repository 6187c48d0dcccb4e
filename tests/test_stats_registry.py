"""Registry, default rules, compare_all, regression and golden curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from simulate import NoiseModel, simulate_run

from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.golden import export_golden, golden_metadata, load_golden
from convergence.regimes import default_rules
from convergence.spec.pair import ComparisonRule
from convergence.stats.registry import compare_all, get_comparison
from convergence.stats.regression import Regression

STEPS = np.arange(1, 51, dtype=np.int64)


def curve(metric: str, values: np.ndarray) -> Curve:
    return Curve(metric, STEPS, np.asarray(values, dtype=np.float64))


def run(scale: float = 1.0, tps: float = 1000.0, mem: float = 500.0) -> RunMetrics:
    loss = 3.0 + np.exp(-STEPS / 10.0)
    return {
        "loss": curve("loss", loss),
        "grad_norm": curve("grad_norm", scale * loss / 3),
        "tokens_per_s": curve("tokens_per_s", np.full(50, tps)),
        "peak_mem_mib": curve("peak_mem_mib", np.full(50, mem)),
    }


def test_get_comparison_and_unknown_method() -> None:
    for method in ("exact", "allclose", "paired", "seed", "regression"):
        assert get_comparison(method).method == method
    with pytest.raises(ValueError, match="unknown comparison method 'bogus'"):
        get_comparison("bogus")


def test_default_rules_per_regime() -> None:
    for regime in ("paired", "seed"):
        rules = {r.metric: r for r in default_rules(regime)}
        assert rules["loss"].method == regime and rules["loss"].gate
        assert rules["grad_norm"].method == regime and rules["grad_norm"].gate
        for metric in ("tokens_per_s", "peak_mem_mib"):
            assert rules[metric].method == "regression" and not rules[metric].gate
    with pytest.raises(ValueError, match="unknown regime"):
        default_rules("bitwise")


def test_compare_all_paired_catches_grad_scale_bug() -> None:
    verdicts = {v.metric: v for v in compare_all(default_rules("paired"), [run()], run())}
    assert all(v.passed for v in verdicts.values())
    verdicts = {
        v.metric: v
        for v in compare_all(default_rules("paired"), [run()], run(scale=2.0, tps=700.0))
    }
    assert verdicts["loss"].passed and not verdicts["grad_norm"].passed
    assert not verdicts["tokens_per_s"].passed and not verdicts["tokens_per_s"].gate


def test_compare_all_seed_uses_every_replicate() -> None:
    rng = np.random.default_rng(0)
    model = NoiseModel(num_steps=50)
    controls = [{"loss": simulate_run(rng, model)} for _ in range(3)]
    rules = [ComparisonRule(metric="loss", method="seed")]
    (verdict,) = compare_all(rules, controls, {"loss": simulate_run(rng, model)})
    assert verdict.details["num_replicates"] == 3


def test_missing_metric_loss_fails_others_do_not_gate() -> None:
    test = run()
    del test["loss"], test["peak_mem_mib"]
    verdicts = {v.metric: v for v in compare_all(default_rules("paired"), [run()], test)}
    assert not verdicts["loss"].passed and verdicts["loss"].gate
    assert "missing in the test run" in verdicts["loss"].message
    assert not verdicts["peak_mem_mib"].gate
    assert "not compared" in verdicts["peak_mem_mib"].message
    control = run()
    del control["grad_norm"]
    verdicts = {v.metric: v for v in compare_all(default_rules("paired"), [control], run())}
    assert (
        not verdicts["grad_norm"].gate and "missing in the control" in verdicts["grad_norm"].message
    )


@pytest.mark.parametrize(
    ("metric", "test_value", "passed"),
    [
        ("tokens_per_s", 950.0, True),
        ("tokens_per_s", 850.0, False),
        ("tokens_per_s", 2000.0, True),
        ("peak_mem_mib", 1050.0, True),
        ("peak_mem_mib", 1200.0, False),
        ("peak_mem_mib", 10.0, True),
    ],
)
def test_regression_is_one_sided(metric: str, test_value: float, passed: bool) -> None:
    control_value = 1000.0
    control = curve(metric, np.full(50, control_value))
    values = np.full(50, test_value)
    values[:3] = 1.0  # warm-up steps are skipped
    rule = ComparisonRule(metric=metric, method="regression", gate=False)
    verdict = Regression().compare(rule, [control], curve(metric, values))
    assert verdict.passed is passed
    assert verdict.details["test_median"] == test_value


def test_regression_threshold_is_configurable() -> None:
    control = curve("tokens_per_s", np.full(50, 1000.0))
    test = curve("tokens_per_s", np.full(50, 850.0))
    rule = ComparisonRule(metric="tokens_per_s", method="regression", max_regression=0.2)
    assert Regression().compare(rule, [control], test).passed


def test_golden_round_trip_is_bit_exact(tmp_path: Path) -> None:
    metrics = run()
    weird = metrics["loss"].values.copy()
    weird[:4] = [0.1 + 0.2, 1 / 3, np.nextafter(1.0, 2.0), 5e-324]
    metrics["loss"] = curve("loss", weird)
    path = export_golden(metrics, tmp_path / "golden" / "loss.json", {"commit": "abc"})
    loaded = load_golden(path)
    assert sorted(loaded) == sorted(metrics)
    for name, original in metrics.items():
        assert loaded[name].steps.tolist() == original.steps.tolist()
        assert loaded[name].values.tobytes() == original.values.tobytes()
    assert golden_metadata(path) == {"commit": "abc"}
    verdicts = compare_all(default_rules("paired"), [loaded], metrics)
    assert all(v.passed for v in verdicts)


def test_golden_errors_name_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    with pytest.raises(FileNotFoundError, match="g.json"):
        load_golden(path)
    path.write_text(json.dumps({"schema": 2, "curves": {}}))
    with pytest.raises(ValueError, match="'schema' is 2"):
        load_golden(path)
    path.write_text(
        json.dumps({"schema": 1, "curves": {"loss": {"steps": [2, 1], "values": [1.0, 2.0]}}})
    )
    with pytest.raises(ValueError, match=r"curves\.loss\.steps.*increasing"):
        load_golden(path)
    with pytest.raises(TypeError, match="JSON-serializable"):
        export_golden(run(), path, {"bad": object()})
