"""The ``convergence`` command: every subcommand is a module of this package.

    app.py        the parser: registers each subcommand's ``add_..._parser``; run, report, configs
    common.py     what subcommands share: exit codes, report folders, the option table's values
    compare.py    compare, export-golden           cache.py      cache list/verify/prune
    ab.py         the same jobs from two commits   bisect.py     the first commit a pair fails at
    nightly.py    nightly, record, trend, decide   calibrate.py  this machine's noise floors

Each parses its arguments, calls the library (bisection.py, calibration_runs.py, worktrees.py,
the Runner, ...) and prints; the work itself is the library's.

The front ends sit on the library's top layer (tests/test_layers.py): nothing below imports
them. ``main`` is imported lazily so that ``import convergence.cli.common`` does not load every
subcommand. (Not ``main.py``: importing a submodule sets it as an attribute of the package,
which would shadow this ``main`` function.)
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``convergence`` (pyproject.toml) and ``python -m convergence.cli``."""
    from convergence.cli.app import main as run

    return run(argv)
