"""The dense-anchor re-judge (benchmarks/detection/far_draws.py): its disjoint series, its
Clopper-Pearson bound and its pseudo-pair verdicts, on a small saved run (held-back config E,
fp32, seed 2, 30 steps, FSDP2+TP2 against FSDP2, an anchor at every step: far.py --steps 30
--anchor-every 1 --layouts fsdp2-tp2). No training."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

DETECTION = Path(__file__).resolve().parents[1] / "benchmarks" / "detection"
sys.path.insert(0, str(DETECTION))

import far_draws  # noqa: E402
import far_judge  # noqa: E402

from convergence.metrics.curve import Curve  # noqa: E402

SAVED = Path(__file__).resolve().parent / "fixtures" / "far_draws" / "e-fp32-s2-30-correct.json.gz"


def test_series_are_disjoint_and_at_the_judges_spacing() -> None:
    series = far_draws.disjoint_series(range(1, 60), every=10, length=5)
    # a 60-step run's anchors 1..59: ten series {k, .., k + 40}; the real pair's is k = 10
    assert series == [tuple(range(k, k + 50, 10)) for k in range(1, 11)]
    assert far_draws.pair_anchors(60) == 5
    # a missing anchor removes its series, and no anchor is reused to fill the gap
    holey = far_draws.disjoint_series([a for a in range(1, 60) if a != 23], every=10, length=5)
    flat = [a for s in holey for a in s]
    assert len(flat) == len(set(flat))
    assert all(23 not in s for s in holey)
    assert all(np.all(np.diff(s) == 10) and len(s) == 5 for s in holey)
    assert len(holey) == 9  # k = 3 lost; 13 and 33 start no whole series either


def test_clopper_pearson_upper_end_of_a_rate() -> None:
    # 0 alarms in n: 1 - 0.025 ** (1 / n); 1 % needs 368
    assert far_judge.clopper_pearson(0, 368)[1] <= 0.01 < far_judge.clopper_pearson(0, 367)[1]
    low, high = far_judge.clopper_pearson(1, 100)
    assert 0 < low < 0.01 < high
    assert high == pytest.approx(0.0545, abs=5e-4)


def _group() -> far_judge.Group:
    return far_judge.load(SAVED)


def test_pseudo_pairs_of_a_saved_dense_run() -> None:
    group = _group()
    assert group.anchor_every == 1 and group.steps == 30
    pps = far_draws.pseudo_pairs(group)
    # 29 anchors (1..29), a 30-step pair gets 2 (10, 20): from anchor 10, {k, k + 10},
    # k = 10..19; from anchor 1, k = 1..10
    assert [p.anchors for p in pps] == [(k, k + 10) for k in range(10, 20)]
    early = far_draws.pseudo_pairs(group, first=1)
    assert [p.anchors for p in early] == [(k, k + 10) for k in range(1, 11)]
    assert all(p.passed for p in pps), [p.message for p in pps if not p.passed]
    shares = [s for p in pps for s in p.shares]
    assert len(shares) == 20 and all(0 <= s < 1 for s in shares)
    rows = far_draws.draw_rows(pps)
    assert rows[0].split("|")[4].strip() == "20"  # one-step draws
    pair = far_draws.pair_rows(pps)[0].split("|")
    assert pair[3].strip() == "10" and pair[5].strip() == "0 (0 / 0)"  # pseudo-pairs, alarms
    assert pair[7].strip() == f"{far_judge.clopper_pearson(0, 10)[1]:.2%}"


def test_a_gap_planted_at_one_anchor_fails_only_its_series() -> None:
    group = _group()
    layout = "fsdp2-tp2"
    anchored = dict(group.anchored[layout])
    loss = anchored["loss"]
    values = loss.values.copy()
    values[loss.steps == 24] *= 1.01  # one step from anchor 23, far past the fp32 floor
    anchored["loss"] = Curve("loss", loss.steps, values)
    bad = dataclasses.replace(group, anchored={layout: anchored})
    verdicts = {p.anchors: p for p in far_draws.pseudo_pairs(bad)}
    assert not verdicts[(13, 23)].passed
    assert verdicts[(13, 23)].shares[1] > 1
    assert all(p.passed for a, p in verdicts.items() if a != (13, 23))


def test_consecutive_shares_correlation() -> None:
    rising = {a: float(a) for a in range(1, 30)}
    assert far_draws.lag_correlation(rising, 1) == (pytest.approx(1.0), 28)
    alternating = {a: float(a % 2) + a * 1e-6 for a in range(1, 30)}
    assert far_draws.lag_correlation(alternating, 1)[0] < 0


def test_the_series_at_the_judges_anchors_is_the_real_pairs_verdict() -> None:
    # anchors 10 and 20 of the dense run are what the default judge gives a 30-step pair:
    # the pseudo-pair there must be far_judge's (and so the Runner's) anchored judgement
    group = _group()
    mine = far_draws.judge_series(group, "fsdp2-tp2", (10, 20))
    real = far_judge.judge_pair(group, "fsdp2-tp2", "anchored-judge")
    assert real is not None and real.status == "passed" and mine.passed
    assert mine.shares == pytest.approx(real.anchor_shares, rel=1e-12)


def test_pp_and_hsdp_counted_as_one_layout() -> None:
    def pp(layout: str, passed: bool, shares: tuple[float, ...]) -> far_draws.PseudoPair:
        return far_draws.PseudoPair("e", 2, "fp32", layout, (10, 20), passed, shares, layout)

    pps = [
        pp("fsdp2-tp2", True, (0.1, 0.2)),
        pp("fsdp2-pp2-1f1b", True, (0.3, 0.05)),
        pp("hsdp2x2", False, (0.2, 1.5)),
    ]
    merged = far_draws.as_one(pps)
    assert len(merged) == 2
    one = next(p for p in merged if p.layout == "fsdp2-pp2-1f1b+hsdp2x2")
    # one draw: fails if either fails, each anchor's share the larger
    assert not one.passed and one.shares == (0.3, 1.5) and one.message == "hsdp2x2"
    rows = [layout for _, layout, _ in far_draws.table_cells(pps)]
    assert rows == ["fsdp2-pp2-1f1b", "fsdp2-tp2", "hsdp2x2", "all", far_draws.AS_ONE_ROW]
    pair = far_draws.pair_rows(pps)[-1].split("|")
    assert pair[3].strip() == "2" and pair[5].strip() == "1 (1 / 0)"
