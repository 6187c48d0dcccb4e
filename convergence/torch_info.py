"""What the installed torch is, without importing it (importing torch costs seconds).

The pytest process needs torch's version (the run cache's key) and whether torch may see a GPU
(device detection, the hardware fingerprint) before its first job, but never torch itself: the
jobs run in their own processes. torch's ``version.py`` is plain assignments written at build
time, so its fields are read from the file; anything unexpected falls back to ``import torch``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_FIELDS = ("__version__", "cuda", "hip")


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: str | None
    hip: str | None

    @property
    def has_gpu(self) -> bool:
        """Built with CUDA or ROCm (both are torch.cuda)."""
        return self.cuda is not None or self.hip is not None


@cache
def torch_build() -> TorchBuild | None:
    """The installed torch's version.py, read as text; None when it cannot be told."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return None
    try:
        tree = ast.parse((Path(locations[0]) / "version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in _FIELDS:
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                return None
    version, cuda, hip = (found.get(name, ...) for name in _FIELDS)
    if not isinstance(version, str) or not all(
        v is None or isinstance(v, str) for v in (cuda, hip)
    ):
        return None
    return TorchBuild(version=version, cuda=cuda, hip=hip)  # type: ignore[arg-type]


def torch_version() -> str:
    """``str(torch.__version__)``, read from version.py when torch is not imported yet."""
    if "torch" not in sys.modules:
        build = torch_build()
        if build is not None:
            return build.version
    import torch  # lazy: only when version.py could not be read (or torch is imported)

    return str(torch.__version__)


def older_than(version: str, floor: str) -> bool:
    """Whether ``version`` ("2.11.0+cu128") is below ``floor`` ("2.12"), by major.minor;
    False when either does not read as one."""
    have, need = _major_minor(version), _major_minor(floor)
    return have is not None and need is not None and have < need


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def cuda_hidden() -> bool:
    """CUDA_VISIBLE_DEVICES hides every GPU ("" or a list starting with -1): torch sees none."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and (not value.strip() or value.strip().startswith("-1"))


def may_see_gpus() -> bool:
    """False when torch surely sees no GPU (hidden, or a build without CUDA/ROCm); True means
    ask torch (``torch.cuda.is_available()``)."""
    if cuda_hidden():
        return False
    if "torch" in sys.modules:
        return True
    build = torch_build()
    return build is None or build.has_gpu
