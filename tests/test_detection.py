"""The detection benchmark's CI subset: planted bugs of benchmarks/detection/ must fail with
the default rules (on the metric that witnesses them), a correct pair must pass.

The whole catalogue (13 bugs, 22 correct pairs) is `python benchmarks/detection/run.py`; its
numbers are in BENCHMARKS.md. Here: three cheap 2-rank bugs -- one that only the grad norm sees
(Adam hides a gradient scale from the loss), one that only data shows, one reduction missing a
rank --, a 4-rank position bug that only the per-part grad norm sees at first, and one correct
pair through the same hook machinery.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import by_name  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.run.outcome import PairOutcome  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.pair import PairSpec  # noqa: E402

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("detection")

STEPS = 12
CASES = (
    "ddp-sum-not-average",
    "dp-ranks-read-same-shard",
    "fsdp-dp-rank-dropped",
    "cp-rope-ignores-offset",
    "fsdp2-noop-hook",
)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairSpec]:
    return build_pairs([by_name(n) for n in CASES], tmp_path_factory.mktemp("exp"), steps=STEPS)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(
        RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=180, wall_limit_s=600)
    )


def _failed_on(outcome: PairOutcome, metric: str) -> int | None:
    """The first divergent step of ``metric``, which must have failed the pair."""
    assert outcome.status == "failed", (
        outcome.status,
        outcome.error,
        [v.message for v in outcome.verdicts],
    )
    verdict = outcome.verdict(metric)
    assert verdict is not None and not verdict.passed and verdict.gate, verdict
    return verdict.first_divergent_step


def test_gradient_sum_instead_of_average_is_caught_by_grad_norm_only(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    outcome = runner.run_pair(pairs["ddp-sum-not-average"])
    assert _failed_on(outcome, "grad_norm") == 1
    # Summed over 2 ranks instead of averaged: the step-1 gradient (same weights) is exactly 2x.
    assert outcome.control is not None and outcome.test is not None
    control, test = outcome.control.metrics["grad_norm"], outcome.test.metrics["grad_norm"]
    assert test.values[0] / control.values[0] == pytest.approx(2.0, rel=1e-4)
    # Adam normalises a uniform gradient scale away: the loss alone would have passed it.
    loss = outcome.verdict("loss")
    assert loss is not None and loss.passed, loss.message
    # Early stopping decided it long before the end.
    assert outcome.stopped_early_at is not None and outcome.stopped_early_at < STEPS


def test_ranks_reading_the_same_shard_is_caught_by_the_loss(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    outcome = runner.run_pair(pairs["dp-ranks-read-same-shard"])
    assert _failed_on(outcome, "loss") == 1


def test_reduction_missing_a_rank_is_caught(runner: Runner, pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["fsdp-dp-rank-dropped"])
    assert _failed_on(outcome, "grad_norm") == 1


@pytest.mark.rounding
def test_position_bug_is_caught_at_step_1_by_the_per_part_grad_norm(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    """CP rotary angles without the chunk offset: at step 1 the attention is nearly uniform,
    so the loss and the total grad norm move less than their tolerances (on the Markov data the
    loss first diverged at step 16 of 30); the query/key gradients move ~3e-3 relative."""
    outcome = runner.run_pair(pairs["cp-rope-ignores-offset"])
    assert _failed_on(outcome, "grad_norm_parts") == 1
    total = outcome.verdict("grad_norm")
    assert total is not None and (total.passed or (total.first_divergent_step or 0) > 1)
    assert outcome.test is not None
    parts = outcome.test.metrics["grad_norm_parts"]
    assert len(parts) >= 1 and parts.values[0] > 0


def test_correct_pair_through_a_hook_passes(runner: Runner, pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["fsdp2-noop-hook"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    loss = outcome.verdict("loss")
    assert loss is not None and loss.steps_compared == STEPS
