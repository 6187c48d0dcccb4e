"""Import every module of the library and the plugin (.ci/run's old-torch phase).

A module that needs an optional backend this environment lacks (torchtitan, or a torch too old
for it) is left out and listed; any other import error fails, naming the module. ``__main__``
modules are entry points, not imported.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

import convergence
import pytest_convergence
from convergence.backends.registry import requirement_problem

OPTIONAL = {"torchtitan": "convergence.backends.torchtitan"}


def main() -> int:
    lacking = {
        prefix: problem
        for name, prefix in OPTIONAL.items()
        if (problem := requirement_problem(name)) is not None
    }
    imported, failed = 0, 0
    for package in (convergence, pytest_convergence):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.endswith("__main__"):
                continue
            if any(info.name.startswith(prefix) for prefix in lacking):
                continue
            try:
                importlib.import_module(info.name)
                imported += 1
            except Exception:  # noqa: BLE001 - every failure is reported, then the exit code
                failed += 1
                print(f"cannot import {info.name}:", file=sys.stderr)
                traceback.print_exc()
    for prefix, problem in lacking.items():
        print(f"left out {prefix}*: {problem.detail}")
    print(f"imported {imported} modules with torch {_torch()}; {failed} failed")
    return 1 if failed else 0


def _torch() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
