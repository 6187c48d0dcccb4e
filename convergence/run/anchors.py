"""The anchored check's jobs (pair key ``anchor_every``), on the job tier.

    control job   + checkpoint.anchor_every=N: its state after every N-th step, in its dump
                  folder (convergence/trainer/anchors.py); cached with the control's run
    anchored job  the test's layout + checkpoint.anchored_from=<those anchors>: one step
                  from each anchor (never cached: it is part of what is under test)
    -> its metrics, each part's grad norm among them (grad_norm/<part>, from its JSONL),
       go to the one judge beside the test's curves (stats/anchored.py)

When the anchored verdict fails, the numerics probe starts from the failing anchor itself
(:func:`probe_at_anchor`): both layouts load that checkpoint and probe the one step after it,
instead of replaying the whole run up to there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_part_norms
from convergence.run.jobs import JobRunner
from convergence.run.outcome import SideOutcome
from convergence.run.probe import probe_from_checkpoint
from convergence.run.together import run_together
from convergence.spec.anchors import ANCHORS_DIR
from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.stats.anchored import ANCHORED
from convergence.stats.registry import get_comparison
from convergence.stats.types import MetricVerdict


def with_anchor_saves(pair: PairSpec, jobs: Sequence[JobSpec]) -> list[JobSpec]:
    """The regime's control jobs, the control (first) saving anchors when the pair asks.
    Only the control: the twins size the tolerance, nothing starts from their state."""
    out = list(jobs)
    if pair.anchor_every and out:
        control = out[0]
        out[0] = dataclasses.replace(
            control,
            overrides=(*control.overrides, ("checkpoint.anchor_every", str(pair.anchor_every))),
        )
    return out


def anchor_folder(control: SideOutcome) -> Path:
    """Where the control's run keeps its anchors."""
    if control.run_dir is None:
        raise RunFailed("the control has no run folder to take anchors from")
    return control.run_dir / "dump" / ANCHORS_DIR


def anchored_job(test: JobSpec, folder: Path) -> JobSpec:
    """The test's layout, one logged step after each anchor in ``folder`` (no validation
    pass: the control's anchored steps are compared on the training metrics)."""
    return dataclasses.replace(
        test,
        name=f"{test.name}-anchored",
        overrides=(
            *test.overrides,
            ("checkpoint.anchored_from", str(folder)),
            ("metrics.log_freq", "1"),
            ("metrics.val_every", "0"),
        ),
    )


def with_part_norms(side: SideOutcome) -> SideOutcome:
    """The side with its per-part grad norms (``grad_norm/<part>``) beside its metrics, read
    from its JSONL log where the trainer wrote them: the anchored check judges each part
    (stats/anchored.py). A side without them is returned as it is."""
    if side.run_dir is None:
        return side
    path = side.run_dir / "dump" / "metrics.jsonl"
    if side.result is not None and side.result.metrics_path is not None:
        path = side.result.metrics_path
    parts = read_part_norms(path)
    return dataclasses.replace(side, metrics={**side.metrics, **parts}) if parts else side


def run_anchored(
    runner: JobRunner, pair: PairSpec, control: SideOutcome, *, pair_dir: Path
) -> SideOutcome:
    """The test layout's anchored steps (raises JobFailed, or SpecError when the control left
    no anchor: e.g. --convergence-steps cut the run below anchor_every)."""
    folder = anchor_folder(control)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise SpecError(
            f"anchor_every = {pair.anchor_every} left no anchor in the control's run of "
            f"{control.job.steps} steps ({folder})",
            file=pair.source,
            key="anchor_every",
            fix=f"run more than {pair.anchor_every} steps, or set a smaller anchor_every",
        )
    job = anchored_job(pair.test, folder)
    return with_part_norms(runner.run_job("test", job, pair_dir=pair_dir, cacheable=False))


def run_anchored_twins(
    runner: JobRunner, pair: PairSpec, controls: Sequence[SideOutcome], *, pair_dir: Path
) -> list[RunMetrics]:
    """The twins' one step from each anchor, where a rule sizes its envelope from twins
    (stats/anchored.py: the one-step envelope). Control-side: cached, so every pair of the
    control group shares them."""
    if len(controls) < 2 or not any(
        r.gate and get_comparison(r.method).anchored_twins for r in pair.rules
    ):
        return []
    folder = anchor_folder(controls[0])
    # Independent of each other, like the control-side jobs they mirror: at once where the
    # pool has room (run/together.py).
    sides = run_together(
        [
            partial(
                runner.run_job,
                "control",
                anchored_job(side.job, folder),
                pair_dir=pair_dir,
                cacheable=True,
            )
            for side in controls[1:]
        ],
        together=runner.settings.concurrent_controls,
    )
    return [with_part_norms(side).metrics for side in sides]


def anchored_failure(verdicts: Sequence[MetricVerdict]) -> int | None:
    """The anchor step of a failed anchored verdict (None when it passed or is absent)."""
    for v in verdicts:
        if v.metric == ANCHORED and v.gate and not v.passed:
            step = v.details.get("anchor_step")
            return int(step) if isinstance(step, int) else None
    return None


def probe_at_anchor(
    runner: JobRunner, pair: PairSpec, control: SideOutcome, anchor: int, *, pair_dir: Path
) -> dict[str, Any]:
    """The numerics probe of step anchor+1 on both layouts, each loading the control's anchor."""
    return probe_from_checkpoint(
        runner,
        pair.control,
        pair.test,
        anchor_folder(control) / f"step{anchor}",
        pair_dir / "probe" / f"anchor{anchor}",
        step=anchor + 1,
        head={"anchor_step": anchor},
        failed=f"at anchor {anchor}",
    )
