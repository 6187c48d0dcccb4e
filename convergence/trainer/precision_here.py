"""Whether this environment can run a config's precision techniques, asked without torch:
the builtin backend's preflight (collection) makes a missing torchao, or a hardware-only
recipe on a machine without a GPU, a skip naming the cause and the fix (NotRunnableHere),
not a collection error; the trainer asks again at start (precision.py). What is found of
torchao itself, for both backends: convergence/torchao_info.py."""

from __future__ import annotations

from convergence.spec.errors import NotRunnableHere
from convergence.torch_info import may_see_gpus
from convergence.torchao_info import INSTALL, TORCHAO_RANGE, torchao_installed, torchao_version
from convergence.trainer.config import TrainConfig


def enabled(cfg: TrainConfig) -> bool:
    """Whether the config converts any linear layer."""
    return cfg.precision.float8 != "none" or cfg.precision.mxfp8


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
