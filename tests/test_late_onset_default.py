"""Late bugs without opting in (issue 47): a pair with no ``anchor_every`` gets the automatic
anchored check (checks/anchored.py: an anchor every AUTO_EVERY steps), and a bug that starts at
step 30 of 50 fails it within 20 steps of its start, while the correct layout passes it.

50 steps: the shortest pair the automatic check covers (AUTO_MIN_STEPS), so the test costs half
of the issue's "from step 50 of 100" (issue 48: CI time); that case, and 300 of 500, in both
precisions, are BENCHMARKS.md "Late bugs with default settings" (benchmarks/detection/anchored.py).

fp32, two and four ranks, real torchrun/gloo: the CP rotary offset dropped from step 30
(detection_bugs/late_onset.py) against FSDP2, and the correct FSDP2+CP2. The bound: the first
anchor at or after the start is at most AUTO_EVERY steps later, and the anchored check fails at
the anchor's next step (a second anchor where the persistence rule needs one): within
2 x AUTO_EVERY = 20 steps. (bf16, where the trajectories miss this bug: BENCHMARKS.md "Verdict V".)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import by_name, late_onset  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.checks.anchored import AUTO_EVERY, AUTO_MIN_STEPS, anchor_spacing  # noqa: E402
from convergence.report import build_report, render_markdown  # noqa: E402
from convergence.report.formats.terminal import render_summary  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.pair import PairSpec  # noqa: E402

pytestmark = pytest.mark.xdist_group("late-onset-default")

START, STEPS = 30, 50  # three anchors before the bug (10, 20, 30), one after (40)
assert STEPS == AUTO_MIN_STEPS
BUG = f"cp-rope-ignores-offset-from-{START}"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairSpec]:
    cases = [c for c in late_onset(START) if c.name == BUG] + [by_name("fsdp2-cp2")]
    return build_pairs(cases, tmp_path_factory.mktemp("exp"), steps=STEPS)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(
        RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=300, wall_limit_s=900)
    )


@pytest.mark.rounding
def test_a_late_bug_fails_the_default_anchored_check_within_20_steps(
    runner: Runner, pairs: dict[str, PairSpec]
) -> None:
    assert pairs[BUG].check_key("anchor_every") is None  # no key in the file
    outcome = runner.run_pair(pairs[BUG])
    assert anchor_spacing(outcome.pair) == AUTO_EVERY
    assert outcome.status == "failed", (outcome.error, [v.message for v in outcome.verdicts])
    anchored = outcome.verdict("anchored")
    assert anchored is not None and anchored.gate and not anchored.passed, anchored
    assert anchored.first_divergent_step is not None
    assert START < anchored.first_divergent_step <= START + 2 * AUTO_EVERY, anchored.message


# Under the bug test's rounding draw too: the correct layout's pass is the false-alarm side of
# the same check, and the two pairs' controls are one run in the module's cache only when both
# tests run under one draw (the cache keys runs by it; the control is ~40 % of the pair).
@pytest.mark.rounding
def test_the_correct_layout_passes_it(runner: Runner, pairs: dict[str, PairSpec]) -> None:
    outcome = runner.run_pair(pairs["fsdp2-cp2"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    anchored = outcome.verdict("anchored")
    assert anchored is not None and anchored.passed, anchored
    assert anchored.steps_compared == (STEPS - 1) // AUTO_EVERY  # anchors 10, 20, 30, 40
    # The pass from the control's states is shown in the terminal summary and report.md.
    assert "fsdp2-cp2: anchored PASS -- anchored: " in render_summary([outcome])
    report = build_report([outcome], environment={}, started_at=None, wall_s=None)
    assert "**anchored**: anchored: from each of" in render_markdown(report)
