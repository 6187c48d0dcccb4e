"""``convergence calibrate``: measure the noise floors on this machine and write them to the
calibration file of its stack (convergence/calibration/).

    convergence calibrate debug                         # a shipped train config (~5 min, CPU)
    convergence calibrate experiments/quickstart.toml   # the train config of its first control
    convergence calibrate debug --steps 60 --bf16-layouts ddp2 fsdp2-tp2 fsdp2-cp2

Two small experiments run through the library's Runner (the same seed checkpoint, run cache,
launcher and device pool as a test session), early stopping off so every curve is whole:

- fp32, paired regime: a control FSDP(2) against layouts that only reorder reductions
  (``--fp32-layouts``); their differences give the paired floors (atol) per metric.
- bf16 parameters, twin regime: the same control in bf16, its noise twin (Backend.noise_twin)
  and correct layouts (``--bf16-layouts``); their differences give the twin's rtol and k.

convergence/calibration_runs.py builds and runs the pairs (the session options --devices,
--launcher, --cache-dir, --refresh and the job limits apply, as in ``convergence run``) and
turns the curves into values (never below the shipped defaults; ``--margin`` times what the
worst layout needed). The file records the stack, the values, and how they were
obtained; every later session on this stack uses it and says so in its verdicts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from contextlib import closing
from pathlib import Path

from convergence.calibration.file import Calibration, default_path, write_calibration
from convergence.calibration.select import select_calibration
from convergence.calibration.stack import current_stack, stack_hash
from convergence.calibration_runs import (
    BF16,
    DEFAULT_CONTROL,
    FP32,
    PRECISIONS,
    PRESETS,
    Precision,
    calibration_pairs,
    measure,
    read_source,
    run_pairs,
)
from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, add_job_options, option_values
from convergence.options import cli_run_settings
from convergence.run.outcome import PairOutcome
from convergence.run.session import SessionRunner
from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.pair import PairSpec

DEFAULT_STEPS = 30
#: What each experiment's layouts are judged against, and what "none" skips (--help).
LAYOUTS_HELP = {
    FP32: ("against FSDP(2)", f"known: {', '.join(PRESETS)}; none: skip the paired floors"),
    BF16: ("against FSDP(2) and its twin", "none: skip the twin"),
}


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate",
        help="measure the paired/twin noise floors on this machine and write its calibration",
        epilog=f"--steps is the steps of every calibration job (default {DEFAULT_STEPS}).",
    )
    p.add_argument(
        "source", help="a train config (shipped name or path) or an experiment TOML file"
    )
    p.add_argument(
        "--control",
        default=DEFAULT_CONTROL,
        choices=sorted(PRESETS),
        help=f"the control layout (default {DEFAULT_CONTROL}; single: a one-GPU machine)",
    )
    p.add_argument("--seed", type=int, default=7, help="training seed (default 7)")
    for precision in PRECISIONS:
        against, more = LAYOUTS_HELP[precision]
        p.add_argument(
            f"--{precision.name}-layouts",
            nargs="*",
            default=list(precision.default_layouts),
            choices=[*sorted(PRESETS), "none"],
            metavar="LAYOUT",
            help=f"correct {precision.name} layouts {against} (default "
            f"{' '.join(precision.default_layouts)}; {more})",
        )
    p.add_argument(
        "--margin",
        type=float,
        default=2.0,
        help="headroom over the worst layout measured (default 2)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the calibration file (default <workdir>/calibration/<stack hash>.json)",
    )
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when a calibration for this stack exists (the nightly's step)",
    )
    # The job options and the cache's: not tier/report/strict (no experiment of the user's),
    # not the backend (the source's), not early stop (always off: every curve whole), not alpha.
    add_job_options(p, "cache-dir", "refresh")
    # Steps per job: the table's --steps with calibrate's own default (its jobs have no other).
    p.set_defaults(func=cmd_calibrate, steps=DEFAULT_STEPS)


def _announce(pair: PairSpec) -> None:
    print(f"calibrate: running {pair.pair_id} ...", file=sys.stderr, flush=True)


def cmd_calibrate(args: argparse.Namespace) -> int:
    values = option_values(args, "calibrate")
    if values is None:
        return EXIT_USAGE
    values["no-early-stop"] = True  # every curve whole: the floors are measured on all steps
    settings = cli_run_settings(values)
    started = dt.datetime.now(dt.timezone.utc)
    work_dir = settings.work_dir
    # "none" (or no layout at all) skips that part, as --help says.
    layouts: dict[Precision, list[str]] = {
        precision: [name for name in getattr(args, f"{precision.name}_layouts") if name != "none"]
        for precision in PRECISIONS
    }
    if args.if_missing:
        found = select_calibration(work_dir, explicit=args.out)
        if found.calibration is not None:
            print(f"calibration for stack {found.stack_hash} exists: {found.path}; nothing to do")
            return EXIT_OK
        print(found.note, file=sys.stderr)
    outcomes: dict[Precision, list[PairOutcome]] = {}
    # One device pool, run cache and launcher for both; its fork servers end with it.
    with closing(SessionRunner(settings)) as runner:
        try:
            source = read_source(args.source, rootdir=Path.cwd())
            # Both experiments built (and checked) before anything runs.
            pairs = {
                precision: calibration_pairs(
                    source,
                    names,
                    precision,
                    steps=values["steps"],
                    seed=args.seed,
                    control=args.control,
                    rootdir=Path.cwd(),
                )
                for precision, names in layouts.items()
            }
            for precision, its_pairs in pairs.items():
                outcomes[precision] = run_pairs(its_pairs, runner, on_start=_announce)
        except (SpecError, RunFailed) as exc:
            print(f"convergence calibrate: {exc}", file=sys.stderr)
            return EXIT_FAILED
    floors = measure(outcomes[FP32], outcomes[BF16], margin=args.margin)
    stack = current_stack()
    digest = stack_hash(stack)
    calibration = Calibration(
        stack_hash=digest,
        stack=stack,
        paired=floors.paired,
        twin=floors.twin,
        obtained={
            "source": args.source,
            "train_config": str(source.train_config),
            "backend": source.backend,
            "steps": values["steps"],
            "seed": args.seed,
            "control": args.control,
            "fp32_layouts": layouts[FP32],
            "bf16_layouts": layouts[BF16],
            "margin": args.margin,
            "date": started.isoformat(timespec="seconds"),
            "wall_s": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
            "measured": floors.figures,
        },
    )
    path = write_calibration(calibration, args.out or default_path(work_dir, digest))
    print(f"calibration for stack {digest} ({stack['hardware']}, torch {stack['torch']})")
    for regime, table in (("paired (fp32)", floors.paired), ("twin (bf16)", floors.twin)):
        for metric, floor in table.items():
            shown = ", ".join(f"{k} {v:.3g}" for k, v in floor.items())
            print(f"  {regime:14s} {metric:16s} {shown}")
    print(f"written to {path}")
    return EXIT_OK
