"""Backends by name: the shipped ones and any that an installed package registers.

A backend is a class (or any callable) that returns an object satisfying
:class:`convergence.backends.base.Backend`, registered under the entry-point group
``convergence.backends``; a lab's Megatron or NeMo backend is a package of its own:

    # its pyproject.toml
    [project.entry-points."convergence.backends"]
    megatron = "my_lab.convergence_megatron:MegatronBackend"

after which ``backend = "megatron"`` works in experiment files. The shipped backends are
registered the same way (pyproject.toml) and loaded by name like any other: nothing imports a
backend module before a job names it (the torchtitan one needs an optional extra).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, entry_points
from importlib.metadata import version as _dist_version
from typing import TYPE_CHECKING

from convergence.backends.base import Backend
from convergence.spec.errors import NotRunnableHere, SpecError

GROUP = "convergence.backends"

SHIPPED: dict[str, str] = {
    "builtin": "convergence.backends.builtin:BuiltinBackend",
    "torchtitan": "convergence.backends.torchtitan:TorchtitanBackend",
    "command": "convergence.backends.command:CommandBackend",
}
"""The shipped backends' entry points, as pyproject.toml declares them (a test holds the two
equal): read from here too, so that a source checkout whose installed metadata is older (or
absent) still has them."""

#: How to get a shipped backend whose package is missing. It is not on the public package
#: index: it installs from the user's clone (or a wheel built from one), like the README says.
_INSTALL_HINTS = {
    "torchtitan": "install the extra into this environment from your pytest-convergence clone: "
    'pip install "./pytest-convergence[torchtitan]" (or pip install -e ".[torchtitan]" inside '
    "it), plus triton to import torchtitan on CPU",
}

#: The package behind each optional backend, and per release series the torch release series
#: it runs with. torchtitan 0.3: exactly torch 2.13.x. Its 0.3.0 imports torch names that
#: torch 2.11 lacks (``torch.distributed.fsdp.DataParallelMeshDims``), and every patch the
#: backend applies (backends/torchtitan/patches.py, resume.py, anchors.py, probe.py) reaches
#: into torch 2.13's internals and is pinned to that series (a test holds the pins and this
#: table equal), so 2.12 and 2.14 are refused too. pyproject's ``[torchtitan]`` extra says the
#: same range. A release series not listed here is not checked ahead: its import is the check
#: (:func:`not_importable`).
_PACKAGES = {"torchtitan": "torchtitan"}
TORCH_SERIES: dict[str, dict[str, str]] = {"torchtitan": {"0.3": "2.13"}}


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _installed(distribution: str) -> str | None:
    try:
        return _dist_version(distribution)
    except PackageNotFoundError:  # a source checkout on PYTHONPATH has no metadata
        return None


def torch_series(package: str, package_version: str) -> str | None:
    """The torch series (``"2.13"``: any 2.13.x) ``package`` at ``package_version`` runs
    with, if known."""
    series = _major_minor(package_version)
    for listed, torch in TORCH_SERIES.get(package, {}).items():
        if series is not None and series == _major_minor(listed):
            return torch
    return None


def torch_mismatch(package: str, package_version: str, torch_version: str) -> str | None:
    """The torch series ``package_version`` needs when ``torch_version`` is outside it."""
    wanted = torch_series(package, package_version)
    have = _major_minor(torch_version)
    if wanted is None or have is None:
        return None
    return None if have == _major_minor(wanted) else wanted


def requirement_problem(name: str) -> NotRunnableHere | None:
    """Why the optional backend ``name`` cannot run in this environment, known without
    importing it (a missing package, a torch older than its release needs), or None."""
    package = _PACKAGES.get(name)
    if package is None:
        return None
    if importlib.util.find_spec(package) is None:
        return NotRunnableHere(
            f"needs the {name} backend, but {package} is not installed in this environment",
            key="backend",
            fix=_INSTALL_HINTS[name],
        )
    package_version, torch_version = _installed(package), _installed("torch")
    if package_version is None or torch_version is None:
        return None
    wanted = torch_mismatch(package, package_version, torch_version)
    if wanted is None:
        return None
    return NotRunnableHere(
        f"needs the {name} backend, but {package} {package_version} runs with torch "
        f"{wanted}.x only (the backend's patches are written for it) and this is torch "
        f"{torch_version}",
        key="backend",
        fix=f"install torch {wanted}.x (your CPU or CUDA build: pip install "
        f"'torch=={wanted}.*'), or a {package} release made for torch {torch_version}",
    )


#: The module a job of each optional backend runs (``-m torchtitan.train``): imported in a
#: fresh interpreter to name the first import that fails when the package's own error hides it
#: (torchtitan's config manager says only "Cannot import config_registry for module ...", and
#: in this process the half-imported packages would not fail again).
_IMPORT_PROBES = {"torchtitan": "torchtitan.train"}


@functools.cache
def _first_failing_import(module: str) -> str | None:
    """The last line of ``import module``'s error in a fresh interpreter, or None. Run only on
    the failure path, once per session and module (seconds)."""
    try:
        result = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if result.returncode != 0 and lines else None


def _import_failure(name: str, exc: ImportError) -> str:
    """The error, and the import under it where the package's own message hides that."""
    text = f"{type(exc).__name__}: {exc}"
    probe = _IMPORT_PROBES.get(name)
    first = _first_failing_import(probe) if probe else None
    if first is not None and first != text:
        text += f" (under it, `import {probe}` fails: {first})"
    return text


def not_importable(
    name: str, exc: ImportError, *, file: str | None = None, where: str = ""
) -> NotRunnableHere:
    """A backend whose package is installed but fails to import in this environment (built
    for another torch): a pair this session cannot run, with the import error and the fix.
    ``where``: what the message starts with (the side of the pair)."""
    package = _PACKAGES.get(name, name)
    package_version, torch_version = _installed(package), _installed("torch") or "?"
    wanted = torch_series(package, package_version or "")
    if wanted is not None:
        fix = (
            f"{package} {package_version} needs torch {wanted}.x: install that torch (your "
            f"CPU or CUDA build), or a {package} release made for torch {torch_version}"
        )
    else:
        fix = (
            f"install a {package} release made for torch {torch_version}, or the torch "
            f"{package} was made for"
        )
    return NotRunnableHere(
        f"{where}needs the {name} backend, but {package} "
        f"{package_version or '(source checkout)'} cannot be imported with torch "
        f"{torch_version}: {_import_failure(name, exc)}",
        file=file,
        key="backend",
        fix=fix,
    )


def _targets() -> dict[str, str]:
    """name -> ``module:attribute``; a package cannot take a shipped backend's name."""
    targets = dict(SHIPPED)
    for point in entry_points(group=GROUP):
        targets.setdefault(point.name, point.value)
    return targets


def backend_names() -> tuple[str, ...]:
    """Every backend a job may name: the shipped ones first, then the installed ones."""
    return tuple(_targets())


def get_backend(name: str) -> Backend:
    """A new instance of the backend called ``name``; SpecError (key ``backend``) when there
    is none or its package cannot be imported."""
    targets = _targets()
    target = targets.get(name)
    if target is None:
        raise SpecError(
            f"unknown backend {name!r}",
            key="backend",
            fix=f"use one of {', '.join(targets)} (or install a package that "
            f"registers it under the {GROUP!r} entry points)",
        )
    # Not an error in the file: this session lacks an optional package, or has one made for
    # another torch; collection skips the pair with this reason (--convergence-strict: an
    # error). Checked before the import, which would fail with a less helpful message.
    problem = requirement_problem(name)
    if problem is not None:
        raise problem
    module, _, attribute = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        if name in _PACKAGES:
            raise not_importable(name, exc) from None
        raise NotRunnableHere(
            f"needs the {name} backend, which is not available here: {exc}",
            key="backend",
            fix=f"install the package that provides {target}",
        ) from None
    backend: Backend = factory()
    return backend


if TYPE_CHECKING:  # mypy --strict checks that the shipped backends satisfy the Protocol
    from convergence.backends.builtin import BuiltinBackend
    from convergence.backends.command import CommandBackend
    from convergence.backends.torchtitan import TorchtitanBackend

    _SHIPPED_ARE_BACKENDS: tuple[Backend, ...] = (
        BuiltinBackend(),
        CommandBackend(),
        TorchtitanBackend(),
    )
