"""``convergence ab``: the same jobs from two commits (or worktrees) of a trainer, judged.

    convergence ab EXPERIMENT.toml --baseline main --candidate my-branch [--repo DIR]

What torchtitan's ``scripts/loss_compare.py`` does for two commits, with this project's
verdict: every job of the experiment (its control and its tests) runs once from each side --
a git worktree of ``--repo`` checked out at the ref, or an existing folder -- with the side's
folder as the working directory and first on PYTHONPATH, so a relative command (``train.py``),
a hook (``my_pkg.parallel:apply``) or torchtitan itself is imported from that side. Same seed,
same data, same layout on both sides: the candidate is judged against the baseline job by job
with the paired rules pytest uses (loss, grad norm, per-part grad norm and data fingerprint
gating, each "not compared" where a run does not log it; throughput and memory reported).
Nothing is read from or written to the run cache (both sides are code under test).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from convergence.calibration.select import select_calibration
from convergence.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    add_job_options,
    option_values,
    write_report_folder,
)
from convergence.cli.compare import compare_rules
from convergence.options import cli_run_settings
from convergence.preflight import load_checked
from convergence.regimes import REGISTRY
from convergence.report.formats.failure_text import render_outcome
from convergence.report.formats.terminal import render_summary
from convergence.run.jobs import JobFailed, JobRunner, RunSettings, apply_job_settings
from convergence.run.judge import judge
from convergence.run.outcome import PairOutcome
from convergence.run.settle import settle
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.worktrees import checkout, in_tree_settings, sigterm_as_interrupt

SIDES = ("baseline", "candidate")


def add_ab_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ab = sub.add_parser(
        "ab",
        help="run an experiment's jobs from two commits of a trainer and compare them",
        description=__doc__.split("\n\n", 2)[2] if __doc__ else None,
    )
    ab.add_argument("experiment", help="experiment TOML file (its jobs run on both sides)")
    for side, role in zip(SIDES, ("to compare against", "under test"), strict=True):
        ab.add_argument(
            f"--{side}",
            required=True,
            metavar="REF|DIR",
            help=f"git ref of --repo (or a folder) {role}",
        )
    ab.add_argument("--repo", default=".", metavar="DIR", help="the trainer's git repository")
    # The job options and a report. Not the cache ones (nothing is cached: both sides are code
    # under test), not early stop (both sides run to the end), not tier/alpha (paired rules).
    add_job_options(
        ab,
        "report",
        help_for={
            "workdir": "run folders, device-pool state and this stack's calibration; no run "
            "cache: ab reuses no run (default: ./.convergence, in the folder you run it from)"
        },
    )
    ab.set_defaults(func=cmd_ab)


def _jobs(pairs: Sequence[PairSpec]) -> list[JobSpec]:
    """Every distinct job of the experiment, control first."""
    seen: dict[str, JobSpec] = {}
    for pair in pairs:
        for job in (pair.control, pair.test):
            seen.setdefault(job.name, job)
    return list(seen.values())


def run_ab(
    experiment: Path,
    *,
    baseline: str,
    candidate: str,
    repo: Path,
    settings: RunSettings,
    rootdir: Path,
) -> list[PairOutcome]:
    """One outcome per job: the candidate's run judged against the baseline's."""

    # The job level alone (run/jobs.py): each side's jobs run fresh, no probe; the verdicts
    # are the one judge's (run/judge.py), with this stack's calibration as for pytest.
    jobs = [
        apply_job_settings(job, settings)
        for job in _jobs(load_checked(experiment, rootdir=rootdir).pairs)
    ]
    for job in jobs:
        if not job.techniques.bitwise_pairable:
            raise SpecError(
                f"job {job.name!r} is not deterministic fp32, so two runs of it "
                "differ by more than the paired tolerance even without a change",
                file=str(experiment),
                key="techniques",
                fix="compare a deterministic fp32 variant of the job (the seed "
                "regime's band needs replicates on both sides: not supported "
                "by `ab` yet)",
            )
    work = Path(settings.work_dir) / "ab"
    outcomes: list[PairOutcome] = []
    with (
        checkout(repo, baseline, work / "baseline-tree") as (base_dir, base_label),
        checkout(repo, candidate, work / "candidate-tree") as (cand_dir, cand_label),
    ):
        calibration = select_calibration(settings.work_dir)
        runners = {
            "baseline": JobRunner(in_tree_settings(settings, base_dir)),
            "candidate": JobRunner(in_tree_settings(settings, cand_dir)),
        }
        for job in jobs:
            # A deterministic fp32 job against itself: the regime a pair of it gets (paired).
            regime = REGISTRY.default_for(job, job)
            pair = PairSpec(
                pair_id=f"ab::{job.name}",
                control=job,
                test=job,
                rules=compare_rules(None, None, regime),
                regime=regime,
                early_stop=False,
                source=f"{base_label} vs {cand_label}",
            )
            sides = {}
            try:
                for side in SIDES:
                    sides[side] = runners[side].run_job(
                        side, job, pair_dir=work / "runs" / job.name, cacheable=False
                    )
            except JobFailed as exc:
                outcomes.append(
                    PairOutcome(
                        pair=pair,
                        status="error",
                        control=sides.get("baseline"),
                        test=None,
                        error=str(exc),
                    )
                )
                continue
            judgement = judge(
                pair,
                [sides["baseline"].metrics],
                sides["candidate"].metrics,
                calibration,
                test_meta=sides["candidate"].meta,
            )
            settled = settle(
                pair,
                judgement.verdicts,
                sides["baseline"].metrics,
                test_result=sides["candidate"].result,
            )
            outcomes.append(
                PairOutcome(
                    pair=pair,
                    status=settled.status,
                    error=settled.error,
                    control=sides["baseline"],
                    test=sides["candidate"],
                    verdicts=judgement.verdicts,
                )
            )
    return outcomes


def cmd_ab(args: argparse.Namespace) -> int:
    values = option_values(args, "ab")
    if values is None:
        return EXIT_USAGE
    values["no-early-stop"] = True  # both sides run to their last step: whole curves compared
    settings = cli_run_settings(values)
    with sigterm_as_interrupt():  # a killed `ab` still removes its worktrees and jobs
        outcomes = run_ab(
            Path(args.experiment),
            baseline=args.baseline,
            candidate=args.candidate,
            repo=Path(args.repo),
            settings=settings,
            rootdir=Path.cwd(),
        )
    print(f"baseline {args.baseline} vs candidate {args.candidate}:")
    print(render_summary(outcomes))
    for outcome in outcomes:
        if outcome.status != "passed":
            print(outcome.error or render_outcome(outcome))
    if values["report"] is not None:
        write_report_folder(
            outcomes,
            values["report"],
            {"ab": {"baseline": args.baseline, "candidate": args.candidate}},
        )
    return EXIT_OK if all(o.status == "passed" for o in outcomes) else EXIT_FAILED
