"""The false-alarm benchmark's re-judge (benchmarks/detection/far_judge.py) on its saved curves:
no training. The offline verdict must be the one the Runner gave when the curves were made
(the same rules and anchors), or the table's other rules are judged by something else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DETECTION = Path(__file__).resolve().parents[1] / "benchmarks" / "detection"
sys.path.insert(0, str(DETECTION))

import far_judge  # noqa: E402

SAVED = sorted(far_judge.CURVES.glob("a-*.json.gz"))


@pytest.mark.skipif(not SAVED, reason="no saved curves of config A")
def test_rejudge_gives_the_runners_verdict() -> None:
    group = far_judge.load(SAVED[0])
    assert group.pairs, "a saved group holds pairs"
    for case, pair in group.pairs.items():
        judged = far_judge.judge_pair(group, case, far_judge.AS_RUN)
        assert judged is not None, case
        expected = {"error": "unreliable"}.get(pair["status"], pair["status"])
        assert judged.status == expected, (case, pair["status"], judged)


@pytest.mark.skipif(not SAVED, reason="no saved curves of config A")
def test_tables_count_every_correct_pair_once() -> None:
    group = far_judge.load(SAVED[0])
    correct = sum(p["kind"] == "correct" for p in group.pairs.values())
    rows = far_judge.false_alarm_rows([group], "t")
    assert len(rows) == len(far_judge.RULES)  # one precision per group, every rule
    for row in rows:
        assert row.split("|")[5].strip() == str(correct)


def test_clopper_pearson_known_values() -> None:
    # 0 of n: the upper end is 1 - 0.025 ** (1 / n) (the rule of three's exact form)
    low, high = far_judge.clopper_pearson(0, 20)
    assert low == 0.0
    assert high == pytest.approx(1 - 0.025 ** (1 / 20))
    assert far_judge.n_for_upper(0.01) == 368
