"""The resumed check (a test side with ``resume``: convergence/spec/resume.py): the steps
after the resume, judged against the regime's twins run again from the test's checkpoint
(the twin regime's ``resumed_controls``) -- the noise from the test's own state at step K,
which the twins' envelope from step 1 has long outgrown (convergence/stats/resumed.py).

The resuming test itself -- two jobs, one curve -- is how the Runner runs a test side
(convergence/run/resume.py); this check adds the twins from its checkpoint, their verdict,
and the probe of the step after the resume (the default probe replays both layouts from step
1, which cannot replay a resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.backends.base import Backend
from convergence.backends.registry import get_backend
from convergence.backends.tokens import batch_fix
from convergence.checks.base import ExtraJob, ProbeRequest, Ran, first_divergent_step
from convergence.regimes import get_regime, resumed_controls
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.stats.resumed import RESUMED, resumed_verdict
from convergence.stats.types import MetricVerdict

#: The role of its extra jobs (Ran.extra).
TWINS = "twins"


class ResumedCheck:
    name = RESUMED
    replay_probe = False  # the replay from step 1 cannot resume

    keys: Mapping[str, str] = {}  # its key is the test side's ``resume`` (spec/resume.py)

    def validate(self, pair: PairSpec, *, key: str, steps: int | None) -> None:
        return None

    def applies(self, pair: PairSpec) -> bool:
        return pair.test.resume is not None

    def trajectory_until(self, pair: PairSpec) -> int | None:
        return None

    def refuse(self, pair: PairSpec, backends: Mapping[str, Backend], *, key: str) -> None:
        check_resume(pair.test, file=pair.source, key=key)

    def control_jobs(self, pair: PairSpec, jobs: Sequence[JobSpec]) -> tuple[JobSpec, ...]:
        return tuple(jobs)

    def extra_jobs(self, pair: PairSpec, ran: Ran, backend: Backend) -> tuple[ExtraJob, ...]:
        checkpoint = resumed_checkpoint(ran.test.meta)
        again = resumed_controls(get_regime(pair.regime), pair, backend)
        if checkpoint is None or not again:
            return ()
        # Never cached: they start from the test's state, part of what is under test.
        return tuple(
            ExtraJob(
                TWINS,
                "control",
                dataclasses.replace(job, name=f"{job.name}-from-{checkpoint.name}").asking(
                    resume_from=checkpoint
                ),
                cacheable=False,
            )
            for job in again
        )

    def verdicts(
        self, pair: PairSpec, ran: Ran, verdicts: tuple[MetricVerdict, ...]
    ) -> tuple[MetricVerdict, ...]:
        twins = [side.metrics for side in ran.of(self.name, TWINS)]
        if not twins or pair.test.resume is None:
            return verdicts
        runs = [side.metrics for side in ran.controls]
        if ran.upto is not None:
            runs = [{m: c.upto(ran.upto) for m, c in run.items()} for run in runs]
            twins = [{m: c.upto(ran.upto) for m, c in run.items()} for run in twins]
        after = resumed_verdict(
            pair.rules,
            runs,
            ran.test.metrics,
            at_step=pair.test.resume.at_step,
            resumed_twins=twins,
        )
        return verdicts if after is None else (*verdicts, after)

    def probe(
        self, pair: PairSpec, verdicts: Sequence[MetricVerdict], ran: Ran
    ) -> ProbeRequest | None:
        """Both layouts load the test's checkpoint and probe the step after the resume,
        when the test parted after it."""
        assert pair.test.resume is not None
        at = pair.test.resume.at_step
        checkpoint = resumed_checkpoint(ran.test.meta)
        parted = first_divergent_step(verdicts)
        if checkpoint is None or parted is None or parted <= at:
            return None
        return ProbeRequest(
            control=pair.control,
            test=pair.test.after_resume(),
            checkpoint=checkpoint,
            folder=f"resume{at}",
            step=at + 1,
            head={"resume_step": at},
            failed=f"after the resume at {at}",
        )


def resumed_checkpoint(meta: Mapping[str, Any]) -> Path | None:
    """The checkpoint a resuming test's second job loaded, from the side's metadata (None:
    it never resumed -- job 1 stopped early, or the side does not resume)."""
    info = (meta or {}).get("resume")
    if not isinstance(info, dict) or "first_run" not in info:
        return None
    return Path(str(info["checkpoint"]))


def check_resume(test: JobSpec, *, file: str, key: str) -> None:
    """A resuming test side: its backend resumes, the resume layout passes the backend's
    preflight and reads the same tokens per optimizer step as before the resume."""
    after = test.after_resume()
    where = f"{key}.resume"
    backend = get_backend(after.backend)
    if not backend.capabilities.resume:
        raise SpecError(
            f"the {backend.name!r} backend does not resume (its trainer's checkpointing "
            "flags are not mapped)",
            file=file,
            key=where,
            fix="drop resume from this test, or use a backend that resumes (builtin, torchtitan)",
        )
    try:
        backend.preflight(after)
    except SpecError as exc:
        raise SpecError(
            f"[{key} {test.name!r} after the resume] {exc.detail}",
            file=file,
            key=f"{where}.{exc.key}" if exc.key else where,
            fix=exc.fix,
        ) from None
    before, resumed = backend.tokens_per_step(test), backend.tokens_per_step(after)
    if before != resumed:
        raise SpecError(
            f"tokens per optimizer step change at the resume: {before} before, {resumed} after "
            "(local batch x DP x grad accumulation x seq_len); the data position and the LR "
            "schedule would no longer line up with the control",
            file=file,
            key=f"{where}.local_batch_size",
            fix=batch_fix(backend, after, before).replace("on the test", "in the resume table"),
        )
