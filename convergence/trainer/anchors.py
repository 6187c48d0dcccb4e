"""Anchors: the control's exact state every N steps, and one test step from each.

Two curves that start from one seed checkpoint drift apart by legitimate rounding (bf16,
another reduction order): after a few hundred steps the gap two correct layouts show is 5-7x
the gap at the first steps, and a bug that only starts then hides in it. One step from an
*identical* state does not drift: its difference is one step of rounding at any horizon, and a
bug's full one-step effect however late it starts. So:

    control job  (checkpoint.anchor_every = N): trains as usual and, after every N-th step K
                 (K < steps), writes a training checkpoint (convergence.trainer.resume: model,
                 AdamW state, data and schedule position, RNG) to <dump>/anchors/step<K>;
                 with checkpoint.confirming_anchors also after each step K+1 (the twin
                 regime's confirming anchors: convergence.stats.anchored CONFIRMING_STEP)
    anchored job (checkpoint.anchored_from = that folder), under the TEST layout: for each
                 anchor K, loads it (DCP reshards it onto this layout) and trains the steps
                 K+1..K+m (checkpoint.anchored_steps = m, 1 by default) on the same batches;
                 logs those steps' metrics like any step

convergence.checks.anchored runs the two; convergence.stats.anchored compares each anchored step
with the control's own step K+1 at the one-step tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from convergence.spec import run_dir
from convergence.spec.run_dir import DumpDir
from convergence.spec.trainer_request import saves_anchor_after
from convergence.trainer import resume
from convergence.trainer.config import TrainConfig
from convergence.trainer.data import BatchPlan


def anchor_path(folder: str | Path, step: int) -> Path:
    """The checkpoint of the state after step ``step``."""
    return run_dir.anchor_path(Path(folder), step)


def saves_anchor(cfg: TrainConfig, step: int) -> bool:
    """Whether the control writes an anchor after ``step``: every ``anchor_every``-th step
    and, with ``confirming_anchors``, each one's next step too; never after the last one (no
    step follows it to compare)."""
    ckpt = cfg.checkpoint
    return saves_anchor_after(
        step,
        every=ckpt.anchor_every,
        confirming=ckpt.confirming_anchors,
        steps=cfg.training.steps,
    )


def anchors_in(folder: str | Path) -> list[int]:
    """The anchor steps K whose checkpoint in ``folder`` is complete (resume.json written
    last), ascending. None at all is an error naming the folder."""
    folder = Path(folder)
    steps = sorted(
        step
        for path in (folder.iterdir() if folder.is_dir() else ())
        if (step := run_dir.anchor_step(path.name)) is not None
        and (path / resume.MANIFEST).is_file()
    )
    if not steps:
        raise resume.ResumeError(
            folder,
            "it holds no anchor (step<K>/ with a resume.json)",
            "run the control with checkpoint.anchor_every = N first",
        )
    return steps


def anchored_steps(anchors: Sequence[int], steps_each: int, last_step: int) -> list[int]:
    """The steps an anchored job trains: K+1..K+``steps_each`` from each anchor K, never
    past the next anchor (whose own steps start from the control's state again) nor past
    ``last_step``."""
    out: list[int] = []
    for i, k in enumerate(anchors):
        end = min(k + steps_each, last_step, *anchors[i + 1 : i + 2])
        out.extend(range(k + 1, end + 1))
    return out


def loop_steps(cfg: TrainConfig, first_step: int, last_step: int) -> Sequence[int]:
    """The steps the loop trains: all from ``first_step`` to ``last_step``, or for an
    anchored job the ``anchored_steps`` steps after each anchor."""
    ckpt = cfg.checkpoint
    if not ckpt.anchored_from:
        return range(first_step, last_step + 1)
    return anchored_steps(anchors_in(ckpt.anchored_from), ckpt.anchored_steps, last_step)


def load_anchor(
    run: resume.Checkpointable, step: int, plan: BatchPlan
) -> resume.RunPosition | None:
    """An anchored job, before ``step``: when step - 1 is an anchor, load it into this
    layout's model and optimizer and return the run's position for that step, as a resume
    does. None otherwise (a later step from the same anchor goes on from this job's own
    state; any other job loads nothing)."""
    folder = run.cfg.checkpoint.anchored_from
    if not folder or not (anchor_path(folder, step - 1) / resume.MANIFEST).is_file():
        return None
    restored = resume.load_training_checkpoint(anchor_path(folder, step - 1), run)
    return resume.RunPosition(
        first_step=step,
        lr_offset=restored.lr_step - restored.step,
        plan=dataclasses.replace(
            plan, offset=restored.data_position - restored.step * plan.global_batch_size
        ),
    )


def save_anchor(run: resume.Checkpointable, step: int, position: resume.RunPosition) -> None:
    """A control with anchor_every: the state after ``step`` (every rank calls it)."""
    folder = DumpDir(Path(run.cfg.metrics.dump_folder)).anchors
    resume.save_training_checkpoint(anchor_path(folder, step), run, position.state_at(step))
