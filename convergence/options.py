"""The session options: one table for the pytest plugin and the ``convergence run`` CLI.

Each option is written once here: its name, help, type, choices and default, the checks on its
value and how it becomes a :class:`~convergence.run.runner.RunSettings` field. The plugin turns
the table into ``--convergence-<name>`` flags and ``convergence_<name>`` ini keys
(``pytest_convergence/options.py``); the CLI into ``convergence run --<name>`` flags. So both
front ends accept the same settings, with the same meaning and the same errors.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from convergence.backends import backend_names
from convergence.launch.types import Progress
from convergence.run.runner import RunSettings
from convergence.spec.experiment import TIERS  # quick < ci < nightly

OptionKind = Literal["string", "path", "int", "float", "bool", "choice"]
KINDS: tuple[OptionKind, ...] = get_args(OptionKind)


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


OPTIONS: tuple[Option, ...] = (
    Option(
        name="backend",
        help=f"override every job's trainer backend ({', '.join(backend_names())})",
        kind="choice",
        choices=backend_names(),
    ),
    Option(
        name="launcher",
        help="how jobs are started: local torchrun or srun+torchrun",
        kind="choice",
        choices=("local", "slurm"),
        default="local",
    ),
    Option(
        name="devices",
        help="devices (GPUs, or CPU slots) jobs may use; default: detect",
        kind="int",
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
    ),
    Option(name="cache-dir", help="run cache folder (default: <workdir>/cache)", kind="path"),
    Option(
        name="refresh",
        help="ignore cached control runs and run them again",
        kind="bool",
        default=False,
    ),
    Option(
        name="report", help="write report.json/.md/.html and plots into this folder", kind="path"
    ),
    Option(
        name="no-early-stop",
        help="always run the test job to its last step",
        kind="bool",
        default=False,
    ),
    Option(name="alpha", help="level of the seed-band equivalence test (TOST)", kind="float"),
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
    ),
    Option(
        name="wall-limit",
        help="end a job after this many seconds in all; default 3600",
        kind="float",
    ),
)
BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}


class OptionError(ValueError):
    """A value that no run can use; the message names the option (without its prefix)."""


def check_values(values: Mapping[str, Any], *, prefix: str) -> None:
    """Range checks on converted values (``prefix``: ``--convergence-`` or ``--``)."""
    for name in ("devices", "steps"):
        if values.get(name) is not None and values[name] < 1:
            raise OptionError(f"{prefix}{name} must be >= 1, got {values[name]}")
    for name in ("idle-limit", "wall-limit"):
        if values.get(name) is not None and not values[name] > 0:
            raise OptionError(f"{prefix}{name} must be > 0 seconds, got {values[name]}")
    alpha = values.get("alpha")
    if alpha is not None and not 0 < alpha < 1:
        raise OptionError(f"{prefix}alpha must be between 0 and 1, got {alpha}")


def run_settings(
    values: Mapping[str, Any],
    *,
    work_dir: Path,
    on_progress: Callable[[Progress], None] | None = None,
) -> RunSettings:
    """The Runner's settings from checked values (paths already resolved)."""
    settings = RunSettings(
        work_dir=work_dir,
        cache_dir=values.get("cache-dir"),
        refresh=bool(values.get("refresh")),
        early_stop=not values.get("no-early-stop"),
        launcher=values.get("launcher") or BY_NAME["launcher"].default,
        devices=values.get("devices"),
        steps=values.get("steps"),
        alpha=values.get("alpha"),
        backend=values.get("backend"),
        on_progress=on_progress,
    )
    limits = {
        field: values[name]
        for name, field in (("idle-limit", "idle_limit_s"), ("wall-limit", "wall_limit_s"))
        if values.get(name) is not None
    }
    return replace(settings, **limits) if limits else settings


def resolve_path(value: str | Path | None, base: Path) -> Path | None:
    """A ``path`` option's value: ``~`` expanded, a relative path taken relative to ``base``,
    where it was written (the invocation directory for a flag, the ini file's folder for an
    ini key). None or "" (an ini key left empty) is None. Both front ends call this."""
    if value is None or value == "":
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


_ARG_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "path": Path}


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
            parser.add_argument(
                flag, type=_ARG_TYPES.get(opt.kind, str), default=None, metavar=metavar, help=text
            )


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
