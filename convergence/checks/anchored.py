"""The anchored check (pair key ``anchor_every``, owned and parsed here; automatic for long
pairs: :func:`anchor_spacing`): one test step from each of the control's saved states, judged at the
one-step tolerance (convergence/stats/anchored.py: why it sees a late bug that a trajectory
hides).

    control job   + request anchor_every=N: its state after every N-th step, in its dump
                  folder (convergence/trainer/anchors.py); cached with the control's run
    anchored job  the test's layout + request anchored_from=<those anchors>: one step from
                  each anchor (never cached: it is part of what is under test)
    twins         the twin regime's twins, one step from the same anchors (cached: they
                  start from the control's state), where a rule sizes its envelope from twins;
                  there the control also saves each anchor's next state K+1 (confirming
                  anchors), and the test and the twins train one step from those too

A failed anchored verdict is probed from the failing anchor itself (both layouts load it and
probe the step after it) when the curves had not parted before it: no replay up to there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.backends.base import Backend
from convergence.backends.registry import get_backend
from convergence.checks.base import ExtraJob, ProbeRequest, Ran, SideRun
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import PART_NORM_PREFIX, ROUTING_PREFIX, read_prefixed
from convergence.spec.errors import NotRunnableHere, RunFailed, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.spec.run_dir import RunDir, anchor_path
from convergence.stats.anchored import (
    ANCHORED,
    TRAJECTORY_HORIZON,
    anchored_verdict,
    judged_from_anchors,
)
from convergence.stats.registry import get_comparison
from convergence.stats.types import MetricVerdict

#: The roles of its extra jobs (Ran.extra).
TEST, TWINS = "test", "twins"
#: Its pair key.
KEY = "anchor_every"

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

#: The pair key's entry in the documentation's key table (convergence/docs.py).
KEY_DOC = (
    "the anchored check (built-in trainer and torchtitan, through its own DCP checkpoints, "
    "the test keeping the control's DP degree; without the key automatic from "
    f"{AUTO_MIN_STEPS} steps, every {AUTO_EVERY}; `0`: off): every N steps the control saves "
    "its whole training state and the test layout trains one step from each; each such step "
    "must match the control's own next step at the one-step tolerance (twin pairs: sized by "
    "the twins' one step from the same states; a gap above 3/4 of it at two consecutive "
    "anchors also fails; each part's grad norm, `grad_norm/<part>`, is held to its own twin "
    "envelope at 2.5x the k; the control also saves each anchor's next state, and a miss "
    "one step from an anchor fails only if one step from that next state misses too), so a "
    "bug that starts late is judged against one step of rounding, not a long run's drift. A "
    "failure names the anchor step and the probe starts from it. Cost: one anchored test job "
    "of `steps / N` steps, and per control group one checkpoint every N steps plus one "
    "anchored job per twin (twin pairs: twice the steps and checkpoints)"
)


class AnchoredCheck:
    name = ANCHORED
    replay_probe = True
    keys = {KEY: KEY_DOC}

    def validate(self, pair: PairSpec, *, key: str, steps: int | None) -> None:
        every = parse_anchor_every(
            pair.check_key(KEY), pair.test, golden=pair.golden, file=pair.source, key=key
        )
        if steps is not None and every and every >= steps:
            raise SpecError(
                f"--convergence-steps {steps} leaves no anchor inside the run: the pair's "
                f"anchor_every is {every}",
                file=pair.source,
                key=f"{key}.{KEY}",
                fix=f"run more than {every} steps (--convergence-steps {every + 1} or more), "
                "or deselect this pair",
            )

    def applies(self, pair: PairSpec) -> bool:
        return anchor_spacing(pair) > 0

    def trajectory_until(self, pair: PairSpec) -> int | None:
        return TRAJECTORY_HORIZON  # past it, judged_from_anchors (stats/anchored.py)

    def refuse(self, pair: PairSpec, backends: Mapping[str, Backend], *, key: str) -> None:
        for side, backend in backends.items():
            if not backend.capabilities.anchors:
                raise SpecError(
                    f"anchor_every needs a trainer that saves its state every N steps and "
                    f"trains one step from each; the {side}'s backend {backend.name!r} does "
                    "not",
                    file=pair.source,
                    key=f"{key}.anchor_every",
                    fix="drop anchor_every from this pair, or run it on a backend that saves "
                    "anchors (the built-in trainer, or torchtitan through its DCP checkpoints)",
                )
        check_anchor_layouts(pair, backends, key=key)

    def control_jobs(self, pair: PairSpec, jobs: Sequence[JobSpec]) -> tuple[JobSpec, ...]:
        """Only the control saves anchors: the twins size the tolerance, nothing starts from
        their state. Where twins size it, the control saves each anchor's next state too
        (confirming anchors: stats/anchored.py CONFIRMING_STEP)."""
        out = list(jobs)
        if out:
            every = anchor_spacing(pair)
            confirming = every > 1 and sized_by_twins(pair, len(out))
            out[0] = out[0].asking(anchor_every=every, confirming_anchors=confirming)
        return tuple(out)

    def extra_jobs(self, pair: PairSpec, ran: Ran, backend: Backend) -> tuple[ExtraJob, ...]:
        control = ran.controls[0]
        folder = anchor_folder(control)
        if not folder.is_dir() or not any(folder.iterdir()):
            every = anchor_spacing(pair)
            raise SpecError(  # e.g. --convergence-steps cut the run below anchor_every
                f"anchor_every = {every} left no anchor in the control's run of "
                f"{control.job.steps} steps ({folder})",
                file=pair.source,
                key=KEY,
                fix=f"run more than {every} steps, or set a smaller anchor_every",
            )
        jobs = [ExtraJob(TEST, "test", anchored_job(pair.test, folder), cacheable=False)]
        if sized_by_twins(pair, len(ran.controls)):
            jobs += [
                ExtraJob(TWINS, "control", anchored_job(side.job, folder), cacheable=True)
                for side in ran.controls[1:]
            ]
        return tuple(jobs)

    def verdicts(
        self, pair: PairSpec, ran: Ran, verdicts: tuple[MetricVerdict, ...]
    ) -> tuple[MetricVerdict, ...]:
        anchored = ran.of(self.name, TEST)
        if not anchored:
            return verdicts
        # Each part's grad norm is judged too: the control's parts beside its curves.
        controls = [with_part_norms(ran.controls[0]), *(c.metrics for c in ran.controls[1:])]
        one_step = anchored_verdict(
            pair.rules,
            controls,
            with_part_norms(anchored[0]),
            every=anchor_spacing(pair),
            anchored_twins=[with_part_norms(t) for t in ran.of(self.name, TWINS)],
        )
        # Past the first steps the anchored check judges "same function" for the metrics it
        # covers; their trajectories are reported, not gated (stats/anchored.py).
        return (*judged_from_anchors(verdicts, one_step), one_step)

    def probe(
        self, pair: PairSpec, verdicts: Sequence[MetricVerdict], ran: Ran
    ) -> ProbeRequest | None:
        anchor = anchored_failure(verdicts)
        parted = [
            v.first_divergent_step
            for v in verdicts
            if v.metric != ANCHORED
            and v.gate
            and not v.passed
            and v.first_divergent_step is not None
        ]
        if anchor is None or (parted and min(parted) <= anchor):
            return None  # the curves parted first: the replay from step 1 finds it
        return ProbeRequest(
            control=pair.control,
            test=pair.test,
            checkpoint=anchor_path(anchor_folder(ran.controls[0]), anchor),
            folder=f"anchor{anchor}",
            step=anchor + 1,
            head={"anchor_step": anchor},
            failed=f"at anchor {anchor}",
        )


def sized_by_twins(pair: PairSpec, controls: int) -> bool:
    """Whether the pair's one-step tolerance comes from anchored twins: a control group with
    twins (``controls`` > 1) and a gating rule whose method sizes its envelope from them."""
    return controls > 1 and any(
        r.gate and get_comparison(r.method).anchored_twins for r in pair.rules
    )


def anchor_spacing(pair: PairSpec) -> int:
    """The steps between the pair's anchors as it runs (0: no anchored check): ``anchor_every``
    as written, or, where the experiment left it out, the automatic spacing from the test's
    steps (:func:`auto_anchor_every`, after the session's --convergence-steps) where it can
    run -- a control job (no golden curve), a test that does not resume, both sides on one
    trainer that saves and loads anchors across their layouts."""
    written = pair.check_key(KEY)
    if written is not None:
        return int(written)  # validated at collection (AnchoredCheck.validate)
    if pair.golden or pair.test.resume is not None:
        return 0
    every = auto_anchor_every(pair.test.steps)
    if every == 0 or every >= min(pair.test.steps, pair.control.steps):
        return 0
    try:
        backends = {
            "control": get_backend(pair.control.backend),
            "test": get_backend(pair.test.backend),
        }
        if not all(b.capabilities.anchors for b in backends.values()):
            return 0
        check_anchor_layouts(pair, backends, key="test")
    except (SpecError, NotRunnableHere):
        return 0  # the automatic check is only where it can run; an explicit one says why
    return every


def check_anchor_layouts(pair: PairSpec, backends: Mapping[str, Backend], *, key: str) -> None:
    """What the anchored check needs of the two sides beyond each backend's say: the anchors
    are one trainer's checkpoints, and some trainers cannot load them onto another DP degree."""
    control, test = backends["control"], backends[key]
    if control.name != test.name:
        raise SpecError(
            f"anchor_every: the test ({test.name!r}) cannot load the control's anchors, which "
            f"are the {control.name!r} trainer's checkpoints",
            file=pair.source,
            key=f"{key}.anchor_every",
            fix="run both sides on one backend, or drop anchor_every from this pair",
        )
    before, after = pair.control.layout.dp, pair.test.layout.dp
    if test.capabilities.anchors_keep_dp and before != after:
        raise SpecError(
            f"anchor_every: the test's data-parallel degree ({after}) is not the control's "
            f"({before}), and the {test.name!r} trainer's dataloader keeps one position per DP "
            "rank: it cannot load the control's anchors onto another DP degree",
            file=pair.source,
            key=f"{key}.anchor_every",
            fix=f"keep dp_replicate x dp_shard = {before} on the test (add tp, pp or cp ranks "
            "instead), or drop anchor_every from this pair",
        )


def anchor_folder(control: SideRun) -> Path:
    """Where the control's run keeps its anchors."""
    if control.run_dir is None:
        raise RunFailed("the control has no run folder to take anchors from")
    return RunDir(control.run_dir).dump.anchors


def anchored_job(test: JobSpec, folder: Path) -> JobSpec:
    """The test's layout, one logged step after each anchor in ``folder``."""
    return dataclasses.replace(test, name=f"{test.name}-anchored").asking(anchored_from=folder)


def with_part_norms(side: SideRun) -> RunMetrics:
    """The side's metrics with its per-part grad norms (``grad_norm/<part>``) and, for a
    mixture-of-experts model, its routing counts (``moe_tokens/...``) beside them, read from
    its JSONL log where the trainer wrote them (stats/anchored.py judges each part and tells
    a routing flip); a side without them, as it is."""
    if side.run_dir is None:
        return side.metrics
    path = side.metrics_path or RunDir(side.run_dir).dump.metrics
    extra = read_prefixed(path, PART_NORM_PREFIX, ROUTING_PREFIX)
    return {**side.metrics, **extra} if extra else side.metrics


def anchored_failure(verdicts: Sequence[MetricVerdict]) -> int | None:
    """The anchor step of a failed anchored verdict (None when it passed or is absent)."""
    for v in verdicts:
        if v.metric == ANCHORED and v.gate and not v.passed:
            step = v.details.get("anchor_step")
            return int(step) if isinstance(step, int) else None
    return None


def auto_anchor_every(steps: int) -> int:
    """The automatic anchor spacing of a run of ``steps`` steps (0: no anchors)."""
    if steps < AUTO_MIN_STEPS:
        return 0
    return max(AUTO_EVERY, steps // AUTO_MAX_ANCHORS)


def parse_anchor_every(value: Any, test: JobSpec, *, golden: Any, file: str, key: str) -> int:
    """The pair's ``anchor_every`` as written (0 when absent -- then automatic:
    :func:`anchor_spacing` -- or set to 0: off); SpecError with the fix for a bad one."""
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
