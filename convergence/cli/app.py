"""``convergence``: the command line for work outside pytest.

    convergence run EXPERIMENT.toml [--report DIR] [--steps N]   run every pair, print the matrix
    convergence compare A B [--metric M] [--method paired]        judge two finished runs
    convergence report --from OUTCOMES_DIR --out DIR              rebuild reports from saved outcomes
    convergence export-golden RUN_DIR OUT.json                     freeze a run as a golden curve
    convergence nightly --experiments PATH... --out DIR             write the nightly sbatch script
    convergence record REPORT.json HISTORY.jsonl                   append a night to the history
    convergence trend HISTORY.jsonl --out DIR                       trend report across nights
    convergence decide HISTORY.jsonl --out DIR                      tonight vs the last green nights
    convergence ab EXPERIMENT.toml --baseline REF --candidate REF   the same jobs from two commits
    convergence attribute EXPERIMENT::PAIR [--json FILE]           which axis a failing N-D pair blames
    convergence bisect GOOD BAD PAIR [--experiment FILE]          the first commit a pair fails at
    convergence configs                                             list the shipped train configs
    convergence cache list|verify|prune [--cache-dir DIR]          look after a run cache
    convergence calibrate SOURCE [--if-missing]                     measure this machine's floors
    convergence selftest EXPERIMENT [--json FILE]                   plant bugs: what the suite sees
    convergence --version

Exit status: 0 when everything passed, 1 when a pair/metric or a run failed (RunFailed), 2 for
invalid input (SpecError); ``decide`` has its own (nightly/decide.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from convergence import __version__
from convergence.cli.ab import add_ab_parser
from convergence.cli.attribute import add_attribute_parser
from convergence.cli.bisect import add_bisect_parser
from convergence.cli.cache import add_cache_parser
from convergence.cli.calibrate import add_calibrate_parser
from convergence.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    add_out_folder,
    option_values,
    write_report_folder,
)
from convergence.cli.compare import add_compare_parser, add_export_parser
from convergence.cli.nightly import add_subcommands as add_nightly_subcommands
from convergence.cli.selftest import add_selftest_parser
from convergence.configs import describe
from convergence.launch.devices import session_devices
from convergence.launch.progress_text import LogThrottle
from convergence.launch.types import Progress
from convergence.options import add_arguments, cli_run_settings
from convergence.preflight import in_tier, load_checked, validate_devices
from convergence.report.data.serialize import OutcomeFormatError, outcome_from_json
from convergence.report.formats.terminal import render_summary
from convergence.run.attribution import attribute_failed, attribution_on
from convergence.run.session import SessionRunner
from convergence.spec.errors import RunFailed, SpecError

OUTCOME_GLOBS = ("*.outcome.json", "*.json")


def _print_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _ProgressLog:
    """One line per job every ~10% of its steps, on stderr (rank logs stay in run folders)."""

    def __init__(self) -> None:
        self._throttle = LogThrottle()

    def __call__(self, p: Progress) -> None:
        line = self._throttle.line(p)
        if line is not None:
            _print_err(line)


# -- run ------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:

    values = option_values(args, "run")
    if values is None:
        return EXIT_USAGE
    path = Path(args.experiment)
    experiment = load_checked(
        path, rootdir=Path(args.rootdir).resolve(), max_tier=values["tier"], steps=values["steps"]
    )
    pairs = [pair for pair in experiment.pairs if in_tier(pair, values["tier"])]
    skipped = len(experiment.pairs) - len(pairs)
    if skipped:
        _print_err(f"{skipped} pair(s) above --tier {values['tier']} not run")
    devices = session_devices(values["launcher"], values["devices"])
    pairs = [
        validate_devices(pair, available_devices=devices, device_mode=values["device"])
        for pair in pairs
    ]
    settings = cli_run_settings(values, on_progress=_ProgressLog())
    outcomes = []
    # One device pool, run cache and launcher for all pairs; its fork servers end with it.
    with closing(SessionRunner(settings)) as runner:
        for pair in pairs:
            _print_err(f"running {pair.pair_id} ...")
            outcome = runner.run_pair(pair)
            if attribution_on(asked=bool(values["attribute"]), tier=values["tier"]):
                outcome = attribute_failed(
                    outcome, run=runner.run_pair, devices=devices, device_mode=values["device"]
                )
            _print_err(f"{pair.pair_id}: {outcome.status}")
            if outcome.status == "error" and outcome.error:
                _print_err(outcome.error)
            outcomes.append(outcome)
    print(render_summary(outcomes))
    if values["report"] is not None:
        write_report_folder(outcomes, values["report"], {"args": sys.argv[1:]})
    return EXIT_OK if all(o.status in ("passed", "skipped") for o in outcomes) else EXIT_FAILED


# -- report ---------------------------------------------------------------------------------


def load_outcome_files(folder: Path) -> list[Any]:

    if not folder.is_dir():
        raise SpecError(
            "not a folder",
            file=str(folder),
            fix="pass the session folder printed at the end of the pytest run "
            "(.convergence/sessions/<id>)",
        )
    files = sorted(folder.glob(OUTCOME_GLOBS[0])) or sorted(folder.glob(OUTCOME_GLOBS[1]))
    outcomes = []
    for path in files:
        try:
            outcomes.append(outcome_from_json(json.loads(path.read_text(encoding="utf-8"))))
        except (OutcomeFormatError, ValueError, KeyError) as exc:
            raise SpecError(
                f"not a saved pair outcome: {exc}",
                file=str(path),
                fix="point --from at a folder of *.outcome.json files",
            ) from None
    if not outcomes:
        raise SpecError(
            "no saved outcomes (*.outcome.json) in it",
            file=str(folder),
            fix="run pytest -m convergence first; it saves them under .convergence/sessions/",
        )
    return outcomes


def cmd_report(args: argparse.Namespace) -> int:

    outcomes = load_outcome_files(Path(args.source))
    print(render_summary(outcomes))
    write_report_folder(outcomes, Path(args.out), {"rebuilt_from": str(args.source)})
    return EXIT_OK if all(o.status in ("passed", "skipped") for o in outcomes) else EXIT_FAILED


# -- configs / version ----------------------------------------------------------------------


def cmd_configs(args: argparse.Namespace) -> int:

    print(describe())
    return EXIT_OK


def _version() -> str:
    """The installed distribution's version (what pip installed), else the source's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pytest-convergence")
    except PackageNotFoundError:
        return __version__


# -- main -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convergence", description="loss-convergence tests outside pytest"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    configs = sub.add_parser("configs", help="list the shipped train configs (by short name)")
    configs.set_defaults(func=cmd_configs)

    run = sub.add_parser("run", help="run every pair of an experiment file")
    run.add_argument("experiment", help="experiment TOML file")
    run.add_argument(
        "--rootdir",
        default=".",
        help="where relative train_config paths are looked up (besides the experiment's folder)",
    )
    # The same settings as pytest's --convergence-<name> options (one table: options.py);
    # the workdir defaults to ./.convergence here.
    add_arguments(run)
    run.set_defaults(func=cmd_run)

    add_compare_parser(sub)

    report = sub.add_parser("report", help="rebuild the reports from saved outcomes")
    report.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="OUTCOMES_DIR",
        help="folder of *.outcome.json (e.g. .convergence/sessions/<id>)",
    )
    add_out_folder(report, "report folder")
    report.set_defaults(func=cmd_report)

    add_export_parser(sub)

    add_ab_parser(sub)
    add_attribute_parser(sub)
    add_bisect_parser(sub)

    add_cache_parser(sub)

    add_calibrate_parser(sub)
    add_selftest_parser(sub)

    # -- nightly / record / trend / decide: Slurm nightly runs (cli/nightly.py) --

    add_nightly_subcommands(sub)
    return parser


#: Options whose one value is a string of other options (``--pytest-args "-x --foo=1"``).
STRING_OF_OPTIONS = ("--pytest-args", "--decide-args")


def join_string_options(argv: Sequence[str]) -> list[str]:
    """``--pytest-args "--convergence-workdir=/x"`` as ``--pytest-args=--convergence-workdir=/x``:
    argparse reads a value that starts with ``-`` as an option of its own and refuses
    ("expected one argument"), although the value is what the option is for."""
    out: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        if word in STRING_OF_OPTIONS and i + 1 < len(words) and words[i + 1].startswith("-"):
            out.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(join_string_options(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args))
    except SpecError as exc:
        _print_err(f"error: {exc}")
        return EXIT_USAGE
    except RunFailed as exc:  # valid input, a failed run: the exit status of a failed pair
        _print_err(f"error: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _print_err("interrupted: running jobs were stopped")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
