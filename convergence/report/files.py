"""Writing report files: an atomic write (temp file in the same folder, then a rename) and the
file-system-safe name of a pair. Every report file (documents and PNGs) goes through here."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename, so a
    crash (or Ctrl-C) leaves the previous file or a complete new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        # mkstemp makes the file 0600; reports are read by CI artifact steps and colleagues.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def slug(text: str, default: str = "pair", limit: int = 100) -> str:
    """A file-system-safe stem: runs of other characters than ``A-Za-z0-9_.-`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.")[:limit] or default
