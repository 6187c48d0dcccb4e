"""Command-line options and ini keys of the plugin, read once into :class:`Options`.

The options themselves (names, help, types, checks) are the library's table
(``convergence/options.py``, shared with ``convergence run``). Every ``--convergence-*`` flag has
an ini equivalent (``convergence_*`` in ``[tool.pytest.ini_options]`` or ``pytest.ini``); the
flag wins over the ini value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from convergence.options import OPTIONS, Option, OptionError, check_values, resolve_path


def _ini_name(opt: Option) -> str:
    return "convergence_" + opt.name.replace("-", "_")


def _dest(opt: Option) -> str:
    return "convergence_" + opt.name.replace("-", "_")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("convergence", "loss-convergence tests (pytest-convergence)")
    for opt in OPTIONS:
        flag = f"--convergence-{opt.name}"
        if opt.kind == "bool":
            group.addoption(flag, action="store_true", default=None, dest=_dest(opt), help=opt.help)
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
    parser.addini(
        "convergence_paths",
        "experiment TOML files or folders to collect (besides "
        "those inside folders named 'experiments'); -m convergence with no path "
        "collects them even when testpaths does not hold them",
        type="paths",
        default=[],
    )


@dataclass(frozen=True)
class Options:
    """The plugin's settings after merging flags and ini values: every option of the shared
    table by name (``options["tier"]``), converted, checked, paths resolved, the workdir
    defaulted. Nothing is copied field by field: a new option of the table is here as is."""

    values: Mapping[str, Any]
    """What :func:`convergence.options.run_settings` reads."""

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def _raw(config: pytest.Config, opt: Option) -> tuple[Any, Path]:
    """The value and the folder a relative path in it is relative to."""
    value = config.getoption(_dest(opt))
    if value is not None:
        return value, config.invocation_params.dir
    ini = config.getini(_ini_name(opt))
    base = config.inipath.parent if config.inipath else config.rootpath
    if opt.kind == "bool":
        return bool(ini), base
    return (ini if ini not in ("", None) else opt.default), base


def _convert(opt: Option, value: Any) -> Any:
    """An ini value as the option's type (a flag's was converted by argparse already)."""
    try:
        return opt.convert(value)
    except OptionError as exc:
        raise pytest.UsageError(f"ini option {_ini_name(opt)} = {value!r}{exc}") from None


def default_workdir(config: pytest.Config) -> Path:
    """``<rootdir>/.convergence`` when pytest found a config file (the rootdir is then the
    project's), else ``<invocation dir>/.convergence``: without an ini file pytest takes the
    common ancestor of the path arguments as rootdir, which may be a parent folder shared with
    other work, or a report folder named on the command line."""
    base = config.rootpath if config.inipath is not None else config.invocation_params.dir
    return base / ".convergence"


def read_options(config: pytest.Config) -> Options:
    raw = {opt.name: _raw(config, opt) for opt in OPTIONS}
    v = {opt.name: _convert(opt, raw[opt.name][0]) for opt in OPTIONS}
    base = {name: where for name, (_, where) in raw.items()}
    try:
        check_values(v, prefix="--convergence-")
    except OptionError as exc:
        raise pytest.UsageError(str(exc)) from None
    resolved = {
        **v,
        **{
            opt.name: resolve_path(v[opt.name], base[opt.name])
            for opt in OPTIONS
            if opt.kind == "path"
        },
    }
    resolved["workdir"] = resolved["workdir"] or default_workdir(config)
    return Options(values=resolved)
