"""Backends are found by name through the ``convergence.backends`` entry points: the shipped
ones (declared in pyproject.toml) and a third party's, installed as a package of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from convergence.backends import backend_names, get_backend
from convergence.backends.registry import GROUP, SHIPPED
from convergence.preflight import load_checked
from convergence.spec.errors import SpecError
from experiments import builtin_pair

REPO = Path(__file__).resolve().parents[1]


def experiment(folder: Path, backend: str) -> Path:
    return builtin_pair(
        folder,
        train_config="debug",
        backend=backend,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "ddp2", "parallelism": {"dp_replicate": 2}}],
    )


TINY_PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "tiny-convergence-backend"
version = "0.1"

[project.entry-points."convergence.backends"]
tiny = "tiny_backend:TinyBackend"
# A package cannot take a shipped backend's name: this one is ignored.
builtin = "tiny_backend:TinyBackend"
"""

TINY_MODULE = '''\
"""A third party's backend: the built-in trainer under another name."""
from convergence.backends.builtin import BuiltinBackend


class TinyBackend(BuiltinBackend):
    name = "tiny"
'''


def test_the_shipped_backends_are_pyprojects_entry_points() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[GROUP] == SHIPPED
    assert backend_names()[:3] == ("builtin", "torchtitan", "command")


def test_an_unknown_backend_is_a_collection_error_naming_the_key(tmp_path: Path) -> None:
    path = experiment(tmp_path, "nope")
    with pytest.raises(SpecError) as err:
        load_checked(path, rootdir=REPO)
    assert err.value.key == "control.backend" and "unknown backend 'nope'" in str(err.value)
    assert GROUP in str(err.value)  # the fix says how to add one


def test_an_installed_third_party_backend_is_used_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "tiny"
    source.mkdir()
    (source / "pyproject.toml").write_text(TINY_PYPROJECT)
    (source / "tiny_backend.py").write_text(textwrap.dedent(TINY_MODULE))
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    monkeypatch.syspath_prepend(str(site))
    assert "tiny" in backend_names()
    assert type(get_backend("tiny")).__name__ == "TinyBackend"
    assert type(get_backend("builtin")).__name__ == "BuiltinBackend"  # not taken over
    path = experiment(tmp_path, "tiny")
    (pair,) = load_checked(path, rootdir=REPO).pairs  # its preflight and tokens per step ran
    assert pair.control.backend == pair.test.backend == "tiny"


CAPABLE_MODULE = '''\
"""A third party's backends: the built-in trainer under other names, one stating what it can
do (resume, probe, twins by default), one stating nothing."""
from convergence.backends import Capabilities
from convergence.backends.builtin import BuiltinBackend


class CapableBackend(BuiltinBackend):
    name = "capable"
    capabilities = Capabilities(resume=True, probe=True, twins_by_default=True)


class PlainBackend(BuiltinBackend):
    name = "plain"
    capabilities = Capabilities()
'''


def install_entry_points(site: Path, module: str, source: str, points: dict[str, str]) -> None:
    """An installed distribution as it lies on disk (a module and its ``.dist-info`` with the
    entry points), found through ``site`` on sys.path like any installed package."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {module}:{target}\n" for name, target in points.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")


def test_a_third_party_backend_gets_what_it_states_it_can_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capabilities, not names: a backend of another package that states resume and twins
    gets the twin regime by default, a resuming test side and the probe; one that states
    nothing gets the seed band and a clear refusal of resume."""
    from convergence.regimes import get_regime
    from convergence.run.probe import wants_probe

    site = tmp_path / "site"
    site.mkdir()
    install_entry_points(
        site,
        "lab_backends",
        CAPABLE_MODULE,
        {"capable": "CapableBackend", "plain": "PlainBackend"},
    )
    monkeypatch.syspath_prepend(str(site))
    assert {"capable", "plain"} <= set(backend_names())

    def bf16_pair(backend: str, folder: Path, **test: object) -> Path:
        folder.mkdir()
        return builtin_pair(
            folder,
            train_config="debug",
            backend=backend,
            control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
            tests=[{"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}, **test}],
            techniques={"param_dtype": "bfloat16"},
        )

    # Not bitwise pairable (bf16), one seed: the twin regime, its twin derived by the backend.
    (pair,) = load_checked(bf16_pair("capable", tmp_path / "a"), rootdir=REPO).pairs
    assert pair.regime == "twin"
    jobs = get_regime(pair.regime).control_jobs(pair, get_backend("capable"))
    assert jobs[0] == pair.control and len(jobs) > 1  # the control and its twin(s)
    assert wants_probe(pair, "failed")
    resumed = bf16_pair("capable", tmp_path / "b", resume={"at_step": 2})
    (pair,) = load_checked(resumed, rootdir=REPO).pairs
    assert pair.test.resume is not None and pair.test.resume.at_step == 2

    (plain,) = load_checked(bf16_pair("plain", tmp_path / "c"), rootdir=REPO).pairs
    assert plain.regime == "seed" and not wants_probe(plain, "failed")
    with pytest.raises(SpecError, match="'plain' backend does not resume") as err:
        load_checked(bf16_pair("plain", tmp_path / "d", resume={"at_step": 2}), rootdir=REPO)
    assert err.value.key == "test[0].resume"
