"""Whether this environment can run a config's precision techniques, asked without torch:
the builtin backend's preflight (collection) makes a missing torchao, or a hardware-only
recipe on a machine without a GPU, a skip naming the cause and the fix (NotRunnableHere),
not a collection error; the trainer asks again at start (precision.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from convergence.spec.errors import NotRunnableHere
from convergence.torch_info import may_see_gpus
from convergence.trainer.config import TrainConfig

#: The supported torchao series (pyproject.toml's ``precision`` extra).
TORCHAO_RANGE = ("0.18", "0.19")
#: How to install it.
INSTALL = (
    'install the extra: pip install "pytest-convergence[precision]" (from a clone: pip '
    'install -e ".[precision]"), i.e. torchao>=0.18,<0.19 next to your torch'
)


def enabled(cfg: TrainConfig) -> bool:
    """Whether the config converts any linear layer."""
    return cfg.precision.float8 != "none" or cfg.precision.mxfp8


def torchao_installed() -> bool:
    """torchao is importable (found, not imported: the pytest process stays torch-free)."""
    return importlib.util.find_spec("torchao") is not None


def torchao_version() -> str | None:
    """The installed torchao's version (None: not installed, or a source checkout)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def _series(version: str) -> tuple[int, int]:
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_precision_here(cfg: TrainConfig, *, file: str) -> None:
    """Raise NotRunnableHere when the config's precision techniques cannot run here."""
    if not enabled(cfg):
        return
    what = "mxfp8" if cfg.precision.mxfp8 else f"float8 = {cfg.precision.float8!r}"
    if not torchao_installed():
        raise NotRunnableHere(
            f"{what} needs torchao, which is not installed in this environment",
            file=file,
            key="techniques",
            fix=INSTALL,
        )
    version = torchao_version() or ""  # "": a source checkout on PYTHONPATH, used as is
    low, high = (_series(v) for v in TORCHAO_RANGE)
    if version and not low <= _series(version) < high:
        raise NotRunnableHere(
            f"{what} is written against torchao {TORCHAO_RANGE[0]}.x; this is torchao {version}",
            file=file,
            key="techniques",
            fix=INSTALL,
        )
    if cfg.precision.kernels == "hardware" and not may_see_gpus():
        raise NotRunnableHere(
            f'{what} with precision.kernels = "hardware" needs a GPU with float8 matmuls, '
            "and this torch sees none",
            file=file,
            key="precision.kernels",
            fix='set precision.kernels = "auto" (emulated on CPU) or run on such a GPU',
        )
