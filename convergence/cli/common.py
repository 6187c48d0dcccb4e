"""What the command-line front ends share: exit codes, writing a report folder, the option
table's values of a subcommand's flags. A module of its own, below them all, so that no front
end imports another for a helper (app.py imports each one to register it: that would be a
cycle)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.options import OPTIONS, OptionError, add_arguments, values_from_args
from convergence.report import write_reports
from convergence.report.data.schema import default_environment
from convergence.run.outcome import PairOutcome

#: 0 when everything passed, 1 when a pair or metric failed, 2 for invalid input.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: The session options of every subcommand that runs jobs outside pytest (``ab``, ``bisect``,
#: ``calibrate``): where its run state goes, how long its jobs are and where and how they run.
JOB_OPTIONS = ("workdir", "steps", "devices", "launcher", "idle-limit", "wall-limit")


def add_job_options(
    parser: argparse.ArgumentParser, *more: str, help_for: Mapping[str, str] | None = None
) -> None:
    """The option table's :data:`JOB_OPTIONS` and ``more`` as flags of a subcommand: the same
    flags, types and checks as ``convergence run`` and pytest (convergence/options.py);
    ``help_for``: the subcommand's own help text of some of them."""
    names = (*JOB_OPTIONS, *more)
    add_arguments(
        parser, skip=[opt.name for opt in OPTIONS if opt.name not in names], help_for=help_for
    )


def add_out_folder(parser: argparse.ArgumentParser, help: str) -> None:
    """The required ``--out DIR`` of a subcommand that writes a folder of files."""
    parser.add_argument("--out", required=True, metavar="DIR", help=help)


def write_report_folder(
    outcomes: Sequence[PairOutcome], out_dir: Path, extra_env: dict[str, Any]
) -> None:
    """report.json/.md/.html and plots into ``out_dir``; prints each file written."""
    # As in pytest: a CI job's summary ($GITHUB_STEP_SUMMARY, when set) gets report.md too.
    paths = write_reports(
        list(outcomes),
        out_dir,
        environment={**default_environment(), **extra_env},
        step_summary_env=os.environ,
    )
    for kind, path in sorted(dict(paths).items()):
        print(f"  {kind}: {path}")


def option_values(args: argparse.Namespace, command: str) -> dict[str, Any] | None:
    """The option table's values of a subcommand's flags (relative paths against the cwd);
    None after saying on stderr which one is out of range (the caller exits EXIT_USAGE)."""
    try:
        return values_from_args(args, cwd=Path.cwd())
    except OptionError as exc:
        print(f"convergence {command}: {exc}", file=sys.stderr)
        return None
