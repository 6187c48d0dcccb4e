"""A resuming test side as two jobs and one curve (convergence.spec.resume).

    job 1: the side's layout, steps 1..K, then a training checkpoint (DCP) and stop
    job 2: the resume layout, loads it, steps K+1..N
    -> one SideOutcome whose curves are job 1's then job 2's
    + where the regime asks (Regime.resumed_controls: the twin regime's twins), its
      control-side jobs loading the same checkpoint, steps K+1..N: the noise from the
      test's state at K -- the resumed check's (convergence/checks/resumed.py)

Both jobs go through the job level (run/jobs.py) like any test job (fresh, never from the run cache: a resume is
what is under test) and feed the same early-stop monitor; a job 1 stopped early ends the side
there. A checkpoint that job 2 cannot use fails job 2 with the trainer's message naming the
checkpoint (convergence/trainer/resume.py: ResumeError), never a fresh start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from convergence.metrics.curve import Curve, RunMetrics
from convergence.run.jobs import JobRunner
from convergence.run.outcome import SideOutcome
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec

#: Where the side's checkpoint goes, inside the pair's run folder.
CHECKPOINT_DIR = "checkpoint"


def phase_jobs(job: JobSpec, checkpoint: Path) -> tuple[JobSpec, JobSpec]:
    """(the job up to the checkpoint, the job that resumes from it): each asks its trainer
    for its part (convergence.spec.trainer_request; each backend says it in its own words)."""
    assert job.resume is not None
    at = job.resume.at_step
    before = dataclasses.replace(job, name=f"{job.name}-to-step{at}", resume=None).asking(
        save_at=at, save_folder=checkpoint
    )
    after = dataclasses.replace(job.after_resume(), name=f"{job.name}-resumed").asking(
        resume_from=checkpoint
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
