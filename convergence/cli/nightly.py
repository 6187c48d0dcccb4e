"""``convergence nightly | record | trend``: the nightly subcommands, wired into
convergence.cli by :func:`add_subcommands` (kept here so the main CLI stays a list of
parsers, and the nightly code stays one package).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from convergence.cli.common import add_out_folder
from convergence.nightly.decide import (
    EXIT_DRIFT,
    EXIT_RED,
    BandSettings,
    Notify,
    decide,
    summary_markdown,
    write_decision,
)
from convergence.nightly.history import append_history, current_commit, read_history
from convergence.nightly.power import DEFAULT_STEP_SLACK, power_drops, read_power
from convergence.nightly.sbatch import NightlySettings, render_sbatch, write_sbatch
from convergence.nightly.sizing import largest_job, nodes_for
from convergence.nightly.trend import write_trend


def _nodes(args: argparse.Namespace) -> int:
    """--nodes, else from the largest job and the devices per node (sizing.py)."""
    if args.nodes is not None:
        return int(args.nodes)
    per_node = args.devices_per_node or args.gpus_per_node
    rootdir = Path(args.rootdir).resolve()
    largest = largest_job([rootdir / e for e in args.experiments], rootdir=rootdir)
    if per_node is None or largest is None:
        print(
            "--nodes 1 (give --gpus-per-node or --devices-per-node to size the allocation "
            "from the largest pair)",
            file=sys.stderr,
        )
        return 1
    nodes = nodes_for(largest.world_size, per_node)
    print(
        f"--nodes {nodes}: the largest job is {largest.where}, {largest.world_size} "
        f"devices at {per_node} per node",
        file=sys.stderr,
    )
    return nodes


def cmd_nightly(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix in (".sbatch", ".sh") or out.is_file():
        # A script's name given as --out would become a folder holding the script.
        print(
            f"convergence nightly: --out {args.out} names a file; --out is the nightly's "
            "folder (nights/, history.jsonl, Slurm output)\n  fix: --out DIR, and --script "
            f"{args.out} for the script's own path (default OUT/nightly.sbatch)",
            file=sys.stderr,
        )
        return 2
    settings = NightlySettings(
        experiments=tuple(args.experiments),
        out=str(out.resolve()),
        rootdir=str(Path(args.rootdir).resolve()),
        history=args.history,
        nodes=_nodes(args),
        time=args.time,
        partition=args.partition,
        gpus_per_node=args.gpus_per_node,
        exclusive=not args.no_exclusive,
        sbatch_options=tuple(args.sbatch_option or ()),
        pytest_args=tuple(shlex.split(args.pytest_args or "")),
        decide_args=tuple(shlex.split(args.decide_args or "")),
        reuse_controls=args.reuse_controls,
        calibrate=None if args.calibrate == "none" else args.calibrate,
        selftest=tuple(args.selftest or ()),
        selftest_every_days=args.selftest_every_days,
    )
    if args.stdout:
        print(render_sbatch(settings))
        return 0
    script = write_sbatch(settings, Path(args.script) if args.script else out / "nightly.sbatch")
    print(f"sbatch script written to {script}")
    if args.submit:
        done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
        print((done.stdout or done.stderr).strip())
        return 0 if done.returncode == 0 else 1
    print(f"submit it with: sbatch {script}")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    night = args.night or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    # The night's commit: named by the script (taken before pytest ran), else HEAD here.
    commit = args.commit if args.commit is not None else current_commit(Path.cwd())
    records = append_history(
        Path(args.report),
        Path(args.history),
        night=night,
        pytest_status=args.pytest_status,
        commit=commit or None,
    )
    print(f"{len(records)} pair(s) of night {night} appended to {args.history}")
    return 0


def cmd_trend(args: argparse.Namespace) -> int:
    files = write_trend(Path(args.history), Path(args.out))
    for path in (files.markdown, files.json, *files.pngs):
        print(f"  {path}")
    if files.tensorboard:
        print(
            f"  {Path(args.out) / 'tensorboard'} ({len(files.tensorboard)} run(s): "
            f"tensorboard --logdir {Path(args.out) / 'tensorboard'})"
        )
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    try:
        settings = BandSettings(
            window=args.window, k=args.k, min_nights=min(args.min_nights, args.window)
        )
    except ValueError as exc:
        print(f"convergence decide: {exc}", file=sys.stderr)
        return 2
    decision = decide(read_history(Path(args.history)), settings)
    if args.power is not None and decision.night is not None:
        # a drop in the suite's power on a selftest night is a drift like the others
        drops = power_drops(
            read_power(Path(args.power)), night=decision.night, step_slack=args.power_step_slack
        )
        decision = dataclasses.replace(decision, findings=(*decision.findings, *drops))
    problems = write_decision(
        decision,
        Path(args.out),
        Notify(command=args.hook, url=args.post, always=args.notify == "always"),
    )
    print(summary_markdown(decision), end="")
    for problem in problems:
        print(f"convergence decide: notification failed: {problem}", file=sys.stderr)
    return decision.exit_status


def add_subcommands(sub: Any) -> None:
    """Register ``nightly``, ``record`` and ``trend`` on the CLI's subparsers."""
    nightly = sub.add_parser("nightly", help="write (or submit) the nightly sbatch script")
    nightly.add_argument(
        "--experiments",
        nargs="+",
        required=True,
        metavar="PATH",
        help="experiment TOML files or folders (pytest arguments)",
    )
    add_out_folder(nightly, "folder for nights, Slurm output and history.jsonl")
    nightly.add_argument("--history", help="history file (default OUT/history.jsonl)")
    nightly.add_argument("--rootdir", default=".", help="where pytest runs (default: here)")
    nightly.add_argument("--script", help="where to write the script (default OUT/nightly.sbatch)")
    nightly.add_argument("--stdout", action="store_true", help="print the script instead")
    nightly.add_argument("--submit", action="store_true", help="sbatch it right away")
    nightly.add_argument(
        "--nodes",
        type=int,
        help="nodes to allocate (default: enough for "
        "the largest job, at --devices-per-node or --gpus-per-node; else 1)",
    )
    nightly.add_argument(
        "--devices-per-node",
        type=int,
        metavar="N",
        help="devices per node for sizing (default --gpus-per-node; on a CPU "
        "cluster the CPU slots per node)",
    )
    nightly.add_argument("--time", default="08:00:00", help="Slurm time limit")
    nightly.add_argument("--partition")
    nightly.add_argument("--gpus-per-node", type=int)
    nightly.add_argument(
        "--no-exclusive",
        action="store_true",
        help="share nodes with other jobs (default: --exclusive)",
    )
    nightly.add_argument(
        "--sbatch-option",
        action="append",
        metavar="OPT",
        help="extra #SBATCH option, e.g. --account=ml (repeatable)",
    )
    nightly.add_argument("--pytest-args", help="extra pytest arguments (one string)")
    nightly.add_argument(
        "--decide-args",
        help="extra `convergence decide` arguments (one "
        "string), e.g. \"--hook 'mail -s nightly ops@x' --post URL\"",
    )
    nightly.add_argument(
        "--reuse-controls",
        action="store_true",
        help="reuse cached control runs across nights (default: re-run them "
        "each night, so the trend shows the stack drifting)",
    )
    nightly.add_argument(
        "--calibrate",
        default="debug",
        metavar="SOURCE",
        help="train config or experiment that `convergence calibrate --if-missing` measures "
        "the noise floors on before each night, when none matches the stack (default debug; "
        "none: no calibration step)",
    )
    nightly.add_argument(
        "--selftest",
        nargs="+",
        metavar="EXPERIMENT",
        help="experiment files to run `convergence selftest` on every --selftest-every-days "
        "(weekly by default); a drop in power is a drift alert",
    )
    nightly.add_argument(
        "--selftest-every-days",
        type=float,
        default=7.0,
        metavar="N",
        help="how often the selftest runs (default 7: weekly)",
    )
    nightly.set_defaults(func=cmd_nightly)

    record = sub.add_parser("record", help="append a report.json's pairs to a history file")
    record.add_argument("report", help="report.json")
    record.add_argument("history", help="history JSONL file (appended to)")
    record.add_argument("--night", help="night name (default: UTC time stamp)")
    record.add_argument("--pytest-status", type=int, help="pytest's exit status that night")
    record.add_argument(
        "--commit",
        help="the commit the night ran (default: git HEAD of the current folder); lets "
        "`convergence decide` print the bisect command for a pair that turned red",
    )
    record.set_defaults(func=cmd_record)

    trend = sub.add_parser(
        "trend", help="trend report across nights (markdown, JSON, PNGs, TensorBoard runs)"
    )
    trend.add_argument("history", help="history JSONL file")
    add_out_folder(trend, "report folder: trend.md, trend.json, trend*.png, tensorboard/")
    trend.set_defaults(func=cmd_trend)

    dec = sub.add_parser(
        "decide",
        help="tonight vs the band of the last green nights: exit "
        f"{EXIT_DRIFT} on drift, {EXIT_RED} when a pair "
        "turned red; decision.json/.md, notification hooks",
    )
    dec.add_argument("history", help="history JSONL file")
    add_out_folder(dec, "where decision.json and decision.md go")
    dec.add_argument(
        "--window", type=int, default=20, help="the last N green nights form the band (default 20)"
    )
    dec.add_argument(
        "--min-nights",
        type=int,
        default=5,
        help="fewer green nights than this: no decision for a metric (default 5)",
    )
    dec.add_argument(
        "--k",
        type=float,
        default=6.0,
        help="band half width in robust sigmas, 1.4826 x MAD (default 6)",
    )
    dec.add_argument(
        "--hook",
        metavar="CMD",
        help="shell command run with the markdown summary on stdin "
        "(CONVERGENCE_DECISION=<decision.json>)",
    )
    dec.add_argument("--post", metavar="URL", help="POST decision.json to this URL")
    dec.add_argument(
        "--power",
        metavar="FILE",
        help="power history of the weekly selftest (`convergence selftest --record-power`): "
        "on a night that ran it, a bug caught before and missed now, or caught later, is drift",
    )
    dec.add_argument(
        "--power-step-slack",
        type=int,
        default=DEFAULT_STEP_SLACK,
        metavar="N",
        help=f"caught more than N steps later than the last selftest is drift (default "
        f"{DEFAULT_STEP_SLACK})",
    )
    dec.add_argument(
        "--notify",
        choices=("problems", "always"),
        default="problems",
        help="when the hooks and $GITHUB_STEP_SUMMARY fire (default: on drift "
        "or a pair turned red)",
    )
    dec.set_defaults(func=cmd_decide)
