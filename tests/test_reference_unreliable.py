"""A spiky control group is no reference past its first spike (issue 47, item 5), judged on
the saved curves of real runs (benchmarks/detection/envelope/: bf16, twin regime, no training
here): config C's correct FSDP2+TP2 pair leaves the twin envelope at step 104 of 500, after
its control group split at step 46 (a twin's grad norm 2x the control's) -- "reference
unreliable", an error, not a failed test -- while every planted bug of the saved 60-step
pairs fails before any sign, and stays a failure."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats.health import unreliable_from, unreliable_reference
from convergence.stats.twin_envelope import TwinEnvelope
from convergence.stats.types import MetricVerdict

ENVELOPE = Path(__file__).resolve().parents[1] / "benchmarks" / "detection" / "envelope"
METRICS = ("loss", "grad_norm", "grad_norm_parts")


def _cases(path: Path) -> dict[str, Any]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    data.pop("_meta", None)
    return {k: v for k, v in data.items() if isinstance(v, dict) and v.get("twins")}


def _curve(metric: str, run: dict[str, Any]) -> Curve:
    steps, values = run[metric]
    return Curve(metric, np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=float))


def _verdicts(case: dict[str, Any]) -> list[MetricVerdict]:
    return [
        TwinEnvelope().compare(
            ComparisonRule(metric=m, method="twin"),
            [_curve(m, case["control"]), *(_curve(m, t) for t in case["twins"])],
            _curve(m, case["test"]),
        )
        for m in METRICS
    ]


def _unreliable(case: dict[str, Any]) -> tuple[int, str] | None:
    twins = [_curve("grad_norm", t) for t in case["twins"]]
    return unreliable_from(_curve("grad_norm", case["control"]), twins)


def test_config_c_false_alarm_is_an_unreliable_reference() -> None:
    case = _cases(ENVELOPE / "long" / "c-500-anchored.json.gz")["c/fsdp2-tp2/seed7"]
    assert case["kind"] == "correct"
    verdicts = _verdicts(case)
    assert not all(v.passed for v in verdicts)  # today's twin envelope: a false alarm
    unreliable = _unreliable(case)
    assert unreliable is not None
    error = unreliable_reference(verdicts, unreliable)
    assert error is not None and error.startswith(
        f"reference unreliable after step {unreliable[0] - 1}"
    )


@pytest.mark.parametrize("name", ["c-7-v2", "c-8", "c-9", "b-9"])
def test_planted_bugs_still_fail(name: str) -> None:
    bugs = {
        k: c
        for k, c in _cases(ENVELOPE / "curves" / f"{name}.json.gz").items()
        if c["kind"] == "bug"
    }
    assert bugs
    for key, case in bugs.items():
        verdicts = _verdicts(case)
        assert not all(v.passed for v in verdicts), key
        assert unreliable_reference(verdicts, _unreliable(case)) is None, key
