"""Routing flips at the anchored steps (convergence/stats/routing_flips.py): an anchor where the
test's one step and an anchored twin's both routed tokens to other experts than the control
is a flip anchor, judged without the anchored check's persistence rule (never without its
tolerance); a layout that moves tokens where no twin does, or a dense model, gets no exemption.
Synthetic routing counts with known answers, judged by the real anchored verdict."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.jsonl import ROUTING_PREFIX, read_prefixed
from convergence.spec.pair import ComparisonRule
from convergence.stats.anchored import anchored_verdict, one_step_tolerance
from convergence.stats.routing_flips import flip_steps, tokens_moved

EVERY = 10
STEPS = np.arange(EVERY, 100, EVERY, dtype=np.int64) + 1  # 11 .. 91: 9 anchored steps
CONTROL = 2.0 + 3.0 * np.exp(-STEPS / 100.0)
#: Two layers of 4 experts, 64 assignments each; the control's counts at every step.
COUNTS = np.array([[20, 16, 16, 12], [10, 30, 14, 10]])


def routing(moved_at: dict[int, int] | None = None) -> RunMetrics:
    """Routing counts equal to the control's, except that at the given steps that many
    assignments of layer 0 moved from expert 0 to expert 1."""
    moved_at = moved_at or {}
    out: RunMetrics = {}
    for layer, row in enumerate(COUNTS):
        for expert, count in enumerate(row):
            values = np.full(STEPS.shape, float(count))
            if layer == 0 and expert in (0, 1):
                sign = -1 if expert == 0 else 1
                values += sign * np.array([moved_at.get(int(s), 0) for s in STEPS], float)
            name = f"{ROUTING_PREFIX}{layer}.{expert}"
            out[name] = Curve(name, STEPS.copy(), values)
    return out


def loss(values: np.ndarray) -> RunMetrics:
    return {"loss": Curve("loss", STEPS.copy(), np.asarray(values, dtype=np.float64))}


def test_tokens_moved_counts_assignments_sent_to_another_expert() -> None:
    assert tokens_moved(routing(), routing({31: 3, 51: 1})) == {
        int(s): {31: 3, 51: 1}.get(int(s), 0) for s in STEPS
    }
    assert tokens_moved(loss(CONTROL), loss(CONTROL)) == {}  # a dense model: no counts


def test_a_flip_anchor_needs_the_test_and_a_twin_to_move_tokens() -> None:
    test = routing({21: 4, 31: 2, 41: 5})
    twins = [routing(), routing({21: 1, 41: 9, 61: 3})]
    assert flip_steps(routing(), test, twins) == {21, 41}
    assert flip_steps(routing(), test, [routing()]) == set()  # no twin flips: no exemption
    assert flip_steps(loss(CONTROL), loss(CONTROL), [loss(CONTROL)]) == set()


def _verdict(gap: np.ndarray, test_moves: dict[int, int], twin_moves: dict[int, int]):
    """A twin-rule verdict of a test whose loss gap at each anchor is ``gap`` x the one-step
    tolerance, with the given routing moves of the test and of one anchored twin."""
    rule = ComparisonRule(metric="loss", method="twin")
    twin_values = [CONTROL * (1 + 3e-4 * np.cos(STEPS)), CONTROL * (1 + 2e-4 * np.sin(STEPS))]
    control = loss(CONTROL)["loss"]
    twins = [loss(v)["loss"] for v in twin_values]
    tol = one_step_tolerance(rule, [control], twins)
    assert tol is not None
    limit = tol.at(np.ones_like(STEPS), CONTROL)
    test = {**loss(CONTROL + gap * limit), **routing(test_moves)}
    anchored_twins = [{**loss(twin_values[0]), **routing(twin_moves)}, {**loss(twin_values[1])}]
    return anchored_verdict(
        [rule],
        [{**loss(CONTROL), **routing()}],
        test,
        every=EVERY,
        anchored_twins=anchored_twins,
    )


def test_a_persistent_gap_at_flip_anchors_passes_but_the_tolerance_still_holds() -> None:
    gap = np.where(np.isin(STEPS, [71, 81]), 0.85, 0.1)  # over 3/4 of the envelope twice
    every_step = {int(s): 5 for s in STEPS}
    # Without flips (a dense model, or the same routing): the persistence rule fails it.
    plain = _verdict(gap, {}, {})
    assert not plain.passed and plain.details["anchor_step"] == 70, plain.message
    # The test and a twin flip at both anchors: the flips are the model's own noise there.
    flipped = _verdict(gap, every_step, every_step)
    assert flipped.passed, flipped.message
    assert flipped.details["flip_anchors"] == [int(s) - 1 for s in STEPS]
    assert "routing flips the twins share" in flipped.message
    # The test moves tokens where no twin does (a dispatch or router bug): no exemption.
    alone = _verdict(gap, every_step, {})
    assert not alone.passed and alone.details["flip_anchors"] == []
    # A flip anchor outside the whole tolerance still fails.
    outside = _verdict(np.where(STEPS == 51, 1.3, 0.1), every_step, every_step)
    assert not outside.passed and outside.details["anchor_step"] == 50


def test_the_routing_counts_are_read_beside_the_part_norms(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 2.0, "grad_norm/wq": 0.5, "moe_tokens/1.0": 12, "moe_tokens/1.1": 4}\n'
        '{"step": 2, "loss": 1.9, "grad_norm/wq": 0.4, "moe_tokens/1.0": 10, "moe_tokens/1.1": 6}\n'
    )
    read = read_prefixed(path, ROUTING_PREFIX)
    assert sorted(read) == ["moe_tokens/1.0", "moe_tokens/1.1"]
    assert read["moe_tokens/1.1"].values.tolist() == [4.0, 6.0]
    steps = np.array([1, 2])
    moved = {  # one assignment of layer 1 moved from expert 0 to expert 1 at step 2
        "moe_tokens/1.0": Curve("moe_tokens/1.0", steps, np.array([12.0, 9.0])),
        "moe_tokens/1.1": Curve("moe_tokens/1.1", steps, np.array([4.0, 7.0])),
    }
    assert tokens_moved(read, moved) == {1: 0, 2: 1}
