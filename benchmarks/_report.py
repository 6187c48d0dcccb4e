"""Shared by the benchmark scripts: the machine line and BENCHMARKS.md sections.

Each script owns one section between ``<!-- name:begin -->`` / ``<!-- name:end -->`` markers and
replaces only that section, so scripts can be rerun in any order.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = REPO / "BENCHMARKS.md"


def machine() -> str:
    """One line naming the machine the numbers were taken on."""
    import torch

    gpu = (
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no GPU"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"1-min load {load:.1f} at the end"
    )


def record_line(path: Path, line: dict[str, Any]) -> None:
    """Append ``line`` to the JSONL results file ``path`` as soon as it is measured (a long
    benchmark stopped midway keeps every pair it finished) and print it."""
    text = json.dumps(line, default=str)
    with path.open("a") as out:
        out.write(text + "\n")
    print(text, flush=True)


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace section ``name`` of BENCHMARKS.md with ``body`` (append it when absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}\n"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")
