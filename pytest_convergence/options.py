"""Command-line options and ini keys of the plugin, read once into :class:`Options`.

Every ``--convergence-*`` flag has an ini equivalent (``convergence_*`` in ``[tool.pytest.ini_options]``
or ``pytest.ini``); the flag wins over the ini value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from convergence.spec.experiment import TIERS  # quick < ci < nightly


@dataclass(frozen=True, kw_only=True)
class _Opt:
    name: str
    """Suffix: ``--convergence-<name>`` and ini ``convergence_<name with _>``."""
    help: str
    kind: str = "string"
    """``string`` | ``int`` | ``float`` | ``bool`` | ``choice``."""
    choices: tuple[str, ...] = ()
    default: Any = None


_OPTIONS: tuple[_Opt, ...] = (
    _Opt(name="backend", help="override every job's trainer backend (builtin, torchtitan, "
         "command)", kind="choice", choices=("builtin", "torchtitan", "command")),
    _Opt(name="launcher", help="how jobs are started: local torchrun or srun+torchrun",
         kind="choice", choices=("local", "slurm"), default="local"),
    _Opt(name="devices", help="devices (GPUs, or CPU slots) jobs may use; default: detect",
         kind="int"),
    _Opt(name="steps", help="override every job's steps (quick looks; verdicts still apply)",
         kind="int"),
    _Opt(name="cache-dir", help="run cache folder (default: <workdir>/cache)"),
    _Opt(name="refresh", help="ignore cached control runs and run them again", kind="bool",
         default=False),
    _Opt(name="report", help="write report.json/.md/.html and plots into this folder"),
    _Opt(name="no-early-stop", help="always run the test job to its last step", kind="bool",
         default=False),
    _Opt(name="alpha", help="level of the seed-band equivalence test (TOST)", kind="float"),
    _Opt(name="tier", help="run pairs up to this tier: quick < ci < nightly (default quick); "
         "pairs of higher tiers are deselected", kind="choice", choices=TIERS,
         default="quick"),
    _Opt(name="workdir", help="run folders, device-pool state and cache (default: "
         "<rootdir>/.convergence when pytest found a config file, else ./.convergence)"),
    _Opt(name="idle-limit", help="watchdog: end a job when no new metrics line came for this "
         "many seconds (a rank hung in a collective); default 300", kind="float"),
    _Opt(name="wall-limit", help="end a job after this many seconds in all; default 3600",
         kind="float"),
)


def _ini_name(opt: _Opt) -> str:
    return "convergence_" + opt.name.replace("-", "_")


def _dest(opt: _Opt) -> str:
    return "convergence_" + opt.name.replace("-", "_")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("convergence", "loss-convergence tests (pytest-convergence)")
    for opt in _OPTIONS:
        flag = f"--convergence-{opt.name}"
        if opt.kind == "bool":
            group.addoption(flag, action="store_true", default=None, dest=_dest(opt),
                            help=opt.help)
            parser.addini(_ini_name(opt), opt.help, type="bool", default=opt.default)
            continue
        kwargs: dict[str, Any] = {"dest": _dest(opt), "default": None, "help": opt.help}
        if opt.kind == "choice":
            kwargs["choices"] = opt.choices
        elif opt.kind == "int":
            kwargs["type"] = int
        elif opt.kind == "float":
            kwargs["type"] = float
        group.addoption(flag, **kwargs)
        default = "" if opt.default is None else str(opt.default)
        parser.addini(_ini_name(opt), opt.help, default=default)
    parser.addini("convergence_paths", "extra experiment TOML files to collect (besides "
                  "*.toml inside folders named 'experiments')", type="paths", default=[])


@dataclass(frozen=True, kw_only=True)
class Options:
    """The plugin's settings after merging flags and ini values."""

    backend: str | None
    launcher: str
    devices: int | None
    steps: int | None
    cache_dir: Path | None
    refresh: bool
    report_dir: Path | None
    early_stop: bool
    alpha: float | None
    tier: str
    workdir: Path
    idle_limit_s: float | None = None
    """No-progress watchdog per job (None: the library default)."""
    wall_limit_s: float | None = None
    """Wall-clock limit per job (None: the library default)."""


def _raw(config: pytest.Config, opt: _Opt) -> tuple[Any, Path]:
    """The value and the folder a relative path in it is relative to."""
    value = config.getoption(_dest(opt))
    if value is not None:
        return value, config.invocation_params.dir
    ini = config.getini(_ini_name(opt))
    base = config.inipath.parent if config.inipath else config.rootpath
    if opt.kind == "bool":
        return bool(ini), base
    return (ini if ini not in ("", None) else opt.default), base


def _convert(opt: _Opt, value: Any) -> Any:
    if value is None or opt.kind in ("bool", "string"):
        return value
    try:
        if opt.kind == "int":
            return int(value)
        if opt.kind == "float":
            return float(value)
    except ValueError:
        raise pytest.UsageError(
            f"ini option {_ini_name(opt)} = {value!r} is not a {opt.kind}; "
            f"fix: write a number") from None
    if value not in opt.choices:
        raise pytest.UsageError(f"ini option {_ini_name(opt)} = {value!r}: use one of "
                                f"{', '.join(opt.choices)}")
    return value


def _path(value: str | None, base: Path) -> Path | None:
    if not value:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def default_workdir(config: pytest.Config) -> Path:
    """``<rootdir>/.convergence`` when pytest found a config file (the rootdir is then the
    project's), else ``<invocation dir>/.convergence``: without an ini file pytest takes the
    common ancestor of the path arguments as rootdir, which may be a parent folder shared with
    other work, or a report folder named on the command line."""
    base = config.rootpath if config.inipath is not None else config.invocation_params.dir
    return base / ".convergence"


def read_options(config: pytest.Config) -> Options:
    raw = {opt.name: _raw(config, opt) for opt in _OPTIONS}
    v = {opt.name: _convert(opt, raw[opt.name][0]) for opt in _OPTIONS}
    base = {name: where for name, (_, where) in raw.items()}
    if v["devices"] is not None and v["devices"] < 1:
        raise pytest.UsageError("--convergence-devices must be >= 1")
    if v["steps"] is not None and v["steps"] < 1:
        raise pytest.UsageError("--convergence-steps must be >= 1")
    for name in ("idle-limit", "wall-limit"):
        if v[name] is not None and not v[name] > 0:
            raise pytest.UsageError(f"--convergence-{name} must be > 0 seconds, got {v[name]}")
    return Options(
        backend=v["backend"], launcher=v["launcher"], devices=v["devices"], steps=v["steps"],
        cache_dir=_path(v["cache-dir"], base["cache-dir"]), refresh=bool(v["refresh"]),
        report_dir=_path(v["report"], base["report"]), early_stop=not v["no-early-stop"],
        alpha=v["alpha"], tier=v["tier"],
        workdir=_path(v["workdir"], base["workdir"]) or default_workdir(config),
        idle_limit_s=v["idle-limit"], wall_limit_s=v["wall-limit"],
    )
