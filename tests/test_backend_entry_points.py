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
