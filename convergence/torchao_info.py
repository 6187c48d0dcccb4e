"""torchao, found without importing it (as torch_info.py reads torch): whether it is installed,
its version, the series the precision techniques are written against, and how to install it.

Both backends ask at collection -- the built-in trainer's precision check
(convergence/trainer/precision_here.py) and the torchtitan backend's preflight -- and the
built-in trainer again at start (trainer/precision.py); the pytest process stays torch-free."""

from __future__ import annotations

import importlib.metadata
import importlib.util

#: The supported torchao series (pyproject.toml's ``precision`` extra).
TORCHAO_RANGE = ("0.18", "0.19")
#: How to install it.
INSTALL = (
    'install the extra: pip install "pytest-convergence[precision]" (from a clone: pip '
    'install -e ".[precision]"), i.e. torchao>=0.18,<0.19 next to your torch'
)


def torchao_installed() -> bool:
    """torchao is importable (found, not imported: the pytest process stays torch-free)."""
    return importlib.util.find_spec("torchao") is not None


def torchao_version() -> str | None:
    """The installed torchao's version (None: not installed, or a source checkout)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None
