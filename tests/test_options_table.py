"""One option table (convergence/options.py) behind both front ends: every option is a pytest
flag, an ini key and a ``convergence run`` flag, with the same checks and the same settings."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from convergence.cli.app import build_parser, main
from convergence.options import (
    OPTIONS,
    SETTINGS_WITHOUT_OPTION,
    OptionError,
    check_values,
    resolve_path,
    run_settings,
    values_from_args,
)
from convergence.run.jobs import RunSettings


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_option_is_a_pytest_flag_an_ini_key_and_a_cli_flag(tmp_path: Path) -> None:
    shown = _pytest(tmp_path, "--help").stdout
    cli = build_parser().parse_args(["run", "x.toml"])
    for opt in OPTIONS:
        assert f"--convergence-{opt.name}" in shown, opt.name
        assert f"convergence_{opt.name.replace('-', '_')}" in shown, opt.name
        assert hasattr(cli, opt.name.replace("-", "_")), opt.name


def test_the_same_bad_value_is_refused_by_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = _pytest(tmp_path, "--convergence-idle-limit=0")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR
    assert "--convergence-idle-limit must be > 0 seconds, got 0.0" in proc.stderr
    assert main(["run", str(tmp_path / "x.toml"), "--idle-limit", "0"]) == 2
    assert "--idle-limit must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_cli_flags_become_the_runner_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "run",
            "x.toml",
            "--launcher",
            "slurm",
            "--backend",
            "command",
            "--devices",
            "3",
            "--steps",
            "7",
            "--cache-dir",
            "c",
            "--refresh",
            "--no-early-stop",
            "--alpha",
            "0.01",
            "--idle-limit",
            "12",
            "--wall-limit",
            "99",
            "--workdir",
            "w",
        ]
    )
    values = values_from_args(args, cwd=tmp_path)
    settings = run_settings(values, work_dir=values["workdir"])
    assert (settings.launcher, settings.backend, settings.devices, settings.steps) == (
        "slurm",
        "command",
        3,
        7,
    )
    assert settings.cache_dir == tmp_path / "c" and settings.work_dir == tmp_path / "w"
    assert settings.refresh and not settings.early_stop and settings.alpha == 0.01
    assert (settings.idle_limit_s, settings.wall_limit_s) == (12.0, 99.0)
    defaults = run_settings(
        values_from_args(build_parser().parse_args(["run", "x.toml"]), cwd=tmp_path),
        work_dir=tmp_path,
    )
    assert (defaults.launcher, defaults.early_stop, defaults.refresh) == ("local", True, False)
    assert (defaults.idle_limit_s, defaults.wall_limit_s) == (300.0, 3600.0)


PATH_OPTIONS = [opt.name for opt in OPTIONS if opt.kind == "path"]
PROBE_TEST = """
from pytest_convergence.options import read_options

def test_show(pytestconfig):
    values = read_options(pytestconfig).values
    for name in {names!r}:
        print("RESOLVED", name, values[name])
"""


@pytest.mark.parametrize("first_form", ["space", "equals"])
def test_every_path_option_resolves_against_the_invocation_dir_in_both_forms(
    tmp_path: Path, first_form: str
) -> None:
    """``--convergence-X DIR`` and ``--convergence-X=DIR`` are relative to where pytest was
    started (here a subfolder of the rootdir), for every ``kind == "path"`` option; the CLI's
    ``--X DIR`` / ``--X=DIR`` likewise (one resolve_path for both)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "test_probe.py").write_text(PROBE_TEST.format(names=PATH_OPTIONS))
    args, cli_args = [], []
    for i, name in enumerate(PATH_OPTIONS):
        space = (i % 2 == 0) == (first_form == "space")  # alternate, then the other way round
        args += (
            [f"--convergence-{name}", f"d-{name}"] if space else [f"--convergence-{name}=d-{name}"]
        )
        cli_args += [f"--{name}", f"d-{name}"] if space else [f"--{name}=d-{name}"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-s",
            "-q",
            "test_probe.py",
            *args,
        ],
        cwd=sub,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    shown = dict(
        line.split()[1:3] for line in proc.stdout.splitlines() if line.startswith("RESOLVED")
    )
    assert shown == {name: str(sub / f"d-{name}") for name in PATH_OPTIONS}
    values = values_from_args(build_parser().parse_args(["run", "x.toml", *cli_args]), cwd=sub)
    assert {name: values[name] for name in PATH_OPTIONS} == {
        name: sub / f"d-{name}" for name in PATH_OPTIONS
    }


def test_resolve_path_expands_home_and_keeps_absolute_paths(tmp_path: Path) -> None:
    assert resolve_path(None, tmp_path) is None and resolve_path("", tmp_path) is None
    assert resolve_path("~/x", tmp_path) == Path.home() / "x"
    assert resolve_path(str(tmp_path / "abs"), Path("/elsewhere")) == tmp_path / "abs"
    assert resolve_path(Path("rel"), tmp_path) == tmp_path / "rel"


def test_every_run_setting_comes_from_one_option_or_is_named_as_without_one() -> None:
    """RunSettings is built from the table (run_settings reads each option's ``setting``): a
    field added without an option, or an option naming no field, fails here."""
    set_by = [opt.setting for opt in OPTIONS if opt.setting is not None]
    assert len(set_by) == len(set(set_by)), "two options set one RunSettings field"
    fields = {f.name for f in dataclasses.fields(RunSettings)}
    assert set(set_by) <= fields, set(set_by) - fields
    assert set(set_by) | set(SETTINGS_WITHOUT_OPTION) == fields
    assert set(set_by).isdisjoint(SETTINGS_WITHOUT_OPTION)


@pytest.mark.parametrize(
    ("name", "text", "value", "problem"),
    [
        ("devices", "2", 2, None),
        ("devices", "two", None, " is not a int; fix: write a number"),
        ("idle-limit", "1.5", 1.5, None),
        ("tier", "ci", "ci", None),
        ("tier", "weekly", None, ": use one of quick, ci, nightly"),
        ("workdir", "w", "w", None),  # paths are resolved by the front end (resolve_path)
    ],
)
def test_an_option_converts_its_text(
    name: str, text: str, value: object, problem: str | None
) -> None:
    opt = next(o for o in OPTIONS if o.name == name)
    if problem is None:
        assert opt.convert(text) == value
    else:
        with pytest.raises(OptionError) as exc:
            opt.convert(text)
        assert str(exc.value) == problem


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("devices", 0, "--devices must be >= 1, got 0"),
        ("steps", -1, "--steps must be >= 1, got -1"),
        ("alpha", 1.0, "--alpha must be between 0 and 1, got 1.0"),
        ("wall-limit", float("nan"), "--wall-limit must be > 0 seconds, got nan"),
    ],
)
def test_each_option_checks_its_value(name: str, bad: object, message: str) -> None:
    with pytest.raises(OptionError, match=re.escape(message)):
        check_values({name: bad}, prefix="--")
    check_values({name: None}, prefix="--")  # not given: nothing to check
