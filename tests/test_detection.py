"""The detection benchmark's CI subset: planted bugs of benchmarks/detection/ must fail with
the default rules (on the metric that witnesses them), a correct pair must pass.

The whole catalogue (12 bugs, 22 correct pairs) is `python benchmarks/detection/run.py`; its
numbers are in BENCHMARKS.md. Here: three cheap 2-rank bugs -- one that only the grad norm sees
(Adam hides a gradient scale from the loss), one that only data shows, one reduction missing a
rank -- and one correct pair through the same hook machinery.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import by_name  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.outcome import PairOutcome  # noqa: E402
from convergence.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.pair import PairSpec  # noqa: E402

STEPS = 12
CASES = ("ddp-sum-not-average", "dp-ranks-read-same-shard", "fsdp-dp-rank-dropped",
         "fsdp2-noop-hook")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairSpec]:
    return build_pairs([by_name(n) for n in CASES], tmp_path_factory.mktemp("exp"), steps=STEPS)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=180,
                              wall_limit_s=600))


def _failed_on(outcome: PairOutcome, metric: str) -> int | None:
    """The first divergent step of ``metric``, which must have failed the pair."""
    assert outcome.status == "failed", (outcome.status, outcome.error,
                                        [v.message for v in outcome.verdicts])
    verdict = outcome.verdict(metric)
    assert verdict is not None and not verdict.passed and verdict.gate, verdict
    return verdict.first_divergent_step


def test_gradient_sum_instead_of_average_is_caught_by_grad_norm_only(
        runner: Runner, pairs: dict[str, PairSpec]) -> None:
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
        runner: Runner, pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["dp-ranks-read-same-shard"])
    assert _failed_on(outcome, "loss") == 1


def test_reduction_missing_a_rank_is_caught(runner: Runner,
                                            pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["fsdp-dp-rank-dropped"])
    assert _failed_on(outcome, "grad_norm") == 1


def test_correct_pair_through_a_hook_passes(runner: Runner,
                                            pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["fsdp2-noop-hook"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    loss = outcome.verdict("loss")
    assert loss is not None and loss.steps_compared == STEPS
