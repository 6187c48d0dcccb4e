"""The session options: one table for the pytest plugin and the ``convergence run`` CLI.

Each option is written once here: its name, help, type, choices and default, how a value
written as text converts (:meth:`Option.convert`), the check on its value (:attr:`Option.check`)
and the :class:`~convergence.run.jobs.RunSettings` field it sets (:attr:`Option.setting`,
:attr:`Option.to_setting`). The plugin turns the table into ``--convergence-<name>`` flags and
``convergence_<name>`` ini keys (``pytest_convergence/options.py``); the CLI into
``convergence run --<name>`` flags. Both read it generically, option by option, so both front
ends accept the same settings, with the same meaning and the same errors, and a new option is
one entry here (plus its RunSettings field, when it has one).
"""

from __future__ import annotations

import argparse
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from convergence.backends import backend_names
from convergence.launch.types import Progress
from convergence.run.jobs import RunSettings
from convergence.spec.experiment import TIERS  # quick < ci < nightly

OptionKind = Literal["string", "path", "int", "float", "bool", "choice"]
KINDS: tuple[OptionKind, ...] = get_args(OptionKind)


class OptionError(ValueError):
    """A value that no run can use; the message names the option (without its prefix)."""


@dataclass(frozen=True, kw_only=True)
class Option:
    name: str
    """``--convergence-<name>`` / ini ``convergence_<name with _>`` in pytest, ``--<name>`` in
    the CLI."""
    help: str
    kind: OptionKind = "string"
    """One of :data:`KINDS`; ``path`` values are relative to where they were written."""
    choices: tuple[str, ...] = ()
    default: Any = None
    cli_help: str = ""
    """The help of ``convergence run``/``ab`` where it differs from pytest's (no pytest
    config there, so no rootdir); empty: :attr:`help`."""
    check: Callable[[Any], str | None] | None = None
    """What is wrong with a converted value (``"must be >= 1"``), None when it is fine; a
    front end reports ``<flag> <problem>, got <value>`` (:func:`check_values`)."""
    setting: str | None = None
    """The :class:`~convergence.run.jobs.RunSettings` field this option sets; None for those
    the front ends use themselves (tier, report, workdir, strict)."""
    to_setting: Callable[[Any], Any] | None = None
    """The field's value from the option's (None: the same value)."""

    def convert(self, value: Any) -> Any:
        """``value`` as written in an ini file (text) as this option's type. Raises
        :class:`OptionError` whose text follows ``<key> = <value>`` (flags are converted by
        argparse with :attr:`parse` and :attr:`choices`)."""
        if value is None or self.kind in ("bool", "string", "path"):
            return value
        if self.kind in ("int", "float"):
            try:
                return self.parse(value)
            except ValueError:
                raise OptionError(f" is not a {self.kind}; fix: write a number") from None
        if value not in self.choices:
            raise OptionError(f": use one of {', '.join(self.choices)}")
        return value

    @property
    def parse(self) -> Callable[[str], Any]:
        """Text to value for argparse's ``type`` and :meth:`convert`."""
        return _PARSE.get(self.kind, str)


_PARSE: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "path": Path}


# The checks of the table (each returns the problem, or None).
def _at_least_one(value: Any) -> str | None:
    return None if value >= 1 else "must be >= 1"


def _positive_seconds(value: Any) -> str | None:
    # "not > 0" rather than "<= 0": a NaN (float("nan") parses) is refused too.
    return None if value > 0 else "must be > 0 seconds"


def _probability(value: Any) -> str | None:
    return None if 0 < value < 1 else "must be between 0 and 1"


OPTIONS: tuple[Option, ...] = (
    Option(
        name="backend",
        help=f"override every job's trainer backend ({', '.join(backend_names())})",
        kind="choice",
        choices=backend_names(),
        setting="backend",
    ),
    Option(
        name="launcher",
        help="how jobs are started: local (ranks forked from a warm per-session server), "
        "torchrun (a local torchrun per job) or slurm (srun+torchrun)",
        kind="choice",
        choices=("local", "torchrun", "slurm"),
        default="local",
        setting="launcher",
    ),
    Option(
        name="devices",
        help="devices (GPUs, or CPU slots) jobs may use; default: detect",
        kind="int",
        check=_at_least_one,
        setting="devices",
    ),
    Option(
        name="device",
        help="where pairs run when the GPUs cannot give each rank its own: auto (ranks "
        "share a GPU where gloo runs the layout's collectives on CUDA, else CPU), cuda "
        "(GPUs only: skip the rest), cpu (every built-in pair on CPU)",
        kind="choice",
        choices=("auto", "cuda", "cpu"),
        default="auto",
    ),
    Option(
        name="attribute",
        help="when a pair whose test has two or more non-DP axes (TP, SP, CP, PP) fails, run "
        "the lower-dimensional pairs that isolate each axis against the same control and "
        "name the axis or combination to blame (on by default with --convergence-tier nightly)",
        kind="bool",
        default=False,
    ),
    Option(
        name="strict",
        help="a pair this session cannot run (more devices than it has, a "
        "backend that is not installed) is a collection error instead of a skip",
        kind="bool",
        default=False,
    ),
    Option(
        name="steps",
        help="override every job's steps (quick looks; verdicts still apply)",
        kind="int",
        check=_at_least_one,
        setting="steps",
    ),
    Option(
        name="cache-dir",
        help="run cache folder (default: <workdir>/cache)",
        kind="path",
        setting="cache_dir",
    ),
    Option(
        name="refresh",
        help="ignore cached control runs and run them again",
        kind="bool",
        default=False,
        setting="refresh",
    ),
    Option(
        name="report", help="write report.json/.md/.html and plots into this folder", kind="path"
    ),
    Option(
        name="no-early-stop",
        help="always run the test job to its last step",
        kind="bool",
        default=False,
        setting="early_stop",
        to_setting=operator.not_,
    ),
    Option(
        name="alpha",
        help="level of the seed-band equivalence test (TOST)",
        kind="float",
        check=_probability,
        setting="alpha",
    ),
    Option(
        name="tier",
        help="run pairs up to this tier: quick < ci < nightly (default quick); "
        "pairs of higher tiers are deselected",
        kind="choice",
        choices=TIERS,
        default="quick",
    ),
    Option(
        name="workdir",
        help="run folders, device-pool state and cache (default: "
        "<rootdir>/.convergence when pytest found a config file, else ./.convergence)",
        kind="path",
        cli_help="run folders, device-pool state and cache (default: "
        "./.convergence, in the folder you run it from)",
    ),
    Option(
        name="idle-limit",
        help="watchdog: end a job when no new metrics line came for this "
        "many seconds (a rank hung in a collective); default 300",
        kind="float",
        check=_positive_seconds,
        setting="idle_limit_s",
    ),
    Option(
        name="wall-limit",
        help="end a job after this many seconds in all; default 3600",
        kind="float",
        check=_positive_seconds,
        setting="wall_limit_s",
    ),
)


#: RunSettings fields that no option sets: the front ends pass the workdir (each with its own
#: default) and the progress printer; the others are set by ``ab``/``bisect`` for their jobs,
#: or identify the session.
SETTINGS_WITHOUT_OPTION = (
    "work_dir",
    "job_cwd",
    "job_env",
    "key_extra",
    "session_id",
    "on_progress",
    # A library switch (tests and benchmarks compare both ways): the plugin and the CLI always
    # run a pair's control-side jobs at once where the pool has room (run/together.py).
    "concurrent_controls",
)


def check_values(values: Mapping[str, Any], *, prefix: str) -> None:
    """Every option's :attr:`~Option.check` on converted values (``prefix``:
    ``--convergence-`` or ``--``); the first problem raises :class:`OptionError`."""
    for opt in OPTIONS:
        value = values.get(opt.name)
        problem = opt.check(value) if opt.check and value is not None else None
        if problem:
            raise OptionError(f"{prefix}{opt.name} {problem}, got {value}")


def run_settings(
    values: Mapping[str, Any],
    *,
    work_dir: Path,
    on_progress: Callable[[Progress], None] | None = None,
) -> RunSettings:
    """The Runner's settings from checked values (paths already resolved): each option with a
    :attr:`~Option.setting` sets its field; an option not given (None) leaves the field's
    default."""
    given = {
        opt.setting: (opt.to_setting or _same)(values[opt.name])
        for opt in OPTIONS
        if opt.setting is not None and values.get(opt.name) is not None
    }
    return RunSettings(work_dir=work_dir, on_progress=on_progress, **given)


def _same(value: Any) -> Any:
    return value


#: Where ``convergence run``, ``ab`` and ``bisect`` keep their run state without --workdir:
#: in the folder they run from (pytest's default depends on its rootdir: the plugin's own).
CLI_WORKDIR = Path(".convergence")


def cli_run_settings(
    values: Mapping[str, Any], *, on_progress: Callable[[Progress], None] | None = None
) -> RunSettings:
    """A subcommand's settings: :func:`run_settings` under --workdir, else ./.convergence
    (made absolute: jobs may run in another folder, ``ab``'s worktrees)."""
    work_dir = values.get("workdir") or CLI_WORKDIR
    return run_settings(values, work_dir=work_dir.resolve(), on_progress=on_progress)


def resolve_path(value: str | Path | None, base: Path) -> Path | None:
    """A ``path`` option's value: ``~`` expanded, a relative path taken relative to ``base``,
    where it was written (the invocation directory for a flag, the ini file's folder for an
    ini key). None or "" (an ini key left empty) is None. Both front ends call this."""
    if value is None or value == "":
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def add_arguments(parser: argparse.ArgumentParser, *, skip: Iterable[str] = ()) -> None:
    """The table as ``--<name>`` flags of an argparse parser (values default to None, so the
    caller can tell "not given" from a default)."""
    skipped = set(skip)
    for opt in OPTIONS:
        if opt.name in skipped:
            continue
        flag = f"--{opt.name}"
        text = opt.cli_help or opt.help
        if opt.kind == "bool":
            parser.add_argument(flag, action="store_true", default=None, help=text)
        elif opt.kind == "choice":
            parser.add_argument(flag, choices=opt.choices, default=None, help=text)
        else:
            metavar = {"path": "DIR", "int": "N"}.get(opt.kind) or (
                "SECONDS" if opt.name.endswith("limit") else opt.name.upper()
            )
            parser.add_argument(flag, type=opt.parse, default=None, metavar=metavar, help=text)


def values_from_args(args: argparse.Namespace, *, cwd: Path) -> dict[str, Any]:
    """The table's values from parsed CLI flags: defaults filled in, relative paths resolved
    against ``cwd``, range-checked (:class:`OptionError`)."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        value = getattr(args, opt.name.replace("-", "_"), None)
        if value is None:
            value = opt.default
        values[opt.name] = resolve_path(value, cwd) if opt.kind == "path" else value
    check_values(values, prefix="--")
    return values
