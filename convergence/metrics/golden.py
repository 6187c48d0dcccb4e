"""Golden curves: a trusted run's metrics saved as a small JSON file, to compare against later.

torchtitan keeps its reference losses as text files; ours is JSON so every metric and some
provenance fit in one file:

    {"schema": 1, "metadata": {...}, "curves": {"loss": {"steps": [...], "values": [...]}}}

Python's ``json`` writes a float as its shortest round-tripping repr, so values read back
bit-identical to the float64 written (NaN/inf are written as ``NaN``/``Infinity``, which
Python reads back too). Any comparison rule can then use the golden as its control.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convergence.metrics.curve import Curve, RunMetrics

SCHEMA = 1


def export_golden(
    metrics: RunMetrics, path: Path, metadata: Mapping[str, Any] | None = None
) -> Path:
    """Write ``metrics`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    curves = {
        name: {
            "steps": [int(s) for s in curve.steps.tolist()],
            "values": [float(v) for v in curve.values.tolist()],
        }
        for name, curve in sorted(metrics.items())
    }
    try:
        meta_text = json.dumps(dict(metadata or {}), sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"golden {path}: metadata must be JSON-serializable ({exc})") from None
    # One line per curve: small, diffable, and still one json.loads away.
    body = ",\n".join(
        f"  {json.dumps(name)}: {json.dumps(curve)}" for name, curve in curves.items()
    )
    text = f'{{\n "schema": {SCHEMA},\n "metadata": {meta_text},\n "curves": {{\n{body}\n }}\n}}'
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_golden(path: Path) -> RunMetrics:
    """The curves of a golden file (see :func:`golden_metadata` for its metadata)."""
    document = _read(Path(path))
    curves = document.get("curves")
    if not isinstance(curves, dict) or not curves:
        raise ValueError(
            f"golden {path}: key 'curves' must map metric names to "
            f'{{"steps": [...], "values": [...]}}; re-export it with export_golden'
        )
    return {str(name): _curve(path, str(name), data) for name, data in curves.items()}


def golden_metadata(path: Path) -> dict[str, Any]:
    metadata = _read(Path(path)).get("metadata", {})
    return dict(metadata) if isinstance(metadata, dict) else {}


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"golden file {path} not found: export one with "
            f"convergence.metrics.golden.export_golden, or fix the path"
        )
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"golden {path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else None
        raise ValueError(
            f"golden {path}: key 'schema' is {found!r}, this version reads "
            f"schema {SCHEMA}; re-export the golden with this version"
        )
    return document


def _curve(path: Path, name: str, data: object) -> Curve:
    key = f"curves.{name}"
    if not isinstance(data, dict) or not {"steps", "values"} <= set(data):
        raise ValueError(f"golden {path}: key '{key}' needs 'steps' and 'values' lists")
    steps, values = data["steps"], data["values"]
    if not isinstance(steps, list) or not isinstance(values, list) or len(steps) != len(values):
        raise ValueError(
            f"golden {path}: key '{key}': 'steps' and 'values' must be lists of "
            f"equal length ({_len(steps)} vs {_len(values)})"
        )
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError(f"golden {path}: key '{key}.steps' must hold integers")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"golden {path}: key '{key}.values' must hold numbers")
    step_array = np.asarray(steps, dtype=np.int64)
    if step_array.size > 1 and not bool(np.all(np.diff(step_array) > 0)):
        raise ValueError(f"golden {path}: key '{key}.steps' must be strictly increasing")
    return Curve(name, step_array, np.asarray([float(v) for v in values], dtype=np.float64))


def _len(value: object) -> str:
    return str(len(value)) if isinstance(value, list) else type(value).__name__


__all__ = ["SCHEMA", "export_golden", "golden_metadata", "load_golden"]
