"""The pair key ``anchor_every = N``: the anchored check (convergence/checks/anchored.py).

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

#: The automatic anchored check (the key absent): pairs of at least AUTO_MIN_STEPS steps get
#: anchors every AUTO_EVERY steps, at most AUTO_MAX_ANCHORS of them (spacing steps //
#: AUTO_MAX_ANCHORS beyond 1000 steps). Why: a bug that starts at step S shows at the first
#: anchor at or after S -- within AUTO_EVERY steps, and within 2 x AUTO_EVERY = 20 where the
#: persistence rule needs a second anchor (stats/anchored.py) -- while the trajectory verdicts
#: judge it against S steps of drift (a rotary bug from step 300 of 500 passed them). Where the
#: check runs it is also the judge of "same function" past the first steps
#: (stats/anchored.py TRAJECTORY_HORIZON), so AUTO_MIN_STEPS is where a chaotic run's
#: trajectories can leave their band: a correct layout at an aggressive learning rate did at
#: steps 8-34 of 80 (issue 47), so 50, not 100 (BENCHMARKS.md "False-alarm rate": the 60-step
#: benchmark). Below AUTO_MIN_STEPS a late bug is a few steps from the start, where the
#: trajectories have not separated yet and judge it themselves; and every shipped CI pair is
#: shorter (<= 30 steps), so CI runs no extra job. The cost, per pair: one anchored job of
#: steps / AUTO_EVERY one-step checks (twin regime: one per twin as well), measured in
#: BENCHMARKS.md "Verdict V" and "False-alarm rate".
AUTO_MIN_STEPS = 50
AUTO_EVERY = 10
AUTO_MAX_ANCHORS = 100


def auto_anchor_every(steps: int) -> int:
    """The automatic anchor spacing of a run of ``steps`` steps (0: no anchors)."""
    if steps < AUTO_MIN_STEPS:
        return 0
    return max(AUTO_EVERY, steps // AUTO_MAX_ANCHORS)


def parse_anchor_every(value: Any, test: JobSpec, *, golden: Any, file: str, key: str) -> int:
    """The pair's ``anchor_every`` (0 when absent -- then automatic, decided at preflight
    where the backends are known: ``PairSpec.anchor_auto`` -- or set to 0: off)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return 0
    where = f"{key}.anchor_every"
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(
            f"anchor_every must be a positive integer (steps between anchors), got {value!r}",
            file=file,
            key=where,
            fix="set anchor_every = N with 1 <= N < steps (e.g. 25 for a 500-step run), "
            "0 to turn the anchored check off, or drop it for the automatic choice",
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
