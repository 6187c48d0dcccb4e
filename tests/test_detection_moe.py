"""Three planted MoE / expert-parallel bugs of the catalogue (benchmarks/detection/
detection_bugs/moe.py) fail at step 1 with the default rules, on the built-in trainer, fp32,
real torchrun/gloo jobs: FSDP2 control vs FSDP2 + EP2 of train_configs/moe_debug.toml, 3 steps,
one control shared by the three (run cache). The whole catalogue, fp32 and bf16, is
benchmarks/detection/moe_bugs.py (BENCHMARKS.md).

- the router's gradient not reduced over the data-parallel ranks: only the router's part of
  the per-part grad norm moves (the total, dominated by the output layer, hardly does);
- the balance loss from local tokens: the router's gradient again, a loss-side bug;
- the routing weights not applied at the combine: every part from step 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import by_moe_name  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.run.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.pair import PairSpec  # noqa: E402

pytestmark = pytest.mark.xdist_group("detection-moe")

STEPS = 3
CASES = ("moe-router-grad-not-reduced", "moe-aux-loss-local-tokens", "moe-combine-unweighted")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairSpec]:
    cases = [by_moe_name(name) for name in CASES]
    config = ROOT / "train_configs" / "moe_debug.toml"
    return build_pairs(cases, tmp_path_factory.mktemp("exp"), steps=STEPS, config=config)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(
        RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=180, wall_limit_s=600)
    )


@pytest.mark.parametrize("name", CASES)
def test_a_planted_moe_bug_fails_at_step_1(
    runner: Runner, pairs: dict[str, PairSpec], name: str
) -> None:
    outcome = runner.run_pair(pairs[name])
    messages = [v.message for v in outcome.verdicts]
    assert outcome.status == "failed", (outcome.status, outcome.error, messages)
    parts = outcome.verdict("grad_norm_parts")
    assert parts is not None and parts.gate and not parts.passed, messages
    assert parts.first_divergent_step == 1, messages
    assert outcome.verdict("data_fingerprint").passed  # type: ignore[union-attr]
