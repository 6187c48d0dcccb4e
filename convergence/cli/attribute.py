"""``convergence attribute EXPERIMENT.toml::PAIR``: run one pair and, when it fails, the
lower-dimensional pairs that name the axis to blame (convergence/run/attribution.py)."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, option_values
from convergence.launch.devices import session_devices
from convergence.options import add_arguments, cli_run_settings
from convergence.preflight import load_checked, validate_devices
from convergence.report.formats.terminal import render_summary
from convergence.run.attribution import attribute_failed, layout_axes
from convergence.run.session import SessionRunner
from convergence.spec.errors import SpecError


def cmd_attribute(args: argparse.Namespace) -> int:
    values = option_values(args, "attribute")
    if values is None:
        return EXIT_USAGE
    file, sep, name = str(args.pair).partition("::")
    if not sep or not name:
        raise SpecError(
            f"{args.pair!r} names no pair",
            file=file,
            fix="write EXPERIMENT.toml::PAIR, e.g. experiments/converging.toml::fsdp2-tp2-pp2",
        )
    experiment = load_checked(Path(file), rootdir=Path(args.rootdir).resolve())
    pairs = {pair.name: pair for pair in experiment.pairs}
    if name not in pairs:
        raise SpecError(
            f"no pair named {name!r}",
            file=file,
            fix=f"name one of {', '.join(sorted(pairs))}",
        )
    pair = pairs[name]
    if len(layout_axes(pair.test.layout)) < 2:
        print(
            f"{pair.pair_id}: its test has fewer than two non-DP axes "
            f"({pair.test.layout.short_name()}): a failure is its own axis's",
            file=sys.stderr,
        )
    devices = session_devices(values["launcher"], values["devices"])
    pair = validate_devices(pair, available_devices=devices, device_mode=values["device"])
    with closing(SessionRunner(cli_run_settings(values))) as runner:
        print(f"running {pair.pair_id} ...", file=sys.stderr, flush=True)
        outcome = runner.run_pair(pair)
        outcome = attribute_failed(
            outcome, run=runner.run_pair, devices=devices, device_mode=values["device"]
        )
    print(render_summary([outcome]))
    record: dict[str, Any] | None = outcome.attribution
    if record is not None:
        print(f"attribution: {record['summary']}")
    elif outcome.status == "passed":
        print(f"{pair.pair_id} passed: nothing to attribute")
    if args.json is not None:
        Path(args.json).write_text(
            json.dumps(
                {"pair": pair.pair_id, "status": outcome.status, "attribution": record}, indent=2
            )
            + "\n"
        )
    return EXIT_OK if outcome.status == "passed" else EXIT_FAILED


def add_attribute_parser(sub: Any) -> None:
    attribute = sub.add_parser(
        "attribute",
        help="run one pair and, if it fails, name the axis (TP, SP, CP, PP) or combination "
        "to blame",
    )
    attribute.add_argument("pair", metavar="EXPERIMENT::PAIR", help="e.g. exp.toml::fsdp2-tp2-cp2")
    attribute.add_argument(
        "--rootdir", default=".", help="where relative train_config paths are looked up"
    )
    attribute.add_argument("--json", default=None, metavar="FILE", help="also write it as JSON")
    add_arguments(attribute, skip=["tier", "report", "strict", "attribute"])
    attribute.set_defaults(func=cmd_attribute)
