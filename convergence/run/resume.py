"""A resuming test side as two jobs and one curve (convergence.spec.resume).

    job 1: the side's layout, steps 1..K, then a training checkpoint (DCP) and stop
    job 2: the resume layout, loads it, steps K+1..N
    -> one SideOutcome whose curves are job 1's then job 2's
    + where the regime asks (Regime.resumed_controls: the twin regime's twins), its
      control-side jobs loading the same checkpoint, steps K+1..N: the noise from the
      test's state at K (stats/resumed.py judges the steps after K against them)

Both jobs go through the job tier (run/jobs.py) like any test job (fresh, never from the run cache: a resume is
what is under test) and feed the same early-stop monitor; a job 1 stopped early ends the side
there. A checkpoint that job 2 cannot use fails job 2 with the trainer's message naming the
checkpoint (convergence/trainer/resume.py: ResumeError), never a fresh start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from convergence.metrics.curve import Curve, RunMetrics
from convergence.run.jobs import JobRunner
from convergence.run.outcome import SideOutcome
from convergence.run.probe import probe_from_checkpoint
from convergence.run.together import run_together
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.spec.resume import RESUME_FROM, SAVE_AT_STEP, SAVE_FOLDER

#: Where the side's checkpoint goes, inside the pair's run folder.
CHECKPOINT_DIR = "checkpoint"


def phase_jobs(job: JobSpec, checkpoint: Path) -> tuple[JobSpec, JobSpec]:
    """(the job up to the checkpoint, the job that resumes from it): the checkpoint keys as
    overrides, after the user's own (the built-in trainer's keys; other backends translate
    them: convergence.spec.resume)."""
    assert job.resume is not None
    at = job.resume.at_step
    before = dataclasses.replace(
        job,
        name=f"{job.name}-to-step{at}",
        resume=None,
        overrides=(
            *job.overrides,
            (SAVE_AT_STEP, str(at)),
            (SAVE_FOLDER, str(checkpoint)),
        ),
    )
    after = job.after_resume()
    after = dataclasses.replace(
        after,
        name=f"{job.name}-resumed",
        overrides=(*after.overrides, (RESUME_FROM, str(checkpoint))),
    )
    return before, after


def joined(first: RunMetrics, second: RunMetrics) -> RunMetrics:
    """Job 1's curves then job 2's, metric by metric (steps do not overlap)."""
    out: RunMetrics = {}
    for metric in {*first, *second}:
        pairs: list[tuple[int, float]] = []
        for run in (first, second):
            curve = run.get(metric)
            if curve is not None:
                pairs += zip(curve.steps.tolist(), curve.values.tolist(), strict=True)
        out[metric] = Curve.from_pairs(metric, pairs)
    return out


def run_resumed(
    runner: JobRunner,
    side: str,
    job: JobSpec,
    *,
    pair_dir: Path,
    on_metrics: Callable[[dict[str, float]], bool] | None = None,
) -> SideOutcome:
    """Run a resuming side; raises JobFailed (either job) or SpecError like Runner.run_job."""
    resume = job.resume
    assert resume is not None
    if resume.at_step >= job.steps:  # --convergence-steps cut the run before the resume
        raise SpecError(
            f"resume.at_step = {resume.at_step} is not inside the run of {job.steps} steps",
            file=job.source,
            key="resume.at_step",
            fix="run more steps (--convergence-steps), or resume earlier",
        )
    key = runner.prepare(job).key
    checkpoint = pair_dir / f"{side}-{CHECKPOINT_DIR}-{key[:10]}"
    before, after = phase_jobs(job, checkpoint)
    first = runner.run_job(side, before, pair_dir=pair_dir, cacheable=False, on_metrics=on_metrics)
    info = {
        "at_step": resume.at_step,
        "checkpoint": str(checkpoint),
        "before": job.layout.short_name(),
        "after": resume.layout.short_name(),
    }
    if first.result is not None and first.result.status != "ok":
        # Decided before the resume (stopped early), or a NaN loss (a test job that gives its
        # curve up to the NaN): there is no checkpoint to resume from, and nothing to add.
        return dataclasses.replace(first, job=job, meta={**first.meta, "resume": info})
    second = runner.run_job(side, after, pair_dir=pair_dir, cacheable=False, on_metrics=on_metrics)
    return SideOutcome(
        job=job,
        metrics=joined(first.metrics, second.metrics),
        result=second.result,
        cached=False,
        run_dir=second.run_dir,
        wall_s=first.wall_s + second.wall_s,
        meta={**second.meta, "resume": {**info, "first_run": str(first.run_dir)}},
    )


def resumed_checkpoint(test: SideOutcome) -> Path | None:
    """The checkpoint a resuming test's second job loaded (None: it never resumed -- job 1
    stopped early, or the side does not resume)."""
    info = (test.meta or {}).get("resume")
    if not isinstance(info, dict) or "first_run" not in info:
        return None
    return Path(str(info["checkpoint"]))


def run_from_checkpoint(
    runner: JobRunner, jobs: Sequence[JobSpec], checkpoint: Path, *, pair_dir: Path
) -> list[RunMetrics]:
    """Control-side ``jobs`` (the regime's ``resumed_controls``), each loading the test's
    ``checkpoint`` and training to the end, at once where the pool has room. Never cached:
    they start from the test's state, which is part of what is under test."""
    resumed = [
        dataclasses.replace(
            job,
            name=f"{job.name}-from-{checkpoint.name}",
            overrides=(*job.overrides, (RESUME_FROM, str(checkpoint))),
        )
        for job in jobs
    ]
    sides = run_together(
        [
            partial(runner.run_job, "control", job, pair_dir=pair_dir, cacheable=False)
            for job in resumed
        ],
        together=runner.settings.concurrent_controls,
    )
    return [side.metrics for side in sides]


def probe_after_resume(
    runner: JobRunner, pair: PairSpec, checkpoint: Path, *, pair_dir: Path
) -> dict[str, Any]:
    """The numerics probe of the step after the resume: the control's layout and the resume
    layout each load the test's checkpoint and probe step K+1."""
    assert pair.test.resume is not None
    at = pair.test.resume.at_step
    return probe_from_checkpoint(
        runner,
        pair.control,
        pair.test.after_resume(),
        checkpoint,
        pair_dir / "probe" / f"resume{at}",
        step=at + 1,
        head={"resume_step": at},
        failed=f"after the resume at {at}",
    )
