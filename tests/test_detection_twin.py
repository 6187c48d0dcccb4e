"""The twin regime end to end on CPU bf16 (FSDP2 mixed precision on both sides): the control's
twin runs beside it, a correct layout passes inside the measured envelope, and a planted bug
that the seed band let through (a CP causal mask without the shard offset: BENCHMARKS.md,
"Verdict quality in bf16") fails at the first steps.

The calibration over the whole catalogue is benchmarks/detection/twin_calibration.py.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import PRECISION, by_name  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.run.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.pair import PairSpec  # noqa: E402

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("detection_twin")

STEPS = 8
CASES = ("fsdp2-tp2", "cp-mask-ignores-offset")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairSpec]:
    cases = [
        dataclasses.replace(
            by_name(n),
            precision="bf16",
            techniques={**by_name(n).techniques, "param_dtype": "bfloat16"},
        )
        for n in CASES
    ]
    return build_pairs(cases, tmp_path_factory.mktemp("exp"), steps=STEPS)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(
        RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=180, wall_limit_s=600)
    )


def test_bf16_pairs_default_to_the_twin_regime(pairs: dict[str, PairSpec]) -> None:
    for pair in pairs.values():
        assert pair.regime == "twin"
        assert pair.rule_for("loss") is not None and pair.rule_for("loss").method == "twin"


@pytest.mark.rounding
def test_correct_bf16_layout_passes_inside_the_measured_envelope(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    outcome = runner.run_pair(pairs["fsdp2-tp2"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    assert outcome.control is not None and outcome.control.twins
    twin_loss = outcome.control.twins[0]["loss"]  # the noise twin
    control_loss = outcome.control.metrics["loss"]
    assert len(twin_loss) == len(control_loss) == STEPS
    # bf16 with another DP degree is not bitwise equal: the twin measured real noise.
    assert (twin_loss.values != control_loss.values).any()
    # The forward-noise twin (Backend.forward_twin) ran beside it and moved the curve from
    # step 1 on, where the DP twin's forward is still bit-identical to the control's.
    assert len(outcome.control.twins) == 2
    forward_loss = outcome.control.twins[1]["loss"]
    assert forward_loss.values[0] != control_loss.values[0]
    loss = outcome.verdict("loss")
    assert loss is not None and loss.method == "twin" and loss.details["twin_noise_max"] > 0
    assert loss.band is not None and len(loss.band.steps) == STEPS  # drawn by the plots
    width = [u - lo for lo, u in zip(loss.band.lower, loss.band.upper, strict=True)]
    assert all(w > 0 for w in width) and width[-1] > width[0]  # grows with the twin's noise


@pytest.mark.rounding
def test_cp_mask_bug_that_the_seed_band_missed_fails_early(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    outcome = runner.run_pair(pairs["cp-mask-ignores-offset"])
    assert outcome.status == "failed", [v.message for v in outcome.verdicts]
    first = min(
        v.first_divergent_step or STEPS + 1 for v in outcome.verdicts if v.gate and not v.passed
    )
    assert first <= 2


@pytest.mark.rounding
@pytest.mark.slow
def test_a_bf16_reduce_test_against_an_fp32_control_is_judged_by_its_own_noise(
    runner: Runner, tmp_path: Path
) -> None:
    # Noise from the noisier side (issue 28): the control's twin run with the test's reduce
    # dtype joins the envelope, so the correct pair passes and the dropped DP rank still fails.

    cases = [c for c in PRECISION if "reduce" in c.name]
    pairs = build_pairs(cases, tmp_path, steps=STEPS)
    correct = runner.run_pair(pairs["fsdp2-bf16-reduce"])
    assert correct.pair.regime == "twin"
    assert correct.status == "passed", [v.message for v in correct.verdicts]
    assert correct.control is not None and len(correct.control.twins) == 2  # fp32: no fwd twin
    bug = runner.run_pair(pairs["fsdp-dp-rank-dropped-bf16-reduce"])
    assert bug.status == "failed"
