"""The pair key ``anchor_every = N``: the anchored check (convergence/run/anchors.py).

Opt-in and per pair (``[defaults]`` or a ``[[test]]``): every N steps the control saves its
whole training state, and the test layout trains one step from each saved state; each such
step is compared with the control's own next step at the one-step tolerance, so a bug that
starts late is judged against one step of rounding, not against hundreds of steps of drift.
Checked here, once, with the fix in the message: a positive integer below the run's steps, a
control that runs (not a golden curve) and a test that does not itself resume.
"""

from __future__ import annotations

from typing import Any

from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec

#: Where a control with anchors writes them, inside its dump folder (the trainer writes,
#: convergence/run/anchors.py reads; the run cache keeps them with the control's run).
ANCHORS_DIR = "anchors"


def parse_anchor_every(value: Any, test: JobSpec, *, golden: Any, file: str, key: str) -> int:
    """The pair's ``anchor_every`` (0 when absent: the check is off)."""
    if value is None:
        return 0
    where = f"{key}.anchor_every"
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(
            f"anchor_every must be a positive integer (steps between anchors), got {value!r}",
            file=file,
            key=where,
            fix="set anchor_every = N with 1 <= N < steps (e.g. 25 for a 500-step run), "
            "or drop it to leave the anchored check off",
        )
    if value >= test.steps:
        raise SpecError(
            f"anchor_every = {value} leaves no anchor inside the run of {test.steps} steps",
            file=file,
            key=where,
            fix=f"set anchor_every below {test.steps}",
        )
    if golden:
        raise SpecError(
            "anchor_every needs a control run to take its state from; a golden curve has none",
            file=file,
            key=where,
            fix="drop anchor_every from a golden pair, or compare against a control job",
        )
    if test.resume is not None:
        raise SpecError(
            "anchor_every and resume on one test: the anchored steps need one test layout",
            file=file,
            key=where,
            fix="put the anchored check on a test without resume (after a resume, the twin "
            "regime already judges the steps against its twins resumed from the same "
            "checkpoint: the 'resumed' verdict)",
        )
    return value
