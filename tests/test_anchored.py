"""The anchored check (pair key ``anchor_every``, issue 41), end to end on the built-in
trainer: the control saves its state every 10 steps, the test layout trains one step from
each, and the one judge adds the ``anchored`` verdict.

A late CP-rope bug from step 15 of 30 (fp32, FSDP(2)+CP(2) against FSDP(2)) fails the
anchored verdict at the first anchor after its start, named in the message; the correct
layout passes with anchors on; the numerics probe started from the failing anchor names
where the layouts part. Each part's grad norm travels with the anchored steps and the control
(the twin regime judges each part: tests/test_stats_anchored.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from catalogue import BUGS, late_onset  # noqa: E402
from pairs import build_pairs  # noqa: E402

from convergence.checks.anchored import anchor_folder, with_part_norms  # noqa: E402
from convergence.checks.base import SideRun  # noqa: E402
from convergence.report.formats.failure_text import headline  # noqa: E402
from convergence.run.probe import probe_from_checkpoint  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402

START, STEPS, EVERY = 15, 30, 10  # anchors at 10 and 20: 20 is the first after the bug


@pytest.mark.rounding
def test_a_late_bug_fails_at_an_anchor_after_its_start_and_a_correct_layout_passes(
    tmp_path: Path,
) -> None:
    bug = next(c for c in late_onset(START) if c.name.startswith("cp-rope-ignores-offset"))
    correct = next(c for c in BUGS if c.name == "cp-rope-ignores-offset")
    correct = type(correct)(name="fsdp2-cp2", kind="correct", parallelism=correct.parallelism)
    (tmp_path / "exp").mkdir()
    pairs = build_pairs([bug, correct], tmp_path / "exp", steps=STEPS, anchor_every=EVERY)
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=180, wall_limit_s=600))

    failing = runner.run_pair(pairs[bug.name])
    assert failing.status == "failed", failing.error
    anchored = failing.verdict("anchored")
    assert anchored is not None and not anchored.passed, [v.message for v in failing.verdicts]
    anchor = anchored.details["anchor_step"]
    assert isinstance(anchor, int) and START <= anchor <= START + EVERY, anchored.message
    assert f"from the control's state at step {anchor} the test layout differs" in (
        anchored.message
    )
    assert anchored.first_divergent_step == anchor + 1
    assert f"anchored: from the control's state at step {anchor}" in headline(failing)
    # Before the bug the test layout matched the control from each anchor.
    assert anchored.details["anchors"] == [10, 20]
    assert anchored.details["anchors_failing"] == [20]
    (side,) = [s for s in failing.extra_sides if s.job.name.endswith("-anchored")]
    assert side.metrics["loss"].steps.tolist() == [11, 21]
    # Each part's grad norm travels with the anchored steps and the control (read from their
    # JSONL logs) for the anchored check's per-part judgement (twin regime; stats/anchored.py).
    assert failing.control is not None
    anchored_parts, control_parts = (
        with_part_norms(SideRun(job=s.job, metrics=s.metrics, run_dir=s.run_dir))
        for s in (side, failing.control)
    )
    for metrics in (anchored_parts, control_parts):
        assert "grad_norm/attention.wq" in metrics, sorted(metrics)
    assert anchored_parts["grad_norm/attention.wq"].steps.tolist() == [11, 21]

    # The probe from the failing anchor (both layouts load it, probe the step after): what
    # the anchored check asks of the Runner when the curves had not parted before it.
    control = SideRun(job=failing.control.job, metrics={}, run_dir=failing.control.run_dir)
    probe = probe_from_checkpoint(
        runner.jobs,
        failing.pair.control,
        failing.pair.test,
        anchor_folder(control) / f"step{anchor}",
        tmp_path / "probe",
        step=anchor + 1,
        head={"anchor_step": anchor},
        failed=f"at anchor {anchor}",
    )
    assert "error" not in probe and probe["step"] == anchor + 1, probe
    assert probe["anchor_step"] == anchor
    assert probe["module"] is not None or probe["parameter"] is not None, probe

    passing = runner.run_pair(pairs[correct.name])
    assert passing.status == "passed", [v.message for v in passing.verdicts]
    verdict = passing.verdict("anchored")
    assert verdict is not None and verdict.passed and verdict.steps_compared == 2, verdict


def test_a_twin_pair_saves_confirming_anchors_and_judges_one_step_from_each(
    tmp_path: Path,
) -> None:
    """bf16 (the twin regime): the control saves each anchor K and its next state K+1
    (confirming anchors, checks/anchored.py), and the test's and each twin's anchored job train
    one step from each -- steps K+1 and K+2; K+1 is judged, K+2 confirms a miss and sizes the
    tolerance (stats/anchored.py CONFIRMING_STEP). Not a verdict on rounding: the anchors the
    control saved, the steps each job trained and what the verdict compared."""
    correct = next(c for c in BUGS if c.name == "cp-rope-ignores-offset")
    case = type(correct)(
        name="fsdp2-cp2-bf16", kind="correct", parallelism=correct.parallelism, precision="bf16"
    )
    (tmp_path / "exp").mkdir()
    pair = build_pairs([case], tmp_path / "exp", steps=12, anchor_every=5)[case.name]
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=180, wall_limit_s=600))
    outcome = runner.run_pair(pair)
    assert outcome.status in ("passed", "failed"), outcome.error
    anchored_sides = [s for s in outcome.extra_sides if s.job.name.endswith("-anchored")]
    assert len(anchored_sides) >= 2, [s.job.name for s in outcome.extra_sides]  # test + twins
    for side in anchored_sides:
        assert side.metrics["loss"].steps.tolist() == [6, 7, 11, 12], side.job.name
        assert side.job.request.anchored_from is not None
    assert outcome.control is not None and outcome.control.run_dir is not None
    assert outcome.control.job.request.confirming_anchors
    saved = sorted(p.name for p in (outcome.control.run_dir / "dump" / "anchors").iterdir())
    assert saved == ["step10", "step11", "step5", "step6"], saved
    verdict = outcome.verdict("anchored")
    assert verdict is not None and verdict.steps_compared == 2, verdict  # anchors 5 and 10
    assert verdict.details["anchors"] == [5, 10]
    assert verdict.details["confirming_steps"] == 2, verdict.details
