"""``convergence selftest EXPERIMENT.toml``: plant the shipped bugs on each layout of the
user's experiment and print what the suite catches (convergence/selftest/run.py)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, option_values
from convergence.launch.devices import session_devices
from convergence.nightly.power import append_power, due, last_selftest
from convergence.options import add_arguments, cli_run_settings
from convergence.preflight import in_tier, load_checked
from convergence.run.session import SessionRunner
from convergence.selftest.run import bug_names, render_table, selftest
from convergence.spec.errors import SpecError


def cmd_selftest(args: argparse.Namespace) -> int:
    values = option_values(args, "selftest")
    if values is None:
        return EXIT_USAGE
    # Every pair of the file unless --tier says otherwise: the user asks what *their* suite
    # can see, nightly pairs included.
    tier = args.tier or "nightly"
    power = Path(args.record_power) if args.record_power else None
    if power is not None and args.every_days is not None:
        last = last_selftest(power, str(args.experiment))
        if not due(power, str(args.experiment), every_days=args.every_days):
            print(
                f"selftest of {args.experiment} not due: last on {last} (every {args.every_days:g} days)"
            )
            return EXIT_OK
    experiment = load_checked(
        Path(args.experiment), rootdir=Path(args.rootdir).resolve(), max_tier=tier
    )
    pairs = [pair for pair in experiment.pairs if in_tier(pair, tier)]
    if not pairs:
        raise SpecError(
            f"no pair up to tier {tier!r}",
            file=str(args.experiment),
            fix="drop --tier (every pair of the file) or name a higher one",
        )
    devices = session_devices(values["launcher"], values["devices"])

    def progress(row: dict[str, Any]) -> None:
        print(f"  {row['layout']} {row['bug']}: {row['status']}", file=sys.stderr, flush=True)

    with closing(SessionRunner(cli_run_settings(values))) as runner:
        start = time.monotonic()
        rows = selftest(
            pairs,
            run=runner.run_pair,
            devices=devices,
            device_mode=values["device"],
            bugs=args.bugs.split(",") if args.bugs else None,
            layouts=args.layouts.split(",") if args.layouts else None,
            budget=args.budget,
            on_row=progress,
        )
    wall = time.monotonic() - start
    print(render_table(rows, markdown=args.markdown), end="")
    missed = [r for r in rows if r["status"] in ("MISSED", "FALSE ALARM")]
    print(
        f"{sum(r['status'] == 'caught' for r in rows)} caught, "
        f"{sum(r['status'] == 'MISSED' for r in rows)} missed, "
        f"{sum(r['status'] == 'FALSE ALARM' for r in rows)} false alarm(s) in {wall:.0f} s"
        " -- a missed bug means this pair's length and metrics cannot see that class of bug "
        "on this model and machine"
    )
    if args.json is not None:
        Path(args.json).write_text(
            json.dumps({"experiment": str(args.experiment), "wall_s": wall, "rows": rows}, indent=2)
            + "\n"
        )
    if power is not None:
        night = args.night or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        append_power(rows, power, night=night, experiment=str(args.experiment))
        print(f"{len(rows)} selftest row(s) of night {night} appended to {power}")
    return EXIT_FAILED if missed else EXIT_OK


def add_selftest_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "selftest",
        help="plant the shipped bugs on each layout of an experiment and print what it catches",
    )
    parser.add_argument("experiment", help="your experiment TOML file")
    parser.add_argument(
        "--rootdir", default=".", help="where relative train_config paths are looked up"
    )
    parser.add_argument(
        "--bugs", default=None, help=f"comma-separated subset of {','.join(bug_names())}"
    )
    parser.add_argument(
        "--layouts", default=None, help="comma-separated pair names to test (default: all)"
    )
    parser.add_argument("--budget", type=int, default=None, help="run at most this many pairs")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument(
        "--record-power",
        default=None,
        metavar="FILE",
        help="append the rows to this power history (JSONL) for `convergence decide --power`",
    )
    parser.add_argument(
        "--night", default=None, help="the night's name in the power history (default: UTC now)"
    )
    parser.add_argument(
        "--every-days",
        type=float,
        default=None,
        metavar="N",
        help="with --record-power: run only when the last recorded selftest of this experiment "
        "is N days old or more (the nightly's weekly selftest: 7)",
    )
    add_arguments(parser, skip=["report", "strict", "attribute"])
    parser.set_defaults(func=cmd_selftest)
