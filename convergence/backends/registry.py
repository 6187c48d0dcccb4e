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

import importlib
from importlib.metadata import entry_points
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

#: How to get a shipped backend whose module cannot be imported.
_INSTALL_HINTS = {"torchtitan": "pip install 'pytest-convergence[torchtitan]' (and triton)"}


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
    module, _, attribute = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        # Not an error in the file: this session lacks an optional package; collection
        # skips the pair with this reason (--convergence-strict: an error).
        raise NotRunnableHere(
            f"needs the {name} backend, which is not available here: {exc}",
            key="backend",
            fix=_INSTALL_HINTS.get(name, f"install the package that provides {target}"),
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
