"""Where a resuming test side (convergence.spec.resume) stopped and resumed, and what that says
about a divergence: every report format shows the same record and the same sentence."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from convergence.run.outcome import PairOutcome
from convergence.spec.resume import Resume

#: A divergence first seen this many steps after the checkpoint is "at the resume": step K+1
#: shows a data, weight or RNG bug; K+2 one in the optimizer or the schedule (the loss of a
#: step is computed before its update, so a wrong update shows in the next step's loss).
AT_RESUME_STEPS = 2


class ResumedLayout(TypedDict):
    """What the matrix and the dimension read of the layout the run resumed on."""

    degrees: dict[str, int]
    pp_schedule: str | None
    sequence_parallel: bool


class ResumeRecord(TypedDict):
    at_step: int
    """The last step before the checkpoint; the resumed job starts at at_step + 1."""
    before: str
    """Short name of the layout up to the checkpoint."""
    after: str
    """Short name of the layout the run resumed on."""
    note: str | None
    """Where the divergence starts relative to the resume (None when there is none)."""
    layout: NotRequired[ResumedLayout]
    """The resumed layout's degrees: a resume pair is shown as the layout it resumed on
    (issue 52: it was shown as its pre-resume layout, under "same layout")."""


def resume_note(resume: Resume, first_divergent: int | None, before: str) -> str | None:
    """One sentence placing the first divergent step relative to the resume."""
    if first_divergent is None:
        return None
    at, after = resume.at_step, resume.layout.short_name()
    where = f"checkpoint after step {at}, {before} -> {after}"
    if first_divergent <= at:
        return (
            f"the divergence starts before the resume, at step {first_divergent} ({where}):"
            f" the layout {before} itself differs from the control"
        )
    if first_divergent <= at + AT_RESUME_STEPS:
        # Onto another layout, that layout itself is the other suspect (a late broken layout).
        onto = f", or the layout {after} differs from the control" if after != before else ""
        return (
            f"the divergence starts at the resume: step {first_divergent}, right after the "
            f"{where} -- the checkpoint lost or changed state (weights, optimizer, LR "
            f"schedule, data position, RNG){onto}"
        )
    return (
        f"the divergence starts at step {first_divergent}, {first_divergent - at} steps "
        f"after the resume ({where})"
    )


def resume_record(outcome: PairOutcome, first_divergent: int | None) -> ResumeRecord | None:
    test = outcome.pair.test
    if test.resume is None:
        return None
    before, after = test.layout.short_name(), test.resume.layout
    return {
        "at_step": test.resume.at_step,
        "before": before,
        "after": after.short_name(),
        "note": resume_note(test.resume, first_divergent, before),
        "layout": {
            "degrees": after.degrees(),
            "pp_schedule": after.pp_schedule if after.pp > 1 else None,
            "sequence_parallel": after.sequence_parallel,
        },
    }


def resumed_label(resume: ResumeRecord) -> str:
    """``fsdp2→fsdp2-tp2@10``: the layouts before and after the checkpoint of step 10."""
    return f"{resume['before']}→{resume['after']}@{resume['at_step']}"
