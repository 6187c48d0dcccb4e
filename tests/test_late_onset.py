"""Late-onset planted bugs (issue 41): a catalogue bug switched on at step S of the test side
is exactly the correct layout before S (no metric moves) and the bug from S on.

Two ranks, fp32 paired regime, a few steps: the data-loader bug from step 4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import late_onset  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.run.runner import Runner, RunSettings  # noqa: E402

START, STEPS = 4, 7


@pytest.mark.rounding
def test_data_bug_from_step_s_matches_the_control_before_s_and_is_caught_from_s(
    tmp_path: Path,
) -> None:
    case = next(c for c in late_onset(START) if c.name.startswith("dp-ranks-read-same-shard"))
    (tmp_path / "exp").mkdir()
    pair = build_pairs([case], tmp_path / "exp", steps=STEPS)[case.name]
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=180, wall_limit_s=600))
    outcome = runner.run_pair(pair)
    assert outcome.control is not None and outcome.test is not None, outcome.error
    control = {k: v.values.tolist() for k, v in outcome.control.metrics.items()}
    test = {k: v.values.tolist() for k, v in outcome.test.metrics.items()}
    # Before S the hook is a correct layout: the same batches, bitwise the same curve.
    before = START - 1
    assert test["data_fingerprint"][:before] == control["data_fingerprint"][:before]
    assert test["loss"][:before] == control["loss"][:before]
    # From S every rank reads rank 0's samples: another step's data, the loss moves at once.
    assert test["data_fingerprint"][before] != control["data_fingerprint"][before]
    assert outcome.status == "failed", [v.message for v in outcome.verdicts]
    loss = outcome.verdict("loss")
    assert loss is not None and not loss.passed
    assert loss.first_divergent_step == START, loss.message


def test_late_hook_name_must_carry_a_bug_and_a_start() -> None:
    import detection_bugs.late_onset as late

    assert callable(late.cp_rope_without_offset_from_300)
    with pytest.raises(AttributeError, match="<bug>_from_<S>"):
        late.cp_rope_without_offset_from_zero  # noqa: B018
